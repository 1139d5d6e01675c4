"""A chat answer's text split into reasoning, content and tool calls (``--reasoning-parser``,
``--tool-call-parser``), whole or as a stream of deltas.

The reasoning parser splits first; calls are parsed out of the content part only. A stream reparses the text so
far after each chunk (``final`` once the request finished) and sends what grew: both parsers return, for a text
that may still grow, a prefix of every later parse (``hyserve.server.tool_parsers.base``, ``hyserve.server.
reasoning``), so the deltas add up to the whole text's parse whatever the chunking. With ``parallel_tool_calls:
false`` only the first call is returned (vLLM drops the others).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from hyserve.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from hyserve.server.reasoning import Qwen3ReasoningParser
from hyserve.server.tool_parsers import ParsedCall, ToolParser


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatParse:
    reasoning: str
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ChatOutputParser:
    """Splits one request's answer (``reasoning``/``tools`` None: that part is not parsed)."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None, *, parallel: bool = True,
                 include_reasoning: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = None if parallel else 1
        self.include_reasoning = include_reasoning

    def parse(self, text: str, final: bool = True) -> ChatParse:
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            reasoning, content = split.reasoning, split.content
        calls: list[ParsedCall] = []
        if self.tools is not None:
            parsed = self.tools.parse(content, final)
            content, calls = parsed.content, parsed.calls[:self.max_calls]
        return ChatParse(reasoning if self.include_reasoning else "", content, calls)

    @staticmethod
    def tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
        return [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls]


class ChatDeltaStream:
    """What a stream has sent of a request's parse; ``feed`` the text so far, get the delta to send (or None)."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ChatParse("", "")
        self.ids: list[str] = []

    def feed(self, new_text: str, final: bool) -> DeltaMessage | None:
        self.text += new_text
        now = self.parser.parse(self.text, final)
        reasoning = now.reasoning[len(self.sent.reasoning):]
        content = now.content[len(self.sent.content):]
        pieces: list[DeltaToolCall] = []
        for i, call in enumerate(now.calls):
            if i >= len(self.sent.calls):
                self.ids.append(tool_call_id())
                self.sent.calls.append(ParsedCall(call.name, ""))
                pieces.append(DeltaToolCall(index=i, id=self.ids[i], type="function", function=DeltaFunctionCall(
                    name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > len(self.sent.calls[i].arguments):
                pieces.append(DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=call.arguments[len(self.sent.calls[i].arguments):])))
            self.sent.calls[i].arguments = call.arguments
        self.sent.reasoning, self.sent.content = now.reasoning, now.content
        if not (reasoning or content or pieces):
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None, tool_calls=pieces or None)

    @property
    def called(self) -> bool:
        return bool(self.sent.calls)
