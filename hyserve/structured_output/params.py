"""``StructuredOutputsParams``: what a request's output must match (vLLM's name and fields).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (a list of strings),
``grammar`` (Lark, or GBNF/EBNF with ``::=`` rules) and ``json_object`` (any JSON object) is set;
``disable_any_whitespace`` makes JSON carry no whitespace between its tokens (by default any JSON whitespace is
allowed). Invalid values raise ``ValueError`` naming the field (an API layer turns them into a 400); the grammar
itself is checked when the engine compiles it against its tokenizer (``hyserve.structured_output.grammar``).
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace",)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)} (got {set_ or 'none'})")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(f"structured_outputs.json must be a JSON schema object (got {type(schema).__name__})")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.disable_any_whitespace not in (True, False):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema_text(self) -> str:
        """The JSON schema as text (``json`` kind)."""
        return self.json if isinstance(self.json, str) else jsonlib.dumps(self.json)
