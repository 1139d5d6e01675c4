"""``speculative_config``: which proposer, how many tokens; refused at startup when the engine cannot run it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyserve.config import ModelConfig

MAX_SPECULATIVE_TOKENS = 15  # verify rows hold k + 1 <= 16 tokens (the verify kernels' scratch depth)
METHODS = ("ngram", "mtp")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # The per-step speculation length (hyserve.speculative.adaptive): None = the device's default (on for CUDA).
    adaptive: bool | None = None
    disable_by_batch_size: int | None = None  # vLLM's: no drafts in a step of at least this many decoding requests
    # vLLM's benchmarking method: "synthetic" draws each draft's verdict in place of judging it by the target's
    # logits, drafts 1 .. i all accepted with probability synthetic_acceptance_rates[i - 1] (RejectionSampler).
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_config: ModelConfig) -> SpeculativeConfig:
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a dict / JSON object (--speculative-config)")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive",
                 "disable_by_batch_size", "rejection_sample_method", "synthetic_acceptance_rates",
                 "synthetic_acceptance_length"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)} "
                             "(--speculative-config)")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported; use one of {list(METHODS)} "
                             "(--speculative-config)")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}] (got {k!r}) (--speculative-config)")
        lo = raw.get("prompt_lookup_min", 1)
        hi = raw.get("prompt_lookup_max", 4)
        if method == "ngram":
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config: {name} must be a positive int (got {v!r}) "
                                     "(--speculative-config)")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min={lo} > prompt_lookup_max={hi} "
                                 "(--speculative-config)")
        adaptive = raw.get("adaptive")
        if adaptive is not None and not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false (got {adaptive!r}) "
                             "(--speculative-config)")
        disable = raw.get("disable_by_batch_size")
        if disable is not None and (not isinstance(disable, int) or isinstance(disable, bool) or disable < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be a positive int (got {disable!r}) "
                             "(--speculative-config)")
        if method == "mtp" and model_config.mtp_num_hidden_layers < 1:
            raise ValueError("speculative_config method 'mtp' needs a checkpoint with mtp.* weights and "
                             "mtp_num_hidden_layers >= 1; this one has none: use method 'ngram' or drop "
                             "--speculative-config")
        rsm = raw.get("rejection_sample_method", "standard")
        if rsm not in ("standard", "synthetic"):
            raise ValueError(f"speculative_config: rejection_sample_method must be 'standard' or 'synthetic' (got "
                             f"{rsm!r}) (--speculative-config)")
        rates = synthetic_rates(raw, k) if rsm == "synthetic" else None
        if rsm != "synthetic" and (raw.get("synthetic_acceptance_rates") is not None
                                   or raw.get("synthetic_acceptance_length") is not None):
            raise ValueError("speculative_config: synthetic_acceptance_rates and synthetic_acceptance_length need "
                             "rejection_sample_method 'synthetic' (--speculative-config)")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                   adaptive=adaptive, disable_by_batch_size=disable, rejection_sample_method=rsm,
                   synthetic_acceptance_rates=rates)


def synthetic_rates(raw: dict[str, Any], k: int) -> tuple[float, ...]:
    """vLLM's synthetic acceptance: per draft position i, the probability that drafts 1 .. i are all accepted, from
    exactly one of ``synthetic_acceptance_rates`` (k entries in [0, 1], non-increasing) or
    ``synthetic_acceptance_length`` (a mean of accepted drafts plus one in [1, k + 1], spread as vLLM does: the
    first positions always accepted, one position at the fraction left, the rest never)."""
    rates, length = raw.get("synthetic_acceptance_rates"), raw.get("synthetic_acceptance_length")
    if (rates is None) == (length is None):
        raise ValueError("speculative_config: rejection_sample_method 'synthetic' needs exactly one of "
                         "synthetic_acceptance_rates or synthetic_acceptance_length (--speculative-config)")
    if rates is not None:
        if not isinstance(rates, (list, tuple)) or len(rates) != k or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"speculative_config: synthetic_acceptance_rates must be {k} numbers in [0, 1] (one per "
                             f"draft position; got {rates!r}) (--speculative-config)")
        if any(rates[i] > rates[i - 1] for i in range(1, k)):
            raise ValueError(f"speculative_config: synthetic_acceptance_rates must be non-increasing (position i "
                             f"accepted means 1 .. i-1 were; got {list(rates)}) (--speculative-config)")
        return tuple(float(r) for r in rates)
    if not isinstance(length, (int, float)) or isinstance(length, bool) or not 1.0 <= length <= k + 1:
        raise ValueError(f"speculative_config: synthetic_acceptance_length must be a number in [1, {k + 1}] "
                         f"(got {length!r}) (--speculative-config)")
    drafts = float(length) - 1
    full = int(drafts)
    return tuple(([1.0] * full + [drafts - full] + [0.0] * k)[:k])


def conditional_rates(rates: tuple[float, ...]) -> list[float]:
    """Per draft position i, the probability that it is accepted given that positions 1 .. i-1 were (0 after a
    position that is never reached)."""
    out, before = [], 1.0
    for r in rates:
        out.append(r / before if before > 0 else 0.0)
        before = r
    return out
