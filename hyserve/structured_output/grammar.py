"""A request's constraint as an llguidance grammar, and the tokenizer llguidance computes masks over.

llguidance (a maintained grammar engine from the package registry) is chosen over xgrammar for three reasons: its
masks are computed on demand in tens of microseconds a token with no per-schema compile step to amortize (agents send
a new tool or JSON schema with many requests), it takes Lark and GBNF grammars, JSON schemas and regexes natively and
computes the masks of a verify row's positions with the drafts consumed tentatively (speculative decoding), and its
wheel is one abi3 build for every CPython, so the same file installs on the CPU machines and the GPU machine.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import TYPE_CHECKING

from hyserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of ``params``; ValueError for a constraint it cannot take."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = params.kind
    json_options: JsonCompileOptions | None = {"whitespace_flexible": False} if params.disable_any_whitespace else None
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(params.schema_text(), overrides=json_options)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=json_options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex or "")
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice or []))
        text = params.grammar or ""
        return LLMatcher.grammar_from_lark(any_to_lark(text))
    except (ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"structured outputs ({kind}): {e}") from None


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it (built once, lazily: about a second for a 250k vocabulary), and
    the validation of a request's grammar against it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)

    @cached_property
    def ll_tokenizer(self):  # type: ignore[no-untyped-def]
        from llguidance import LLTokenizer

        return LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar of ``params`` (ValueError naming what is wrong with it)."""
        from llguidance import LLMatcher

        grammar = grammar_text(params)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise ValueError(f"structured outputs ({params.kind}): {'; '.join(messages) or 'invalid grammar'}")
        return grammar
