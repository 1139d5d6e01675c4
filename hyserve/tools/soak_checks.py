"""The soak's records and checks: one record per request (``TurnRecord``), each request's findings
(``RequestCheck``: degenerate output, divergence from the replay, the transformers reference, aborts), and the
summary table. ``hyserve.tools.soak`` drives the workload and calls these."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hyserve.tools.client import Completion
from hyserve.tools.detectors import detect_degenerate, finding_kind, first_divergence
from hyserve.tools.workload import ABORT_PHASES, AbortPoint

logger = logging.getLogger("hyserve.soak")

# ------------------------------------------------------------------------------------------------------ records


@dataclass(slots=True)
class TurnRecord:
    """One request of the soak: a conversation's turn, its prompt ids and what came back. ``planned_abort``: where
    the plan had its client abandon it; ``abort``: where that happened (``phase`` reached, ``output_tokens``
    received and, offline, ``prompt_scheduled`` tokens and the ``steps_in_flight`` at the abort, of which
    ``steps_naming_it`` had a row of it), None when the request ran to its end."""

    request_id: str
    conv_id: int
    turn: int
    prompt_ids: list[int]
    completion: Completion
    planned_abort: AbortPoint | None = None
    abort: dict[str, Any] | None = None


@dataclass(slots=True)
class RequestCheck:
    """The verdict on one request. ``reasons`` is empty for a clean request; else it names what is wrong:
    ``loop``, ``cycle``, ``punctuation``, ``empty`` (unexplained findings), ``divergence``, ``reference``,
    ``error``."""

    record: TurnRecord
    findings: list[str] = field(default_factory=list)
    explained: bool = False
    divergence: int | None = None
    near_tie: bool = False
    replay_token_ids: list[int] | None = None
    reference: dict[str, Any] | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def corrupt(self) -> bool:
        return bool(self.reasons)

    @property
    def aborted(self) -> bool:
        """Abandoned by its client mid-flight: partial output, not checked."""
        return self.record.abort is not None

    def to_json(self) -> dict[str, Any]:
        c = self.record.completion
        out: dict[str, Any] = {
            "request_id": self.record.request_id, "conversation": self.record.conv_id, "turn": self.record.turn,
            "prompt_len": len(self.record.prompt_ids), "output_len": len(c.token_ids or []),
            "finish_reason": c.finish_reason, "num_cached_tokens": c.num_cached_tokens, "error": c.error,
            "findings": self.findings, "findings_explained": self.explained, "divergence": self.divergence,
            "near_tie": self.near_tie, "reference": self.reference, "corrupt": self.corrupt,
            "reasons": self.reasons, "output_token_ids": c.token_ids, "text": c.text,
        }
        if self.record.planned_abort is not None:
            out["aborted"] = self.aborted
            out["planned_abort"] = asdict(self.record.planned_abort)
            out["abort"] = self.record.abort
        if self.divergence is not None:
            out["replay_token_ids"] = self.replay_token_ids
        return out


# ------------------------------------------------------------------------------------------------------ checks


ReferenceFn = Callable[[list[int], list[int]], dict[str, Any]]


def check_requests(
    records: Sequence[TurnRecord],
    replays: Sequence[Completion | None] | None,
    reference: ReferenceFn | None,
    *,
    tol: float,
    detector_kwargs: dict[str, Any] | None = None,
) -> list[RequestCheck]:
    """Check every request: detectors, divergence from its replay (``replays[i]`` for ``records[i]``; None for an
    aborted one) and the reference (``reference(prompt_ids, output_ids)`` -> ``{"ok": bool, ...}``). An aborted
    request is not checked. See the module docstring."""
    if replays is not None and len(replays) != len(records):
        raise ValueError(f"{len(replays)} replays for {len(records)} requests")
    checks: list[RequestCheck] = []
    for i, rec in enumerate(records):
        c = rec.completion
        chk = RequestCheck(rec)
        checks.append(chk)
        if chk.aborted:
            continue  # partial output, by the client's choice: nothing to check
        if c.error is not None or c.token_ids is None or c.finish_reason in ("error", "abort"):
            chk.reasons.append("error")
            continue
        chk.findings = detect_degenerate(c.token_ids, c.text, c.finish_reason, **(detector_kwargs or {}))
        replay_same = False
        if replays is not None:
            rp = replays[i]
            if rp is None or rp.error is not None or rp.token_ids is None:
                logger.warning("replay of %s failed (%s): no divergence check", rec.request_id,
                               "not replayed" if rp is None else rp.error)
            else:
                chk.replay_token_ids = rp.token_ids
                chk.divergence = first_divergence(c.token_ids, rp.token_ids)
                replay_same = chk.divergence is None
                if chk.divergence is not None:
                    chk.near_tie = _near_tie(c.token_ids, rp, chk.divergence, tol)
                    if not chk.near_tie:
                        chk.reasons.append("divergence")
        if reference is not None and c.token_ids:
            chk.reference = reference(rec.prompt_ids, c.token_ids)
            if not chk.reference["ok"]:
                chk.reasons.append("reference")
        reference_ok = chk.reference is not None and bool(chk.reference["ok"])
        chk.explained = bool(chk.findings) and (replay_same or reference_ok)
        if chk.findings and not chk.explained:
            for kind in dict.fromkeys(finding_kind(f) for f in chk.findings):
                chk.reasons.append(kind)
    return checks


def _near_tie(tokens: list[int], replay: Completion, pos: int, tol: float) -> bool:
    """Whether the soak's token at the first divergence ``pos`` was within ``tol`` logprob of the replay's token
    there, per the replay's own top logprobs."""
    if replay.token_ids is None or pos >= len(tokens) or pos >= len(replay.token_ids):
        return False  # one output is a strict prefix of the other: not a token choice
    if replay.top_logprobs is None or pos >= len(replay.top_logprobs):
        return False
    lps = replay.top_logprobs[pos]
    mine, theirs = tokens[pos], replay.token_ids[pos]
    if mine not in lps or theirs not in lps:
        return False
    return lps[theirs] - lps[mine] <= tol


