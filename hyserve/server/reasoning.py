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
    name = "qwen3"

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        if not self.thinking:
            return ReasoningSplit("", text)
        stripped = text.lstrip()
        if stripped.startswith(THINK):
            text = stripped[len(THINK):]
        elif not final and THINK.startswith(stripped):
            return ReasoningSplit("", "")  # may still become <think>
        end = text.find(THINK_END)
        limit = end if end >= 0 else len(text)
        call, undecided = self._tool_call(text, limit, final)
        if call is not None:
            return ReasoningSplit(text[:call], text[call:])
        if end >= 0:
            return ReasoningSplit(text[:end], text[end + len(THINK_END):])
        if final:
            return ReasoningSplit(text, "")
        hold = undecided if undecided is not None else len(text) - _partial_tag(text, (THINK_END, TOOL_CALL))
        return ReasoningSplit(text[:hold], "")

    @staticmethod
    def _tool_call(text: str, limit: int, final: bool) -> tuple[int | None, int | None]:
        """(where a tool call that ends the reasoning starts, where an undecided ``<tool_call>`` starts), before
        ``limit``."""
        pos = 0
        while (at := text.find(TOOL_CALL, pos, limit)) >= 0:
            after = text[at + len(TOOL_CALL):].lstrip()
            if _FUNCTION_RE.match(after):
                return at, None
            if not final and (FUNCTION_OPEN.startswith(after) or after == FUNCTION_OPEN):
                return None, at
            pos = at + 1
        return None, None


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may begin one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {Qwen3ReasoningParser.name: Qwen3ReasoningParser}


def reasoning_parser_class(name: str) -> type[Qwen3ReasoningParser]:
    """The parser called ``name``; an unknown name is a ``ValueError`` listing the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
                         ) from None
