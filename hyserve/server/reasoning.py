"""Reasoning parsers by name (``--reasoning-parser``): split a model's text into its reasoning and its answer.

``qwen3`` (Qwen3, Qwen3-Next, Qwen3.5/3.6): reasoning is the text before ``</think>``. Qwen3.5's chat template puts
``<think>\\n`` in the prompt, so the output holds only ``</think>``; an older template lets the model write
``<think>`` itself, and a leading one is dropped. Without ``</think>`` in the output:

- thinking off (``chat_template_kwargs: {"enable_thinking": false}``, or a prompt whose template already closed the
  reasoning, ending in ``</think>``): all of it is content;
- a ``<tool_call>`` followed by ``<function=`` (or ``<function `` ) ends the reasoning (Qwen3.5 may call a tool
  without closing its thinking): content from the tag on;
- else the output was cut short while thinking: all of it is reasoning.

The earliest of ``</think>`` and such a tool call ends the reasoning. ``split(text, final=False)`` (a text that may
still grow) returns a prefix of every later split, holding back what may still turn out to be an end tag, so a
stream sends the differences and they add up to the whole text's split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hyserve.server.tool_parsers.base import held_back

THINK = "<think>"
THINK_END = "</think>"
TOOL_CALL = "<tool_call>"
FUNCTION_OPEN = "<function"
_FUNCTION_RE = re.compile(r"<function[\s=]")


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str


def prompt_ends_reasoning(prompt: str) -> bool:
    """The rendered prompt already closed the reasoning (a template with thinking off writes ``<think></think>``)."""
    return prompt.rstrip().endswith(THINK_END)


class Qwen3ReasoningParser:
    """One instance reads one answer: successive ``split`` calls see the same text, grown; what is settled (where
    the reasoning starts and ends, how far no end tag starts) is remembered, so a stream scans only what is new."""

    name = "qwen3"

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking
        self.begin: int | None = None  # where the reasoning starts (after a leading <think>), once known
        self.end: tuple[int, int] | None = None  # (where the reasoning ends, where the content starts), once known
        self.scanned = 0  # no end of the reasoning starts before this (nor an undecided <tool_call>)

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        if not self.thinking:
            return ReasoningSplit("", text)
        if self.begin is None:
            stripped = text.lstrip()
            if stripped.startswith(THINK):
                self.begin = len(text) - len(stripped) + len(THINK)
            elif not final and THINK.startswith(stripped):
                return ReasoningSplit("", "")  # may still become <think>
            else:
                self.begin = 0
        begin = self.begin
        undecided = None
        if self.end is None:
            undecided = self._scan(text, final)
        if self.end is not None:
            return ReasoningSplit(text[begin:self.end[0]], text[self.end[1]:])
        if final:
            return ReasoningSplit(text[begin:], "")
        hold = undecided if undecided is not None else len(text) - held_back(text, (THINK_END, TOOL_CALL))
        return ReasoningSplit(text[begin:max(hold, begin)], "")

    def _scan(self, text: str, final: bool) -> int | None:
        """Look for the end of the reasoning from ``scanned`` on (the earlier of ``</think>`` and a tool call);
        sets ``end`` when found; returns where an undecided ``<tool_call>`` starts, if one does."""
        assert self.begin is not None
        pos = max(self.scanned, self.begin)
        end = text.find(THINK_END, pos)
        limit = end if end >= 0 else len(text)
        while (at := text.find(TOOL_CALL, pos, limit)) >= 0:
            after = text[at + len(TOOL_CALL):at + len(TOOL_CALL) + 64].lstrip()
            if _FUNCTION_RE.match(after):
                self.end = (at, at)
                return None
            if not final and FUNCTION_OPEN.startswith(after):
                self.scanned = at
                return at
            pos = at + 1
        if end >= 0:
            self.end = (end, end + len(THINK_END))
            return None
        self.scanned = max(self.scanned, len(text) - max(len(THINK_END), len(TOOL_CALL)) + 1)
        return None


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {Qwen3ReasoningParser.name: Qwen3ReasoningParser}


def reasoning_parser_class(name: str) -> type[Qwen3ReasoningParser]:
    """The parser called ``name``; an unknown name is a ``ValueError`` listing the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
                         ) from None
