"""Tool-call parsers by name (``--tool-call-parser``): each finds the calls a model wrote in its text
(``base.ToolParser``), one module per format."""

from __future__ import annotations

from hyserve.server.tool_parsers.base import ParsedCall, ToolParse, ToolParser
from hyserve.server.tool_parsers.hermes import HermesToolParser
from hyserve.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser, Qwen3XMLToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Qwen3CoderToolParser, Qwen3XMLToolParser)}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser called ``name``; an unknown name is a ``ValueError`` listing the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParse", "ToolParser", "tool_parser_class"]
