"""The request fields that ask for structured output, in the three spellings clients send: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (json, regex, choice, grammar,
json_object) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. At most one
spelling per request; what hyserve cannot honour is a 400 naming the field, never ignored."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from hyserve.structured_output.params import KINDS, OPTIONS, StructuredOutputsParams


class StructuredOutputError(ValueError):
    """A refused structured-output field (the request models turn it into a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputFields(BaseModel):
    """Mixed into the completions and chat request models."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint, or None; StructuredOutputError for a malformed or unsupported one."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None:
            fields = _from_response_format(fmt)
            if fields is not None:
                asked.append(("response_format", fields))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            if not isinstance(so, dict):
                raise StructuredOutputError("structured_outputs must be an object", param="structured_outputs")
            unknown = sorted(set(so) - set(KINDS) - set(OPTIONS))
            if unknown:
                raise StructuredOutputError(
                    f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(KINDS)})",
                    param=f"structured_outputs.{unknown[0]}")
            asked.append(("structured_outputs", {k: v for k, v in so.items() if v is not None}))
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                asked.append((name, {kind: value}))
        if not asked:
            return None
        if len(asked) > 1:
            names = [a for a, _ in asked]
            raise StructuredOutputError(f"{names[0]} and {names[1]} both ask for structured output: send one",
                                        param=names[1])
        source, fields = asked[0]
        try:
            return StructuredOutputsParams(**fields)
        except (ValueError, TypeError) as e:
            raise StructuredOutputError(f"{source}: {e}", param=source) from None


def _from_response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict):
        raise StructuredOutputError("response_format must be an object", param="response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise StructuredOutputError("response_format json_schema needs json_schema.schema (a JSON schema object)",
                                        param="response_format.json_schema")
        return {"json": spec["schema"]}
    raise StructuredOutputError(
        f"response_format type {kind!r} is not supported (supported: text, json_object, json_schema)",
        param="response_format.type")