def load_family_reference(model_dir: str) -> Any:
    """The checkpoint's family's transformers reference: Qwen4-Exp's (transformers 5.24 in its own process, its
    ``model_type`` ``qwen4_exp`` or ``qwen4_exp_text``), else Qwen3.5's (transformers 5.17 in this one), which would
    load a Qwen4-Exp checkpoint with its missing tensors freshly initialized and fail every request."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = str(json.load(f).get("model_type", ""))
    if model_type.startswith("qwen4_exp"):
        from hyserve.testing.qwen4_exp import load_qwen4_exp_reference

        return load_qwen4_exp_reference(model_dir)
    from hyserve.testing import load_reference_model

    return load_reference_model(model_dir)


def make_reference_check(model_dir: str, tol: float) -> ReferenceFn:
    """A teacher-forced check against transformers' float32 forward (``hyserve.testing``)."""
    import torch

    from hyserve.testing import reference_logits

    ref = load_family_reference(model_dir)

    def check(prompt_ids: list[int], output_ids: list[int]) -> dict[str, Any]:
        logits = reference_logits(ref, list(prompt_ids) + list(output_ids)[:-1])[len(prompt_ids) - 1:]
        out = torch.tensor(output_ids, dtype=torch.long)
        chosen = logits.gather(1, out[:, None])[:, 0]
        best = logits.max(dim=-1)
        gaps = best.values - chosen
        gaps = torch.where(torch.isnan(gaps), torch.full_like(gaps, float("inf")), gaps)
        bad = (gaps > tol).nonzero().flatten().tolist()
        result: dict[str, Any] = {"ok": not bad, "max_gap": float(gaps.max()), "tol": tol}
        if bad:
            i = int(bad[0])
            result.update(position=i, token=int(output_ids[i]), reference_token=int(best.indices[i]),
                          gap=float(gaps[i]))
        return result

    return check


