"""The engine's structured-output front: each request's constraint checked and compiled once (a cache keyed by the
constraint: agents send the same schema with many requests) and a fresh matcher per request."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING

from hyserve.structured_output.grammar import GrammarCompiler
from hyserve.structured_output.matcher import GrammarMatcher
from hyserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from hyserve.tokenizer import Tokenizer

CACHE_SIZE = 256


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._compiler = None if tokenizer is None else \
            GrammarCompiler(tokenizer.to_json(), vocab_size, eos_token_ids)
        self._grammars: OrderedDict[str, str] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar of ``params`` (ValueError naming what is wrong)."""
        if self._compiler is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer (this one has no tokenizer.json)")
        value = params.schema_text() if params.kind == "json" else getattr(params, params.kind)
        key = json.dumps([params.kind, value, params.disable_any_whitespace], sort_keys=True)
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._compiler.compile(params)
            self._grammars[key] = grammar
            if len(self._grammars) > CACHE_SIZE:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        grammar = self.compile(params)
        assert self._compiler is not None
        return GrammarMatcher(self._compiler, grammar)
