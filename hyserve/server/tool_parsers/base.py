"""What every tool-call parser shares: the parse of a model's text into content and calls, and the scan that finds
the calls in it.

A parser reads the whole text so far and returns a ``ToolParse``; streaming reparses the growing text after every
chunk and sends the difference. For that difference to be all a client needs, a parse of a text that may still grow
(``final=False``) is a prefix of every later parse: its content is a prefix of the later content, its calls are the
first of the later calls, each call's name is final and its arguments a prefix of the later arguments. So the
streamed deltas add up to the parse of the whole text, whatever the chunking, and nothing sent is ever taken back.
A parser keeps this by holding back what it cannot decide yet: text that may be the start of a call's opening tag,
a call whose header (the function's name) is not complete, a parameter whose closing tag has not come.

A call is committed once its header names one of the request's tools; from then on it is a call, also if the text
ends before its closing tag (the output was cut short: the call is closed with what it holds). A call that cannot
be one (an unknown function, JSON that does not parse, a header that never completes) is content, as written.
Text that is only whitespace next to a call is dropped (the newlines around and between calls).

A parser resumes where the text is settled (``ScanState``: after the last closed call, past the text no tag can
start in), so a stream's parse after each chunk scans only what is new and the call still open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedCall:
    """One call: the function's name and its arguments as JSON text (a prefix of it while the call is open)."""

    name: str
    arguments: str
    complete: bool = True


@dataclass
class ToolParse:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class CallResult:
    """What a parser makes of a call starting at an opening tag.

    ``call`` None: not a call (``end`` says how far its text goes, taken as content); ``end`` None: not decidable
    until more text comes (only when not final)."""

    call: ParsedCall | None
    end: int | None


PENDING = CallResult(None, None)


def tool_names(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The request's tools by function name: the ``parameters`` schema of each (``{}`` when it has none)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def arguments_json(pairs: list[tuple[str, Any]], closed: bool) -> str:
    """``{"a": 1, "b": 2}`` written pair by pair (``json.dumps``' separators), so that an open call's arguments are
    a prefix of its closed ones; ``closed`` adds the ``}``."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``tags`` (held back while streaming)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def blank(text: str) -> bool:
    """Empty or whitespace only (without copying the text, as ``strip`` would)."""
    return not text or text.isspace()


@dataclass
class ScanState:
    """Where a parse of a growing text may resume: everything before ``pos`` is settled (its content pieces and
    calls), and no opening tag starts in ``[pos, search_from)``."""

    pos: int = 0
    search_from: int = 0
    segments: list[str] = field(default_factory=list)
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """Finds the calls in a model's text. Subclasses name their opening tags and parse one call from its tag.

    One instance reads one answer: successive ``parse`` calls see the same text, grown. A parse of a text that may
    still grow remembers how far the text is settled, so that a stream's next parse scans only what is new (plus
    the call still open).
    """

    name = ""
    openers: tuple[str, ...] = ()
    finish_on_calls = True  # an answer with calls ends with finish_reason "tool_calls" (a named function's: "stop")

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools = tool_names(tools)
        self.resume = ScanState()

    def parse_call(self, text: str, start: int, opener: str, final: bool) -> CallResult:
        raise NotImplementedError

    def parse(self, text: str, final: bool = True) -> ToolParse:
        """Content and calls of ``text``; ``final=False``: the text may still grow (see the module docstring)."""
        state = self.resume
        segments, calls, pos = list(state.segments), list(state.calls), state.pos  # content pieces, in order
        search_from = state.search_from
        longest = max(len(tag) for tag in self.openers)
        while True:
            found = [(i, tag) for tag in self.openers if (i := text.find(tag, search_from)) >= 0]
            if not found:
                if not final:  # no tag starts before the last (longest - 1) characters
                    self.resume = ScanState(pos, max(pos, len(text) - longest + 1), list(segments), list(calls))
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - held_back(tail, self.openers)]
                # Whitespace only: dropped after a call; held while the text may grow (a call may follow).
                if not blank(tail) or not (calls or not final):
                    segments.append(tail)
                break
            start, opener = min(found)
            piece = text[pos:start]
            result = self.parse_call(text, start, opener, final)
            if result.end is None and not final:  # undecided: the next parse starts over from its tag
                self.resume = ScanState(pos, start, list(segments), list(calls))
            # Whitespace only: dropped next to a call; held while the call is undecided.
            if not blank(piece) or (result.call is None and result.end is not None and not calls):
                segments.append(piece)
            if result.call is not None:
                calls.append(result.call)
            elif result.end is not None:
                segments.append(text[start:result.end])
            if result.end is None:  # undecided: hold it and everything after it
                break
            pos = search_from = result.end
            if not final:
                self.resume = ScanState(pos, pos, list(segments), list(calls))
        return ToolParse("".join(segments), calls)
