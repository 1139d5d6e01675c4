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

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_config: ModelConfig) -> SpeculativeConfig:
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a dict / JSON object (--speculative-config)")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive",
                 "disable_by_batch_size"}
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
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                   adaptive=adaptive, disable_by_batch_size=disable)
