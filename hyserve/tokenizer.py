"""Tokenizer, chat template, stop ids and incremental (streaming) detokenization.

The tokenizer is loaded as transformers' generic ``TokenizersBackend`` (``PreTrainedTokenizerFast``) straight from
``tokenizer.json``, never through ``AutoTokenizer``: in transformers 5 a model-specific class such as
``Qwen2Tokenizer`` rebuilds the normalizer/pre-tokenizer/decoder in Python and only takes the vocabulary and merges
from the file, so the file's own pipeline (the ground truth shipped with the checkpoint) would be ignored.
Special tokens and the chat template still come from ``tokenizer_config.json`` / ``chat_template.jinja``.
Encoding and decoding go to the Rust ``tokenizers.Tokenizer`` directly: no Python-side clean-up of spaces, which
would make decoding a window of tokens disagree with decoding the whole sequence.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyserve.config import ModelConfig

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A checkpoint's fast tokenizer: encode/decode, chat template and the eos token."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json`` and ``chat_template.jinja`` if present), offline."""
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory not found: {model_dir!r}")
        if not os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE)):
            raise FileNotFoundError(
                f"{TOKENIZER_FILE} not found in {model_dir!r}: only fast (tokenizers) checkpoints are supported"
            )
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
        return cls(hf)

    @property
    def hf_tokenizer(self) -> Any:
        """The underlying transformers tokenizer (for callers that need its full API)."""
        return self._hf

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer produces, added/special tokens included.

        This can be smaller than the model's ``vocab_size`` (embedding rows are padded, e.g. 248077 vs 248320).
        """
        return self._backend.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (its added tokens included)."""
        return str(self._backend.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self._hf.chat_template

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template; ``kwargs`` reach the template.

        Template variables such as ``enable_thinking`` or ``tools`` are passed through ``kwargs``. Always returns
        the rendered text (a ``tokenize`` argument is ignored): call ``encode(text, add_special_tokens=False)``.
        """
        if not self._hf.chat_template:
            raise ValueError(
                "this checkpoint's tokenizer has no chat template (no 'chat_template' in tokenizer_config.json and "
                "no chat_template.jinja); pass a plain-text prompt instead"
            )
        kwargs.pop("tokenize", None)
        return self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


def load_generation_config(model_dir: str) -> dict[str, Any]:
    """``generation_config.json`` as a dict; ``{}`` if the checkpoint has none."""
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# generation_config.json keys vLLM takes as default sampling parameters, and the SamplingParams field of each.
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# Keys SamplingParams has no field for: a non-neutral value is reported, never silently dropped.
UNSUPPORTED_GENERATION_KEYS: dict[str, float] = {}


def generation_defaults(model_dir: str, generation_config: str = "auto", override: dict[str, Any] | None = None
                        ) -> tuple[dict[str, Any], str | None]:
    """Default sampling parameters (SamplingParams field -> value) and the file they came from, as vLLM's
    ``--generation-config``: ``"vllm"`` = none; ``"auto"`` = ``model_dir``'s generation_config.json (none if it
    has no file); any other value = a directory that must hold a generation_config.json.

    Only the keys vLLM reads are taken (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as
    max_tokens); ``do_sample`` is ignored as vLLM does. Unsupported keys (``UNSUPPORTED_GENERATION_KEYS``) stay in
    the dict for the caller to report. ``override`` (``--override-generation-config``): keys of the same file
    format set over the file's (with ``"vllm"``, alone); a key hyserve does not read is a ``ValueError`` naming it.
    """
    extra = {}
    for key, value in (override or {}).items():
        if key not in _GENERATION_KEYS:
            raise ValueError(f"--override-generation-config: {key!r} is not a key hyserve reads (it reads "
                             f"{', '.join(_GENERATION_KEYS)})")
        extra[_GENERATION_KEYS[key]] = value
    if generation_config == "vllm":
        return extra, ("--override-generation-config" if extra else None)
    if generation_config == "auto":
        directory = model_dir
    else:
        directory = generation_config
        if not os.path.isfile(os.path.join(directory, GENERATION_CONFIG_FILE)):
            raise FileNotFoundError(f"generation_config={generation_config!r}: no {GENERATION_CONFIG_FILE} in that "
                                    "directory (use 'auto', 'vllm' or a directory holding one)")
    raw = load_generation_config(directory)
    out = {field: raw[key] for key, field in _GENERATION_KEYS.items() if raw.get(key) is not None}
    source = os.path.join(directory, GENERATION_CONFIG_FILE) if raw else None
    if extra:
        source = f"{source} and --override-generation-config" if source else "--override-generation-config"
    return {**out, **extra}, source


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def stop_token_ids(model_dir: str, model_config: ModelConfig, tokenizer: Tokenizer | None = None) -> list[int]:
    """Ids that end generation: generation_config.json's ``eos_token_id`` (int or list), the model config's eos
    ids and the tokenizer's eos token, de-duplicated in that order.

    Chat checkpoints need the union: Qwen3.5's config names ``<|endoftext|>`` while chat turns end with
    ``<|im_end|>`` (the tokenizer's eos and the first entry of generation_config.json). ``tokenizer`` avoids
    reloading one; without it the tokenizer is loaded if the checkpoint has ``tokenizer.json``.
    """
    ids = _as_id_list(load_generation_config(model_dir).get("eos_token_id"))
    ids += list(model_config.eos_token_id)
    if tokenizer is None and os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE)):
        tokenizer = Tokenizer.from_model_dir(model_dir)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


class IncrementalDetokenizer:
    """Streams the text of generated tokens, O(window) work per token (vLLM's prefix/read offsets).

    Invariants: ``_ids[_prefix:_read]`` is a short window of tokens whose text has already been emitted (it gives
    the next tokens their context: byte-level merges and leading spaces); ``_ids[_read:]`` are tokens whose text is
    not emitted yet. A new token's text is ``decode(_ids[_prefix:]) - decode(_ids[_prefix:_read])``; while that
    ends in U+FFFD (an incomplete UTF-8 sequence, e.g. the first bytes of an emoji) it is held back and the window
    grows until the character completes. Ids before ``_prefix`` are dropped, so memory is O(window) as well.

    The window starts on the last few prompt tokens, so ``text`` equals ``tokenizer.decode(output_ids)``, except
    that a trailing incomplete character is held back until ``flush()``.
    """

    INITIAL_CONTEXT = 5  # prompt tokens kept as context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
    _TRIM_AT = 64  # drop consumed ids once this many pile up before the window

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self.INITIAL_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text finalized so far."""
        return self._text

    def append(self, new_token_ids: Iterable[int]) -> str:
        """Add generated tokens; returns the text they finalized (possibly ``""`` while a character is partial)."""
        delta = "".join(self._step(int(t)) for t in new_token_ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """Emit text still held back (an incomplete trailing character decodes to U+FFFD), e.g. when finished."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix, len(self._ids))
        delta = full[len(prefix_text):] if full.startswith(prefix_text) else full
        self._prefix = self._read = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix, len(self._ids))
        if len(full) <= len(prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (skipped special token or incomplete UTF-8): keep the window
        delta = full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix >= self._TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta
