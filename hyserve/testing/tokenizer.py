"""The tiny byte-level BPE tokenizer every test checkpoint carries, trained once per process with Qwen's pipeline
(NFC, Qwen's split regex, byte-level), its ChatML special tokens at the top of the id range, and the files that hold
it (tokenizer.json, tokenizer_config.json). Family-neutral: any family's checkpoint writer can use it."""

from __future__ import annotations

import functools
import os
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from hyserve.testing.files import write_json

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The pre-tokenizer regex of Qwen3.5's tokenizer.json (and transformers' Qwen3_5Tokenizer).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the tokens before it.
Hybrid models mix linear attention layers, which keep a fixed-size recurrent state, with full attention layers,
which keep a key-value cache that grows with the sequence. The engine schedules requests, batches their tokens,
and streams the generated text back to the user one token at a time. Once upon a time there was a little robot
who wanted to learn how to write poems about the sea, the stars and the mountains.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? The capital is Paris.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

class Request:
    def __init__(self, prompt: str, max_tokens: int = 16) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
你好，世界！今天天气很好。我们一起学习语言模型。
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828
"""

_TOKENIZER_BASE_VOCAB = 448  # byte alphabet (256) + merges; the three special tokens come after it


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Qwen3.5's pipeline trained on ``texts``: ``vocab_size`` ids, the special tokens last.

    The pipeline (NFC, Qwen's split regex, byte-level without its own regex, byte-level decoder) is the one Qwen3.5's
    tokenizer.json uses, so transformers' ``Qwen3_5Tokenizer`` (which rebuilds that pipeline from vocab/merges and
    ignores the file's pre-tokenizer) and the raw ``tokenizers`` file agree. The special tokens are appended after
    the trained vocabulary, at the top of the id range, as in the real checkpoints.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """Train (once per process) the tiny tokenizer of the test checkpoints; returns its tokenizer.json text."""
    texts = _TRAINING_TEXT.splitlines(keepends=True) * 4
    return train_bpe(texts, _TOKENIZER_BASE_VOCAB + len(SPECIAL_TOKENS)).to_str()


def tokenizer_size() -> int:
    """Number of token ids the tiny tokenizer uses (trained vocabulary + special tokens)."""
    return Tokenizer.from_str(tokenizer_json()).get_vocab_size(with_added_tokens=True)


def special_token_ids() -> dict[str, int]:
    tok = Tokenizer.from_str(tokenizer_json())
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return {t: i for t, i in ids.items() if i is not None}
def tokenizer_config(ids: dict[str, int], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json of a ChatML byte-level BPE tokenizer with ``SPECIAL_TOKENS`` at ``ids``."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "errors": "replace",
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }



def write_tokenizer(path: str) -> None:
    """tokenizer.json and tokenizer_config.json of the tiny tokenizer (ChatML template) into ``path``."""
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json())
    write_json(os.path.join(path, "tokenizer_config.json"), tokenizer_config(special_token_ids(), 4096))


def user_turn(text: str) -> str:
    """A ChatML user turn with ``text``, then the assistant's turn opened (what the chat template renders)."""
    return f"{IM_START}user\n{text}{IM_END}\n{IM_START}assistant\n"
