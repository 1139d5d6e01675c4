"""A chat request's tools and ``tool_choice``, read against what the server was started with.

- ``tool_choice`` without ``tools`` is a 400 (OpenAI's answer); ``tools`` alone mean ``"auto"``.
- ``"none"``: the tools are rendered into the prompt (as transformers' ``apply_chat_template(messages,
  tools=...)``), the answer is text: no call is parsed out of it.
- ``"auto"``: the tools are rendered and the calls the model writes are parsed out of its answer with the server's
  tool-call parser; without ``--enable-auto-tool-choice`` and ``--tool-call-parser`` it is a 400 naming them, as
  vLLM answers.
- ``"required"`` and a named function promise a call: the answer is constrained by the grammar engine to calls
  (``hyserve.server.tool_choice``: the schemas, the parsers of the constrained answer); they need no tool-call
  parser. Another constraint on the same answer (``response_format``, ``structured_outputs``, ``guided_*``) is a 400
  naming both; so is a reasoning parser with thinking on (the grammar would hold from the first token, leaving the
  model no room to think: send ``chat_template_kwargs: {"enable_thinking": false}``).

``chat_template_kwargs`` reach the template; the keys the server reads itself must have their type
(``enable_thinking``: a boolean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyserve.server.protocol import APIError, ChatCompletionRequest, short_repr
from hyserve.server.reasoning import reasoning_parser_class
from hyserve.server.structured import GUIDED
from hyserve.server.tool_choice import (
    NamedCallParser,
    RequiredCallsParser,
    constraint,
    named_schema,
    required_schema,
)
from hyserve.server.tool_parsers import TOOL_PARSERS, ToolParser, tool_parser_class
from hyserve.structured_output.params import StructuredOutputsParams

TOOL_CHOICES = ("none", "auto", "required")
# chat_template_kwargs the server reads itself, with the type they must have.
TEMPLATE_KWARG_TYPES: dict[str, type] = {"enable_thinking": bool}


@dataclass
class ToolSettings:
    """The server's tool-call flags (``--enable-auto-tool-choice``, ``--tool-call-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            tool_parser_class(self.tool_call_parser)  # an unknown name fails at startup, listing the known ones
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                             f"{', '.join(sorted(TOOL_PARSERS))})")


@dataclass
class ToolPlan:
    """What a request's tools make of its answer: the tools for the template, the parser of calls (None: the
    answer is text), and the constraint on the answer (``"required"``, a named function)."""

    template_tools: list[dict[str, Any]] | None
    parser: ToolParser | None
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None


def check_tools(tools: list[dict[str, Any]]) -> None:
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}",
                           param=f"tools[{i}]")


def plan_tools(body: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    """The request's ``ToolPlan``; refuses what the server cannot answer (see the module docstring)."""
    choice = body.tool_choice
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function (got "
                       f"{short_repr(choice)})", param="tool_choice")
    if not body.tools:
        if choice is not None:
            raise APIError("tool_choice is only allowed when tools are given (there are no tools in this request)",
                           param="tool_choice")
        return ToolPlan(None, None)
    tools = list(body.tools)
    check_tools(tools)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                           f"{{'name': str}}}} (got {short_repr(choice)})", param="tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(f"tool_choice names the function {short_repr(name)}, which is not in tools",
                           param="tool_choice")
    parallel = body.parallel_tool_calls is not False
    if choice == "required" or isinstance(choice, dict):
        return forced_plan(body, tools, parallel)
    if choice == "none":
        return ToolPlan(tools, None)
    if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
        got = "absent, which means 'auto' with tools" if choice is None else "'auto'"
        raise APIError("tool_choice 'auto' needs a tool-call parser: start the server with "
                       "--enable-auto-tool-choice --tool-call-parser NAME, or send tool_choice: 'none' to have the "
                       f"tools rendered into the prompt and get a text answer (tool_choice is {got})",
                       param="tool_choice")
    parser = tool_parser_class(settings.tool_call_parser)(tools)
    return ToolPlan(tools, parser, parallel=parallel)


def other_constraints(body: ChatCompletionRequest) -> list[str]:
    """The request's fields that ask for structured output (``response_format`` of type ``text`` asks nothing)."""
    names = [name for name in ("structured_outputs", *GUIDED) if getattr(body, name) is not None]
    fmt = body.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        names.insert(0, "response_format")
    return names


def forced_plan(body: ChatCompletionRequest, tools: list[dict[str, Any]], parallel: bool) -> ToolPlan:
    """The plan of ``tool_choice: "required"`` or a named function: the answer constrained to calls."""
    choice = body.tool_choice
    shown = "'required'" if choice == "required" else "a named function"
    others = other_constraints(body)
    if others:
        raise APIError(f"tool_choice {shown} constrains the answer to tool calls, and {others[0]} constrains it "
                       f"too: send one of tool_choice and {others[0]}", param=others[0])
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return ToolPlan(tools, NamedCallParser(tools, name), parallel, constraint(named_schema(tools, name)))
    try:
        schema = required_schema(tools, parallel)
    except ValueError as e:
        raise APIError(f"tool_choice 'required': {e}", param="tools") from e
    return ToolPlan(tools, RequiredCallsParser(tools), parallel, constraint(schema))


def check_forced_reasoning(plan: ToolPlan, thinking: bool) -> None:
    """A constrained answer (``"required"``, a named function) cannot start with reasoning: the grammar holds from
    the first token. A 400 when the answer would think (a reasoning parser, thinking on)."""
    if plan.constraint is not None and thinking:
        raise APIError("tool_choice 'required' or a named function constrains the answer to tool calls from its "
                       "first token, which leaves no room for the reasoning this server's --reasoning-parser expects: "
                       "send chat_template_kwargs: {'enable_thinking': false} (or tool_choice 'auto')",
                       param="tool_choice")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """The ``chat_template_kwargs`` the server reads itself must have their type."""
    for key, kind in TEMPLATE_KWARG_TYPES.items():
        if kwargs and key in kwargs and not isinstance(kwargs[key], kind):
            raise APIError(f"chat_template_kwargs.{key} must be a {kind.__name__} (got {short_repr(kwargs[key])})",
                           param=f"chat_template_kwargs.{key}")


def check_parser_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None,
                       reasoning_parser: str | None) -> ToolSettings:
    """The serve flags' tool settings, the reasoning parser's name checked too (before a model is loaded)."""
    if reasoning_parser is not None:
        reasoning_parser_class(reasoning_parser)
    return ToolSettings(enable_auto_tool_choice, tool_call_parser)
