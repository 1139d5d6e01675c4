"""``tool_choice: "required"`` and a named function: the answer is constrained by the grammar engine
(``hyserve.structured_output``) to calls, and read back as calls.

- A named function (``{"type": "function", "function": {"name": NAME}}``): the answer is a JSON object that matches
  that function's ``parameters`` schema; it is the arguments of one call to NAME. ``finish_reason`` stays ``stop``
  (OpenAI's answer for a named function).
- ``"required"``: the answer is a JSON array of at least one ``{"name": NAME, "parameters": ARGS}``, each item one of
  the tools (``anyOf``, one branch per tool: NAME one of that tool's name, ARGS its ``parameters`` schema; a tool's
  ``$defs`` are moved to the top of the schema, where its ``#/$defs/...`` references resolve). With
  ``parallel_tool_calls: false`` the array holds one item (``maxItems: 1``). ``finish_reason`` is ``tool_calls``.

The JSON is written without whitespace between its tokens (``disable_any_whitespace``): a model cannot spend its
tokens on blank runs, and the arguments come out compact. The tools are rendered into the prompt as for ``"auto"``;
neither choice needs ``--enable-auto-tool-choice`` or ``--tool-call-parser``, the output's format being fixed here.

Streaming: a named call's first delta carries its id, type, name and the arguments so far, later deltas the text as
it is generated. A ``"required"`` call is sent once its ``{"name": NAME, "parameters": `` prefix has come (the name
is final then), and its arguments grow as the parameters' text does; an item written in another order (the grammar
keeps the schema's order, so only for a model that is not constrained) is sent whole once it closes. Both parsers
keep ``hyserve.server.tool_parsers.base``'s rule: the parse of a text that may still grow is a prefix of every later
parse (trailing whitespace is held back), so what streams adds up to the whole answer's parse.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from hyserve.server.tool_parsers.base import ParsedCall, ToolParse, ToolParser
from hyserve.structured_output.params import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# The start of one item of a "required" answer, up to its parameters' value.
ITEM_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


def tool_parameters(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's ``parameters`` schema by function name (an object with no properties when it has none)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        params = tool["function"].get("parameters")
        out[tool["function"]["name"]] = params if isinstance(params, dict) and params else EMPTY_PARAMETERS
    return out


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The schema a named function's answer must match: its ``parameters``."""
    return tool_parameters(tools)[name]


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The schema of a ``"required"`` answer: an array of at least one call (at most one without ``parallel``).

    ValueError when two tools define one ``$defs`` name differently."""
    branches: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for name, params in tool_parameters(tools).items():
        params = copy.deepcopy(params)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"two tools define $defs.{key} differently; one schema cannot hold both")
            defs[key] = value
        branches.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                          "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at ``text[start]`` ends (past its closing bracket), or None while it
    is open. Strings are skipped (their brackets and escaped quotes do not count)."""
    depth = 0
    i, n = start, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            if i >= n:
                return None
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def skip_blank(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class NamedCallParser(ToolParser):
    """A named function's answer: the whole text is the arguments of one call."""

    name = "named"
    finish_on_calls = False

    def __init__(self, tools: list[dict[str, Any]] | None, function: str) -> None:
        super().__init__(tools)
        self.function = function

    def parse(self, text: str, final: bool = True) -> ToolParse:
        arguments = text.strip() if final else text.lstrip().rstrip()
        return ToolParse("", [ParsedCall(self.function, arguments, complete=final)])


class RequiredCallsParser(ToolParser):
    """A ``"required"`` answer: a JSON array of ``{"name": ..., "parameters": {...}}``, read as it grows.

    A text that is not such an array (only an unconstrained model writes one) is content, with the calls that
    parsed before it went wrong."""

    name = "required"

    def parse(self, text: str, final: bool = True) -> ToolParse:
        calls: list[ParsedCall] = []
        i = skip_blank(text, 0)
        if i < len(text) and text[i] != "[":
            return ToolParse(text if final else "")
        i += 1
        while True:
            i = skip_blank(text, i)
            if i < len(text) and text[i] == ",":
                i = skip_blank(text, i + 1)
            if i >= len(text) or text[i] == "]":
                break
            end = value_end(text, i) if text[i] == "{" else None
            call = self.item(text, i, end)
            if end is None:  # the last item, still open: sent if its name is known
                if call is not None:
                    calls.append(call)
                elif final and not calls:
                    return ToolParse(text)
                break
            if call is None:  # a closed item that is not a call: the answer is not a call array
                if final and not calls:
                    return ToolParse(text)
                break
            calls.append(call)
            i = end
        return ToolParse("", calls)

    def item(self, text: str, start: int, end: int | None) -> ParsedCall | None:
        """The call of the item at ``start`` (``end`` None: still open), or None (not a call, or not yet known)."""
        head = ITEM_HEAD.match(text, start, end if end is not None else len(text))
        if head is not None:
            name = json.loads(head.group(1))
            if name not in self.tools:
                return None
            args_start = head.end()
            args_end = value_end(text, args_start) if text[args_start:args_start + 1] in ("{", "[") else None
            if args_end is not None and end is not None:
                return ParsedCall(name, text[args_start:args_end])
            if end is None and text[args_start:args_start + 1] in ("{", "["):
                partial = text[args_start:args_end] if args_end is not None else text[args_start:]
                return ParsedCall(name, partial.rstrip(), complete=False)
        if end is None:
            return None
        try:
            value = json.loads(text[start:end])
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.tools or "parameters" not in value:
            return None
        return ParsedCall(value["name"], json.dumps(value["parameters"], ensure_ascii=False, separators=(",", ":")))