def summarize(checks: Sequence[RequestCheck], metrics: dict[str, float] | None) -> dict[str, Any]:
    """The table's numbers (counts are of requests)."""
    def count(reason: str) -> int:
        return sum(reason in c.reasons for c in checks)

    metrics = metrics or {}
    hits, queries = metrics.get("hyserve:prefix_cache_hits"), metrics.get("hyserve:prefix_cache_queries")
    drafts = metrics.get("hyserve:spec_decode_num_drafts")
    accepted = metrics.get("hyserve:spec_decode_num_accepted_tokens")
    aborted = [c.record.abort for c in checks if c.record.abort is not None]
    return {
        "requests": len(checks),
        "aborts_planned": sum(c.record.planned_abort is not None for c in checks),
        "aborted": len(aborted),
        "aborted_by_phase": {p: sum(a["phase"] == p for a in aborted) for p in ABORT_PHASES},
        "aborted_with_own_step_in_flight": sum(bool(a.get("steps_naming_it")) for a in aborted),
        "engine_aborts": metrics.get("hyserve:request_aborted"),
        "checked": len(checks) - len(aborted),
        "loops": sum(("loop" in c.reasons) or ("cycle" in c.reasons) for c in checks),
        "empties": count("empty"),
        "punctuation_runs": count("punctuation"),
        "divergences": count("divergence"),
        "near_ties_excused": sum(c.near_tie for c in checks),
        "replayed": sum(c.replay_token_ids is not None for c in checks),
        "reference_failures": count("reference"),
        "reference_checked": sum(c.reference is not None for c in checks),
        "errors": count("error"),
        "explained_degenerate": sum(c.explained for c in checks),
        "corrupt_requests": sum(c.corrupt for c in checks),
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": (hits / queries) if hits is not None and queries else None,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_accepted_tokens": accepted,
        "mean_acceptance_length": (1.0 + accepted / drafts) if drafts and accepted is not None else None,
        "ok": not any(c.corrupt for c in checks),
    }


def format_table(s: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f} %"

    rows = [("requests", str(s["requests"]))]
    if s.get("aborts_planned"):
        by = s["aborted_by_phase"]
        rows.append(("aborted mid-flight (not checked)",
                     f"{s['aborted']} of {s['aborts_planned']} planned ({by['queued']} queued, {by['prefill']} "
                     f"mid-prefill, {by['decode']} mid-decode)"
                     + ("" if s.get("engine_aborts") is None else f"; engine aborts {s['engine_aborts']:.0f}")))
        if s.get("aborted_with_own_step_in_flight"):
            rows.append(("aborted with a step of theirs in flight", str(s["aborted_with_own_step_in_flight"])))
        rows.append(("checked", str(s["checked"])))
    rows += [
        ("loops (token / short cycle)", str(s["loops"])),
        ("empty outputs", str(s["empties"])),
        ("punctuation runs", str(s["punctuation_runs"])),
        ("divergences from the replay", f"{s['divergences']} of {s['replayed']} replayed"
                                        f" ({s['near_ties_excused']} near-ties excused)"),
        ("reference failures", f"{s['reference_failures']} of {s['reference_checked']} checked"),
        ("errors", str(s["errors"])),
        ("degenerate but explained (model's own)", str(s["explained_degenerate"])),
        ("prefix-cache hit rate", pct(s["prefix_cache_hit_rate"])),
        ("mean acceptance length", "n/a" if s["mean_acceptance_length"] is None
         else f"{s['mean_acceptance_length']:.2f}"),
        ("result", "OK: no corruption" if s["ok"] else f"CORRUPTION in {s['corrupt_requests']} requests"),
    ]
    w = max(len(k) for k, _ in rows)
    v = max(len(x) for _, x in rows)
    lines = [f"| {'check'.ljust(w)} | {'count'.ljust(v)} |", f"| {'-' * w} | {'-' * v} |"]
    lines += [f"| {k.ljust(w)} | {x.ljust(v)} |" for k, x in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ drivers
