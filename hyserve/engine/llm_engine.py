"""The step-level engine: admit requests, run scheduled steps, turn sampled tokens into outputs.

``step()`` returns a ``RequestOutput`` for every request that ran or finished in that step, shaped by its
``SamplingParams.output_kind``: the cumulative token ids and text so far (vLLM's default), only what is new (DELTA)
or nothing until it finishes (FINAL_ONLY). Sampled and verified tokens alike go through the one
``OutputProcessor`` (detokenization, stop checks, outputs).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hyserve.cache.prefix_cache import PrefixCache
from hyserve.config import EngineConfig, ModelConfig, apply_cpu_threads, resolve_dtype
from hyserve.engine.metrics import EngineMetrics, StatsLogger
from hyserve.engine.model_runner import ModelRunner, cache_memory_flag
from hyserve.engine.output_processor import NewTokens, OutputProcessor
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.scheduler import ScheduledRow, Scheduler
from hyserve.layers.rejection_sampler import RejectionSampler
from hyserve.layers.sampler import SamplerOutput, SamplingRow
from hyserve.outputs import RequestOutput
from hyserve.sampling_params import SamplingParams
from hyserve.speculative.config import SpeculativeConfig
from hyserve.speculative.proposer import NgramProposer, Proposer
from hyserve.speculative.step import SpeculativeStepMixin, token_seed
from hyserve.tokenizer import (
    UNSUPPORTED_GENERATION_KEYS,
    Tokenizer,
    generation_defaults,
    stop_token_ids,
)

logger = logging.getLogger("hyserve")

PromptType = str | dict[str, Any] | list[int]
T = TypeVar("T")


class LLMEngine(SpeculativeStepMixin):
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_config = ModelConfig.from_model_dir(config.model)
        self.spec_config: SpeculativeConfig | None = None
        if config.speculative_config is not None:
            self.spec_config = SpeculativeConfig.from_dict(config.speculative_config, self.model_config)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available; use device='cpu'")
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        if self.device.type == "cpu":
            threads, why = apply_cpu_threads(config.cpu_threads)
            logger.info("CPU: torch uses %d intra-op thread%s (%s; --cpu-threads / cpu_threads sets it)", threads,
                        "" if threads == 1 else "s", why)
        self.tokenizer: Tokenizer | None = self._load_tokenizer(config.model)
        # Values for the SamplingParams fields a request leaves unset (vLLM's default_sampling_params).
        self.default_sampling_params: dict[str, Any] = self._load_default_sampling_params()
        eos_token_ids = set(stop_token_ids(config.model, self.model_config))
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self.use_mtp = self.spec_config is not None and self.spec_config.method == "mtp"
        self.runner = ModelRunner(config, self.model_config, self.device, self.dtype, num_speculative_tokens=k,
                                  use_mtp=self.use_mtp)
        self.max_model_len = self._resolve_max_model_len()
        self.runner.set_max_model_len(self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, eos_token_ids, self.max_model_len)
        self.prefix_cache: PrefixCache | None = None
        if config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.runner.block_pool, self.runner.state_pool, config.block_size,
                                            config.recurrent_snapshot_interval,
                                            has_recurrent_state=bool(self.runner.state_pool.layers),
                                            lookahead=1 if self.use_mtp else 0)
        self.scheduler = Scheduler(self.runner.max_num_seqs, self.runner.max_num_batched_tokens,
                                   self.runner.block_pool, self.runner.state_pool, self.prefix_cache,
                                   speculative=self.spec_config is not None)
        self.proposer: Proposer | None = None
        self.rejection_sampler: RejectionSampler | None = None
        self._mtp_next: dict[str, tuple[torch.Tensor, int, int]] = {}
        if self.spec_config is not None and not self.use_mtp:
            self.proposer = NgramProposer(self.spec_config.prompt_lookup_min, self.spec_config.prompt_lookup_max)
        if self.spec_config is not None:
            self.rejection_sampler = RejectionSampler(self.device, seed=config.seed)
            logger.info("speculative decoding: %s, %d tokens per step", self.spec_config.method, k)
        self.metrics = EngineMetrics()
        self.stats_logger: StatsLogger | None = None
        if not config.disable_log_stats:
            self.stats_logger = StatsLogger(config.log_stats_interval_s)
        self.requests: dict[str, Request] = {}
        self.is_shut_down = False
        self._arrivals = 0
        self._deferred_finish: list[Request] | None = None
        lay = self.runner.layout
        logger.info("cache: %d KV blocks of %d tokens (%d tokens, %.1f MiB), %d state slots (%.1f MiB); "
                    "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d",
                    lay.num_kv_blocks - 1, config.block_size, (lay.num_kv_blocks - 1) * config.block_size,
                    lay.num_kv_blocks * lay.kv_bytes_per_block / 2**20, lay.num_state_slots,
                    (lay.num_state_slots + 1) * lay.state_bytes_per_slot / 2**20, self.max_model_len,
                    self.runner.max_num_seqs, self.runner.max_num_batched_tokens)
        if self.prefix_cache is not None:
            per_token = lay.kv_bytes_per_block / config.block_size
            logger.info("prefix cache: KV blocks of %d tokens and up to %d recurrent snapshots (%.1f MiB; one costs "
                        "the memory of %.0f KV tokens) share one key space; snapshots at each prompt end, request "
                        "end, branch point and every %d tokens", config.block_size, lay.num_snapshots,
                        lay.num_snapshots * lay.state_bytes_per_slot / 2**20,
                        lay.state_bytes_per_slot / max(per_token, 1e-9), config.recurrent_snapshot_interval)
        else:
            logger.info("prefix caching is off")

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a request unless ``ignore_eos``: the output processor's (one copy, which stops)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.output_processor.eos_token_ids = ids

    def _load_default_sampling_params(self) -> dict[str, Any]:
        defaults, source = generation_defaults(self.config.model, self.config.generation_config)
        for key, neutral in UNSUPPORTED_GENERATION_KEYS.items():
            value = defaults.pop(key, None)
            if value is not None and float(value) != neutral:
                logger.warning("%s sets %s=%s, which hyserve does not support yet: it is NOT applied (pass "
                               "--generation-config vllm to ignore the file)", source, key, value)
        if defaults:
            SamplingParams(**defaults)  # a bad value in the file fails here, at startup, naming the field
            logger.info("default sampling parameters from %s: %s (a request's own values win; "
                        "--generation-config vllm ignores the file)", source, defaults)
        else:
            logger.info("default sampling parameters: SamplingParams' own (%s)",
                        "--generation-config vllm" if self.config.generation_config == "vllm"
                        else "no generation_config.json values")
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's name)."""
        return SamplingParams(**self.default_sampling_params)

    @staticmethod
    def _load_tokenizer(model_dir: str) -> Tokenizer | None:
        try:
            return Tokenizer.from_model_dir(model_dir)
        except FileNotFoundError:
            logger.warning("no tokenizer.json in %s: only token-id prompts are accepted and no text is returned",
                           model_dir)
            return None

    def _resolve_max_model_len(self) -> int:
        capacity = self.runner.block_pool.num_usable_blocks * self.config.block_size
        limit = self.model_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is None:
            if capacity < limit:
                logger.warning("the KV cache holds %d tokens, fewer than the model's %d: max_model_len set to %d",
                               capacity, limit, capacity)
            return min(limit, capacity)
        if asked > capacity:
            raise ValueError(f"max_model_len={asked} does not fit in the KV cache ({capacity} tokens); lower "
                             f"--max-model-len or give the cache more memory ({cache_memory_flag(self.device)})")
        return asked

    # ------------------------------------------------------------------ requests

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.encode_prompt(str(prompt["prompt"]))
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids' (got keys {sorted(prompt)})")
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}; use str or {{'prompt_token_ids': [...]}}")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return list(ids)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down")
        params = params or self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams (got {type(params).__name__})")
        self.check_sampling_params(params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len} "
                             "allows (the prompt must leave room for at least one output token)")
        detok = self.output_processor.detokenizer(ids, params)
        req = Request(request_id, text, ids, params, self._arrivals, detok, arrival_time=time.time())
        self._arrivals += 1
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        self.metrics.on_request_added(len(ids))

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Refuse (ValueError naming the field) what SamplingParams alone cannot judge: values that depend on the
        model. The server calls this before queueing a request; add_request calls it too."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids contains ids outside the vocabulary [0, {vocab}) (vocabulary size "
                             f"{vocab}): {bad[:5]}")

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None or req.is_finished:
                continue
            req.finish_reason = "abort"
            req.finished_time = time.time()
            self.scheduler.finish(req)
            self.metrics.on_request_finished("abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.metrics.on_preemptions(len(sched.preempted))
        self._on_scheduled(sched.rows)
        outputs: list[RequestOutput] = []
        for req, why in sched.failed:  # can never be admitted: an error now rather than a queue blocked forever
            self._fail(req, why)
            self._final_output(req, outputs)
        if sched.is_empty:
            return outputs
        if self.spec_config is not None:
            return outputs + self._step_speculative(sched.rows)
        t0 = time.perf_counter()
        sampling_rows, sampled = self._sampling_rows(sched.rows)
        rows = self._drop_failed(sched.rows, outputs)
        if not rows:
            return outputs
        result = self.runner.execute(rows, sampling_rows)
        for row in rows:
            row.request.num_computed_tokens = row.end
        if self.prefix_cache is not None:
            self._publish(rows)
        if result is not None:
            self._apply_samples(sampled, result)
        for row in rows:
            req = row.request
            self._emit(req, outputs)
            if req.is_finished:
                self.requests.pop(req.request_id, None)
        self.metrics.on_step(sum(r.num_new_tokens for r in rows), len(sampled), time.perf_counter() - t0)
        return outputs

    def _fail(self, req: Request, why: str) -> None:
        """Finish ``req`` alone with finish_reason "error" (a log line, the error metric); the others go on."""
        req.error = why
        logger.error("request %s: %s; finishing it with an error", req.request_id, why)
        self._finish(req, "error")

    def _guard(self, req: Request, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None after failing ``req`` alone if it raises: one request's bad input or a bug on its
        path (sampling row, detokenization, stop checks) must not kill the step for every other request."""
        try:
            return fn()
        except Exception as e:  # any failure here is this request's alone
            logger.exception("request %s: %s failed", req.request_id, what)
            if not req.is_finished:
                self._fail(req, f"{what} failed: {type(e).__name__}: {e}")
            return None

    def _final_output(self, req: Request, outputs: list[RequestOutput]) -> None:
        self.requests.pop(req.request_id, None)
        self._emit(req, outputs)

    def _emit(self, req: Request, outputs: list[RequestOutput]) -> None:
        """Append ``req``'s output of this step to ``outputs`` (FINAL_ONLY has none before the end)."""
        out = self._make_output(req)
        if out is not None:
            outputs.append(out)

    def _drop_failed(self, rows: list[ScheduledRow], outputs: list[RequestOutput]) -> list[ScheduledRow]:
        """Rows whose request failed before the forward leave the step (their memory is already freed; their
        snapshot pins are released here); their final outputs go to ``outputs``."""
        kept = [r for r in rows if not r.request.is_finished]
        for row in rows:
            if row.request.is_finished:
                if self.prefix_cache is not None:
                    self.prefix_cache.unpin(row.load_snapshot)
                self._final_output(row.request, outputs)
        return kept

    def _on_scheduled(self, rows: list[ScheduledRow]) -> None:
        """Per step, before it runs: first-scheduled times, prompt tokens computed, the periodic stats line."""
        now = time.time()
        for row in rows:
            req = row.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.metrics.prompt_tokens_computed += max(0, min(row.end, req.num_prompt_tokens) - row.start)
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(self)

    def _publish(self, rows: list[ScheduledRow], vrows: list[ScheduledRow] | None = None,
                 accepted: list[int] | None = None) -> None:
        """After a step: publish computed full blocks, fill snapshots, release this step's snapshot pins.

        A verify row publishes only up to its accepted length; a snapshot at a block boundary inside the accepted
        positions is taken from the verified candidate state of that position.
        """
        assert self.prefix_cache is not None
        pc = self.prefix_cache
        bs = self.config.block_size
        src: list[int] = []
        dst: list[int] = []
        cand_rows: list[int] = []
        cand_pos: list[int] = []
        cand_dst: list[int] = []
        verify_index = {id(r): i for i, r in enumerate(vrows or [])}
        for row in rows:
            req = row.request
            # A stop inside accepted drafts drops the tokens after it: publish only tokens the request has. With
            # MTP (lookahead) also only positions whose MTP entry is written: the step wrote those before the
            # request's last known token (see ``_mtp_consume``), exactly the keyable ones.
            computed = min(req.num_computed_tokens, pc.keyable_tokens(req))
            pc.publish_blocks(req, computed)
            if row.is_verify:
                i = verify_index[id(row)]
                a = (accepted or [])[i]
                point = (computed // bs) * bs
                if a >= 0 and point > row.start:
                    entry = pc.take_snapshot(req, point)
                    if entry is not None:
                        cand_rows.append(i)
                        cand_pos.append(point - row.start - 1)
                        cand_dst.append(entry)
            elif row.snapshot_at is not None:
                entry = pc.take_snapshot(req, row.end)
                if entry is not None and req.state_slot is not None:
                    src.append(req.state_slot)
                    dst.append(entry)
            pc.unpin(row.load_snapshot)
        self.runner.state_pool.copy(src, dst)
        self.runner.snapshot_candidates(cand_rows, cand_pos, cand_dst)

    def _sampling_rows(self, rows: list[ScheduledRow]) -> tuple[list[SamplingRow], list[Request]]:
        """The sampling rows of the rows that sample; a request whose row cannot be built fails alone (before
        the forward: the caller drops its row, see ``_drop_failed``)."""
        srows: list[SamplingRow] = []
        reqs: list[Request] = []
        for row in rows:
            if not row.samples:
                continue
            req = row.request
            srow = self._guard(req, "building its sampling row", functools.partial(self._sampling_row, req))
            if srow is not None:
                srows.append(srow)
                reqs.append(req)
        return srows, reqs

    def _sampling_row(self, req: Request) -> SamplingRow:
        p = req.sampling_params
        seed = None if p.seed is None else token_seed(p.seed, req.num_output_tokens)
        return SamplingRow(params=p, seed=seed, banned_token_ids=self._banned(req, req.num_output_tokens))

    def _apply_samples(self, reqs: list[Request], result: SamplerOutput) -> None:
        errors = set(result.error_rows)
        for i, req in enumerate(reqs):
            if i in errors:
                req.error = "non-finite logits"
                logger.error("request %s: logits contain NaN/inf at output token %d; finishing it with an error",
                             req.request_id, req.num_output_tokens)
                self._finish(req, "error")
                continue
            self._guard(req, "taking its sampled token", functools.partial(self._apply_sample, req, i, result))

    def _apply_sample(self, req: Request, i: int, result: SamplerOutput) -> None:
        """Hand row ``i``'s token to the output processor; finish ``req`` if it ends there."""
        new = NewTokens([int(result.token_ids[i])])
        if result.logprobs is not None:
            new.logprobs = [float(result.logprobs[i])]
            new.ranks = [result.ranks[i]] if result.ranks is not None else None
            new.top_logprobs = [result.top_logprobs[i]] if result.top_logprobs is not None else None
        self._append_tokens(req, new)

    def _append_tokens(self, req: Request, new: NewTokens) -> None:
        """The one path of new output tokens (plain and verify steps): the processor appends them up to a stop."""
        reason = self.output_processor.append(req, new)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finished_time = time.time()
        if self._deferred_finish is not None:
            req.status = RequestStatus.FINISHED
            self._deferred_finish.append(req)
        else:
            self.scheduler.finish(req)
        self.metrics.on_request_finished(reason)

    def _make_output(self, req: Request) -> RequestOutput | None:
        return self.output_processor.make_output(req)

    def get_metrics(self) -> dict[str, float | list[float]]:
        return self.metrics.snapshot(self)

    def shutdown(self) -> None:
        """Abort every request and drop the model, its caches, CUDA graphs and step buffers (idempotent).

        Nothing in the engine refers back to it in a cycle, so once these references go the memory is freed by
        reference counting alone; on CUDA torch's cached blocks are then returned to the device.
        """
        if self.is_shut_down:
            return
        self.abort_request(list(self.requests))
        self.is_shut_down = True
        for name in ("runner", "scheduler", "prefix_cache", "proposer", "rejection_sampler"):
            self.__dict__.pop(name, None)
        self._mtp_next.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # Used by tests: every block and slot is back in its pool once nothing runs.
    def assert_no_leaks(self) -> None:
        pool, states = self.runner.block_pool, self.runner.state_pool
        if self.has_unfinished_requests():
            raise AssertionError("requests are still running")
        if pool.num_free_blocks != pool.num_usable_blocks:
            raise AssertionError(f"KV blocks leaked: {pool.num_usable_blocks - pool.num_free_blocks}")
        if states.num_free_slots != states.num_slots:
            raise AssertionError(f"state slots leaked: {states.num_slots - states.num_free_slots}")
