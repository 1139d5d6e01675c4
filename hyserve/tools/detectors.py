"""Detectors for the silent output corruption seen when prefix caching meets speculative decoding on hybrid models.

The reported symptoms (``shared/seeds``): a response degenerates into one token repeated to the end ("duct duct
duct", token 1023 forever: an all-NaN logits row sampled as a fixed id), into a run of ``!!!!``, or comes back empty,
while ``finish_reason`` is a normal ``stop``/``length`` and nothing is logged. These detectors are pure heuristics on
one response (no torch, no tokenizer): each finding is a string that starts with its kind (``loop:``, ``cycle:``,
``punctuation:``, ``empty:``; see :func:`finding_kind`). A greedy model can loop on its own, so a finding is a
suspicion; ``hyserve soak`` confirms it against a clean replay and the transformers reference.

Thresholds are chosen so that ordinary English, Python and random token sequences do not fire: a loop must cover
at least ``min_run`` tokens *and* ``min_fraction`` of the output and reach its end; a cycle (period 2..8) must also
repeat at least ``min_cycle_repeats`` times; a punctuation run counts only sentence punctuation (``! ? , ; :`` and
their full-width forms), not the ``-``, ``=``, ``#``, ``*``, ``.`` or ``_`` that rules, separators and ellipses
repeat in normal text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "FINDING_KINDS",
    "detect_degenerate",
    "finding_kind",
    "first_divergence",
    "punctuation_runs",
    "trailing_cycle",
    "trailing_run",
]

FINDING_KINDS = ("loop", "cycle", "punctuation", "empty")
NORMAL_FINISH_REASONS = ("stop", "length")
# Sentence punctuation that normal text never repeats 8 times in a row (ASCII, inverted, full-width and CJK forms).
SENTENCE_PUNCTUATION = "!?,;:¡¿！？，；：。、"


def finding_kind(finding: str) -> str:
    """The kind of a finding string (``"loop"``, ``"cycle"``, ``"punctuation"`` or ``"empty"``)."""
    kind = finding.split(":", 1)[0]
    if kind not in FINDING_KINDS:
        raise ValueError(f"not a finding of detect_degenerate: {finding!r}")
    return kind


def trailing_run(items: Sequence[Any]) -> tuple[Any, int]:
    """The last item and how many times it repeats at the end (``(None, 0)`` for an empty sequence)."""
    if not items:
        return None, 0
    last = items[-1]
    n = 1
    while n < len(items) and items[-1 - n] == last:
        n += 1
    return last, n


def trailing_cycle(items: Sequence[Any], max_period: int = 8) -> tuple[int, int]:
    """The smallest period ``p`` in ``2..max_period`` of the longest periodic tail, and that tail's length.

    The tail ``items[-L:]`` has period ``p`` when ``items[i] == items[i - p]`` inside it; ``L >= p`` always holds
    for the returned pair. A period whose unit is one repeated item is skipped (that is a run: :func:`trailing_run`).
    Returns ``(0, 0)`` when no period of at least two full repeats exists.
    """
    best_p, best_len = 0, 0
    n = len(items)
    for p in range(2, max_period + 1):
        if n < 2 * p:
            break
        unit = items[n - p:]
        if all(x == unit[0] for x in unit):
            continue
        k = n - 1
        while k - p >= 0 and items[k] == items[k - p]:
            k -= 1
        length = n - 1 - k + p  # the matched positions plus the first unit they repeat
        if length >= 2 * p and length > best_len:
            best_p, best_len = p, length
    return best_p, best_len


_PUNCT_CLASS = "[" + re.escape(SENTENCE_PUNCTUATION) + "]"


def punctuation_runs(text: str, min_len: int = 8) -> list[tuple[int, str]]:
    """``(offset, run)`` for every run of ``min_len`` or more sentence-punctuation characters (spaces between them
    allowed, as in ``"! ! ! !"``) in ``text``."""
    pattern = re.compile(f"{_PUNCT_CLASS}(?:[ \\t]*{_PUNCT_CLASS}){{{min_len - 1},}}")
    return [(m.start(), m.group(0)) for m in pattern.finditer(text)]


def detect_degenerate(
    token_ids: Sequence[int] | None,
    text: str | None,
    finish_reason: str | None,
    *,
    min_run: int = 8,
    min_fraction: float = 0.5,
    max_period: int = 8,
    min_cycle_repeats: int = 4,
    min_punctuation_run: int = 8,
) -> list[str]:
    """Findings of degenerate output in one response; ``[]`` when it looks normal.

    - ``loop``: one token repeated to the end, over at least ``min_run`` tokens and ``min_fraction`` of the output;
    - ``cycle``: a unit of 2..``max_period`` tokens repeated to the end, at least ``min_cycle_repeats`` times, over
      at least ``min_run`` tokens and ``min_fraction`` of the output (the smallest such period is reported);
    - ``punctuation``: a run of ``min_punctuation_run`` or more sentence-punctuation characters in ``text``;
    - ``empty``: a normal finish (``stop``/``length``) with zero tokens, or with text that is empty or only white
      space (the "content: null" of the reports).

    ``token_ids`` may be ``None`` (a server that returns only text): the loop and cycle checks then run on the
    text's white-space separated words. ``text`` may be ``None`` (no tokenizer): the text checks are skipped.
    """
    findings: list[str] = []
    items: Sequence[Any] | None = token_ids
    unit_name = "token"
    if items is None and text is not None:
        items, unit_name = text.split(), "word"
    if items:
        n = len(items)
        item, run = trailing_run(items)
        if run >= min_run and run >= min_fraction * n:
            findings.append(f"loop: {unit_name} {item!r} repeated {run} times to the end "
                            f"({100 * run / n:.0f} % of {n} {unit_name}s)")
        else:
            period, length = trailing_cycle(items, max_period)
            if (period and length >= min_run and length >= min_cycle_repeats * period
                    and length >= min_fraction * n):
                unit = list(items[n - period:])
                findings.append(f"cycle: {unit_name}s {unit!r} (period {period}) repeated {length / period:.1f} "
                                f"times to the end ({100 * length / n:.0f} % of {n} {unit_name}s)")
    if text is not None:
        for offset, run_text in punctuation_runs(text, min_punctuation_run)[:3]:
            shown = run_text if len(run_text) <= 24 else run_text[:24] + "..."
            findings.append(f"punctuation: {shown!r} ({len(run_text)} chars) at offset {offset}")
    if finish_reason in NORMAL_FINISH_REASONS:
        if token_ids is not None and len(token_ids) == 0:
            findings.append(f"empty: no tokens with finish_reason {finish_reason!r}")
        elif text is not None and not text.strip():
            n_tok = "?" if token_ids is None else str(len(token_ids))
            findings.append(f"empty: no text ({n_tok} tokens, text {text!r}) with finish_reason {finish_reason!r}")
    return findings


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter length if one is a strict prefix of the
    other), or ``None`` when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None
