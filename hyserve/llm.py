"""``LLM``: the offline entry point, with vLLM's names.

``LLM.generate(prompts)`` without SamplingParams uses ``get_default_sampling_params()``: the checkpoint's
generation_config.json values (``generation_config="auto"``, vLLM's rule) over SamplingParams' defaults.
``shutdown()`` (or leaving a ``with LLM(...) as llm:`` block) releases the model, caches and CUDA graphs at once;
dropping the last reference does the same, as nothing in the engine holds itself in a reference cycle.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tqdm.auto import tqdm

from hyserve.config import EngineConfig, available_cpus, normalize_mm_limits
from hyserve.engine.llm_engine import LLMEngine, PromptType, has_raw_images
from hyserve.multimodal.chat import chat_inputs
from hyserve.outputs import RequestOutput
from hyserve.sampling_params import RequestOutputKind, SamplingParams

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "default_model")


def default_model_dir() -> str:
    """The small hybrid model with an MTP head that ships inside the package (see default_model/TRAINING.md)."""
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        raise ValueError(f"no model given and the packaged default model is missing from {DEFAULT_MODEL_DIR}; "
                         "pass LLM(model='path/to/dir')")
    return DEFAULT_MODEL_DIR


class _Refused:
    """A prompt whose preparation raised ``error`` (``LLM._prepare_images``)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        speculative_config: dict[str, Any] | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        disable_log_stats: bool = True,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("limit_mm_per_prompt") is not None:  # vLLM's {"image": {"count": n}} form too
            kwargs["limit_mm_per_prompt"] = normalize_mm_limits(kwargs["limit_mm_per_prompt"])
        known = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
        config = EngineConfig(
            model=model if model is not None else default_model_dir(),
            dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, speculative_config=speculative_config, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, disable_log_stats=disable_log_stats, **kwargs,
        )
        self.llm_engine = LLMEngine(config)
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams ``generate`` and ``chat`` use when given none (vLLM's name): SamplingParams' defaults
        overridden by the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, max_new_tokens as
        max_tokens) unless ``generation_config="vllm"``."""
        return self.llm_engine.get_default_sampling_params()

    def shutdown(self) -> None:
        """Release the model, KV cache, state pool and CUDA graphs now (idempotent); the LLM is unusable after."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        if self.llm_engine.is_shut_down:
            raise RuntimeError("this LLM was shut down; create a new one")
        items = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(items))
        self._check_output_kinds(params)
        engine = self.llm_engine
        prepared = self._prepare_images(items)
        ids: list[str] = []
        try:
            for prompt, p in zip(prepared, params, strict=True):
                if isinstance(prompt, _Refused):  # its preparation failed: raised where adding it would have
                    raise prompt.error
                rid = f"llm-{self._counter}"
                self._counter += 1
                engine.add_request(rid, prompt, p)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            raise

    def _prepare_images(self, items: list[PromptType]) -> list[PromptType | _Refused]:
        """The prompts with images processed on up to one thread per CPU (``LLMEngine.prepare_prompt``) before any
        is added, in order. A prompt whose preparation fails becomes ``_Refused``: ``generate`` raises its error
        where adding it would have, so the error is the one adding them one by one gives."""
        todo = [i for i, p in enumerate(items) if has_raw_images(p)]
        out: list[PromptType | _Refused] = list(items)
        if len(todo) < 2 or available_cpus() < 2:
            return out
        engine = self.llm_engine

        def prepare(prompt: PromptType) -> PromptType | _Refused:
            try:
                return engine.prepare_prompt(prompt)
            except Exception as e:
                return _Refused(e)

        with ThreadPoolExecutor(max_workers=min(len(todo), available_cpus()),
                                thread_name_prefix="hyserve-images") as pool:
            for i, p in zip(todo, pool.map(prepare, [items[i] for i in todo]), strict=True):
                out[i] = p
        return out

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template and generate; outputs in order.

        ``content`` is a string or a list of OpenAI-style parts: ``text``, ``image_url`` (a data URL, or an
        ``http(s)``/``file://`` URL the engine config allows), ``image_pil`` and ``image`` (PIL image, bytes or URL).
        A conversation with images goes to the engine as ``{"prompt", "prompt_token_ids", "multi_modal_data"}``.
        Refusals (``ValueError``, ``MediaError`` for an image) name the part: ``messages[0].content[1]: ...``.
        """
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("this checkpoint has no tokenizer, so chat() cannot apply a chat template")
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        engine = self.llm_engine
        config = engine.config
        prompts: list[PromptType] = []
        for c, conv in enumerate(conversations):
            if not isinstance(conv, list) or not conv:
                raise ValueError("each conversation must be a non-empty list of {'role': ..., 'content': ...}")
            # Every conversation's images are counted before any is read (hyserve.multimodal.chat).
            template_messages, images = chat_inputs(
                conv, limit=config.image_limit, accepts_images=engine.model_config.multimodal is not None,
                refusal=engine.model_config.image_refusal,
                allowed_domains=config.allowed_media_domains, allowed_local_path=config.allowed_local_media_path,
                where="messages" if len(conversations) == 1 else f"messages[{c}]")
            text = tok.apply_chat_template(template_messages if images else conv,
                                           add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
            prompt: dict[str, Any] = {"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> dict[str, float | list[float]]:
        return self.llm_engine.get_metrics()

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # a single prompt given as token ids
        items: list[PromptType] = list(prompts)  # type: ignore[arg-type]
        if not items:
            raise ValueError("no prompts given")
        return items

    def _as_params_list(self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        items = list(sp)
        if len(items) != n:
            raise ValueError(f"got {len(items)} SamplingParams for {n} prompts; pass one, or one per prompt")
        return items

    @staticmethod
    def _check_output_kinds(params: list[SamplingParams]) -> None:
        # generate() returns each request's final output, which is the whole completion only if it is cumulative.
        if any(p.output_kind is RequestOutputKind.DELTA for p in params):
            raise ValueError("output_kind=DELTA is for streaming (LLMEngine.step, AsyncEngine); LLM.generate "
                             "returns whole completions (CUMULATIVE or FINAL_ONLY)")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError("engine stopped with requests still pending")
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
            # Nothing else waits or runs: finish the steps still in flight and tell the workers which requests
            # ended, so that an idle engine holds nothing of them (invariant 15).
            while engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests():
                engine.step()
        finally:
            bar.close()
        return [done[i] for i in ids]
