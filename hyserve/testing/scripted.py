"""An engine whose model says what a test wants (``ScriptedModel``), for the server's answer parsers (tool calls,
reasoning): the test plants a text, the next request's output is its tokens and then the end-of-sequence token,
whatever the weights. Everything else is real: the scheduler, the sampler, detokenizing, the routes.

``TOOL_CHAT_TEMPLATE`` is a small Qwen3.5-style chat template that renders tools, assistant tool calls (with their
arguments as objects), tool results, and the ``<think>`` that Qwen3.5 puts in the prompt (closed when
``enable_thinking`` is false).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from hyserve.engine.llm_engine import LLMEngine
from hyserve.testing.server import ServerThread

# transformers renders with trim_blocks: a newline right after a block tag is dropped (written as {{ '\\n' }}).
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools{% for t in tools %}{{ '\\n' }}{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response id={{ m.tool_call_id }}>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ '\\n' }}<tool_call>\n<function={{ c.function.name }}>"
    "{% for k, v in c.function.arguments.items() %}{{ '\\n' }}<parameter={{ k }}>\n{{ v }}\n</parameter>{% endfor %}"
    "{{ '\\n' }}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def write_chat_template(model_dir: str, template: str = TOOL_CHAT_TEMPLATE) -> None:
    """Give a checkpoint this chat template (``chat_template.jinja`` wins over tokenizer_config.json's)."""
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(template)


class ScriptedModel:
    """Makes ``engine``'s model emit ``plant(text)``'s tokens, then its end-of-sequence token, for the next request.

    One request at a time: each row of logits the model computes is the next planted token (a finished request's
    extra step, under async scheduling, reads end-of-sequence again). The logits are finite (invariant 8).
    """

    def __init__(self, engine: LLMEngine) -> None:
        tok = engine.tokenizer
        assert tok is not None and tok.eos_token_id is not None
        self.tokenizer = tok
        self.eos = tok.eos_token_id
        self.ids: list[int] = []
        self.next = 0
        model = engine.runner.model
        real = model.compute_logits

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            logits = torch.full_like(real(hidden), -30.0)
            for row in range(logits.shape[0]):
                logits[row, self.ids[self.next] if self.next < len(self.ids) else self.eos] = 30.0
                self.next += 1
            return logits

        model.compute_logits = compute_logits  # type: ignore[method-assign]

    def plant(self, text: str) -> list[int]:
        """The next request answers ``text`` (its token ids are returned)."""
        self.ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert self.tokenizer.decode(self.ids) == text, "the tiny tokenizer cannot spell this text"
        self.next = 0
        return self.ids


@contextlib.contextmanager
def scripted_server(root: str, name: str, **app_kw: Any) -> Iterator[tuple[ServerThread, ScriptedModel]]:
    """A tiny checkpoint under ``root`` with the tool-calling chat template, served in a thread as ``name`` by an
    engine whose model says what a test plants (``ScriptedModel``); ``app_kw`` go to ``build_app`` (parsers)."""
    from hyserve.config import EngineConfig
    from hyserve.server import AsyncEngine, build_app
    from hyserve.testing.qwen3_5 import write_tiny_checkpoint

    path = write_tiny_checkpoint(os.path.join(root, name))
    write_chat_template(path)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=64 * 2**20))
    model = ScriptedModel(engine)
    async_engine = AsyncEngine(engine, start=False)
    with ServerThread(async_engine, app=build_app(async_engine, name, **app_kw)) as server:
        yield server, model
