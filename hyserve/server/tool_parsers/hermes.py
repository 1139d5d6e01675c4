"""``hermes``: a JSON object between tags, as Hermes, Qwen2.5 and Qwen3 models write calls::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is sent whole once its closing tag has come and its JSON names one of the request's tools (its arguments
cannot be typed or checked before), so a streamed call arrives in one delta. JSON that does not parse, a name that
is not a tool, or arguments that are not an object leave the call's text as content; so does a call the text ends
inside of.
"""

from __future__ import annotations

import json

from hyserve.server.tool_parsers.base import PENDING, CallResult, ParsedCall, ToolParser

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    openers = (TOOL_CALL,)

    def parse_call(self, text: str, start: int, opener: str, final: bool) -> CallResult:
        close = text.find(TOOL_CALL_END, start)
        if close < 0:
            return CallResult(None, len(text)) if final else PENDING
        end = close + len(TOOL_CALL_END)
        try:
            obj = json.loads(text[start + len(TOOL_CALL):close])
        except (ValueError, RecursionError):
            return CallResult(None, end)
        if not isinstance(obj, dict):
            return CallResult(None, end)
        name, args = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str) or name not in self.tools or not isinstance(args, dict):
            return CallResult(None, end)
        return CallResult(ParsedCall(name, json.dumps(args, ensure_ascii=False)), end)
