"""``qwen3_coder`` and ``qwen3_xml``: the XML-like calls of Qwen3-Coder, Qwen3-Next and Qwen3.5/3.6::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags less one leading and one trailing newline, converted to the JSON
type the tool's schema declares for it (``convert_value``). A value ends at ``</parameter>``, or where the next
``<parameter=``, ``</function>`` or ``</tool_call>`` begins; the function at ``</function>`` or ``</tool_call>``.
A bare ``<function=...>`` without ``<tool_call>`` (which Qwen3-Coder models sometimes write) is a call too, ended by
``</function>``. Both names read the same format, so one parser serves both.

While streaming, a call's arguments grow parameter by parameter: a parameter is sent once its value has ended
(its type is known only then).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from hyserve.server.tool_parsers.base import PENDING, CallResult, ParsedCall, ToolParser, arguments_json

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
BOOL_TYPES = ("boolean", "bool", "binary")


def schema_type(schema: Any) -> str:
    """The declared JSON type of a parameter's schema, lower case ("string" when none is declared; the first
    non-null one of a list)."""
    if not isinstance(schema, dict) or "type" not in schema:
        return "string"
    declared = schema["type"]
    if isinstance(declared, list):
        declared = next((t for t in declared if t != "null"), "string")
    return str(declared).strip().lower()


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for; text that is not one stays a string.

    ``null`` (any case) is None for every type; strings stay as written; integers and numbers parse (a number with
    no fraction becomes an integer); booleans are ``true`` or not; objects and arrays parse as JSON, else as a
    Python literal (single quotes); any other type tries a Python literal. What cannot be written as JSON (NaN, a
    set) stays the text.
    """
    if raw.lower() == "null":
        return None
    kind = schema_type(schema)
    if kind in STRING_TYPES:
        return raw
    try:
        if kind.startswith(INT_PREFIXES):
            return int(raw)
        if kind.startswith(("num", "float")):
            number = float(raw)
            if not math.isfinite(number):
                return raw
            return int(number) if number == int(number) else number
    except (ValueError, OverflowError):
        return raw
    if kind in BOOL_TYPES:
        return raw.strip().lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            pass
    try:
        value = ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw
    return value if _is_json(value) else raw


def _first(text: str, tags: tuple[str, ...], pos: int) -> tuple[int, str] | None:
    found = [(i, tag) for tag in tags if (i := text.find(tag, pos)) >= 0]
    return min(found) if found else None


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    openers = (TOOL_CALL, FUNCTION)

    def parse_call(self, text: str, start: int, opener: str, final: bool) -> CallResult:
        wrapped = opener == TOOL_CALL
        closer = TOOL_CALL_END if wrapped else FUNCTION_END
        pos = start + len(opener)
        if wrapped:  # whitespace, then <function=
            rest = text[pos:].lstrip()
            if not rest.startswith(FUNCTION):
                if not final and FUNCTION.startswith(rest):
                    return PENDING
                return self._reject(text, start, closer, final)
            pos = len(text) - len(rest) + len(FUNCTION)
        gt = text.find(">", pos)
        if gt < 0:
            return PENDING if not final else CallResult(None, len(text))
        name = text[pos:gt].strip()
        if name not in self.tools:
            return self._reject(text, start, closer, final)
        properties = self.tools[name].get("properties")
        properties = properties if isinstance(properties, dict) else {}
        pairs, pos, closed = self._parameters(text, gt + 1, wrapped, properties, final)
        call = ParsedCall(name, arguments_json(pairs, closed or final), closed or final)
        if not closed:
            return CallResult(call, len(text) if final else None)
        if wrapped:  # after </function>: up to </tool_call>
            end = text.find(TOOL_CALL_END, pos)
            if end < 0:
                return CallResult(call, len(text) if final else None)
            return CallResult(call, end + len(TOOL_CALL_END))
        return CallResult(call, pos)

    @staticmethod
    def _reject(text: str, start: int, closer: str, final: bool) -> CallResult:
        """Not a call: its text, up to its closing tag, is content."""
        end = text.find(closer, start)
        if end < 0:
            return CallResult(None, len(text)) if final else PENDING
        return CallResult(None, end + len(closer))

    @staticmethod
    def _parameters(text: str, pos: int, wrapped: bool, properties: dict[str, Any], final: bool
                    ) -> tuple[list[tuple[str, Any]], int, bool]:
        """The parameters whose values have ended, from ``pos``; where the function ends (after ``</function>``,
        or at ``</tool_call>``) and whether it has. ``final``: a value cut off by the end of the text counts."""
        ends = (FUNCTION_END, TOOL_CALL_END) if wrapped else (FUNCTION_END,)
        value_ends = (PARAMETER_END, PARAMETER, *ends)
        pairs: list[tuple[str, Any]] = []
        while True:
            nxt = _first(text, (PARAMETER, *ends), pos)
            if nxt is None:
                return pairs, len(text), False
            at, tag = nxt
            if tag == FUNCTION_END:
                return pairs, at + len(FUNCTION_END), True
            if tag == TOOL_CALL_END:
                return pairs, at, True
            gt = text.find(">", at + len(PARAMETER))
            if gt < 0:
                return pairs, len(text), False
            key = text[at + len(PARAMETER):gt].strip()
            stop = _first(text, value_ends, gt + 1)
            if stop is None and not final:
                return pairs, len(text), False
            value_end = stop[0] if stop is not None else len(text)
            raw = text[gt + 1:value_end]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            pairs.append((key, convert_value(raw, properties.get(key)) if key in properties else raw))
            if stop is None:
                return pairs, len(text), False
            pos = value_end + (len(PARAMETER_END) if stop[1] == PARAMETER_END else 0)


class Qwen3XMLToolParser(Qwen3CoderToolParser):
    name = "qwen3_xml"
