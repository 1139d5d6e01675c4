"""LLM lifecycle on the CPU: torch's thread count chosen at startup (and logged), ``shutdown()`` / ``with LLM(...)``,
and no reference cycle that keeps a dropped LLM's model and caches alive (refcounting alone must free them)."""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Iterator

import pytest
import torch

from hyserve import LLM, SamplingParams, config
from hyserve.testing.families import CheckpointCache
from hyserve.worker import cuda_graphs

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def fresh_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No user choice of threads in sight (no env vars, no set_num_threads since import); torch's count restored."""
    before = torch.get_num_threads()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(config, "_threads_at_import", before)
    monkeypatch.setattr(config, "_threads_set_by_engine", None)
    yield
    torch.set_num_threads(before)


def _affinity(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)


def test_default_threads_leave_one_cpu(fresh_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, want in ((1, 1), (2, 1), (8, 7)):
        _affinity(monkeypatch, cpus)
        n, why = config.resolve_cpu_threads(None)
        assert n == want, (cpus, n)
        assert f"{cpus} CPUs available" in why


def test_user_choices_win(fresh_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _affinity(monkeypatch, 8)
    assert config.resolve_cpu_threads(3)[0] == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    n, why = config.resolve_cpu_threads(None)
    assert n is None and "OMP_NUM_THREADS=5" in why
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(config._threads_at_import + 1)  # the user's own call after importing hyserve
    n, why = config.resolve_cpu_threads(None)
    assert n is None and "set_num_threads" in why


def test_engine_sets_the_thread_count_it_logs(fresh_threads: None, monkeypatch: pytest.MonkeyPatch,
                                              ckpts: CheckpointCache, caplog: pytest.LogCaptureFixture) -> None:
    path = ckpts.get()
    _affinity(monkeypatch, 4)  # a 4-CPU machine: 3 threads, one CPU left for the loop
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = LLM(model=path, device="cpu", num_kv_blocks=64, num_state_slots=4)
    assert torch.get_num_threads() == 3
    assert any("torch uses 3 intra-op threads" in r.getMessage() for r in caplog.records)
    # A second engine does not take the first one's choice for the user's.
    _affinity(monkeypatch, 3)
    LLM(model=path, device="cpu", num_kv_blocks=64, num_state_slots=4)
    assert torch.get_num_threads() == 2
    LLM(model=path, device="cpu", num_kv_blocks=64, num_state_slots=4, cpu_threads=1)
    assert torch.get_num_threads() == 1
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _refs(llm: LLM) -> list[weakref.ref]:
    runner = llm.llm_engine.runner
    return [weakref.ref(llm.llm_engine), weakref.ref(runner), weakref.ref(runner.model),
            weakref.ref(runner.kv_caches[0][0]), weakref.ref(runner.state_pool.ssm_states[0])]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 2},
                                  {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "ngram", "mtp"])
def test_dropping_the_last_reference_frees_everything(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                      graphs: bool, spec: dict | None) -> None:
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True) if spec and spec["method"] == "mtp" else ckpts.get()
    llm = LLM(model=path, device="cpu", num_kv_blocks=64, num_state_slots=4, speculative_config=spec)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 1, 2]}] * 2, GREEDY, use_tqdm=False)
    refs = _refs(llm)
    gc.collect()
    gc.disable()  # refcounting alone must free it: a cycle would keep it until a gc pass
    try:
        del llm
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert not any(alive), f"still alive (engine, runner, model, kv, ssm): {alive}"


def test_shutdown_and_context_manager_release(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    gc.collect()
    gc.disable()
    try:
        llm = LLM(model=path, device="cpu", num_kv_blocks=64, num_state_slots=4)
        llm.llm_engine.add_request("pending", {"prompt_token_ids": [4, 5, 6]}, GREEDY)
        refs = _refs(llm)[1:]
        llm.shutdown()
        alive = [r() is not None for r in refs]
        llm.shutdown()  # idempotent
        with LLM(model=path, device="cpu", num_kv_blocks=64, num_state_slots=4) as other:
            assert other.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)[0].finished
            other_refs = _refs(other)[1:]
        other_alive = [r() is not None for r in other_refs]
    finally:
        gc.enable()
    assert not any(alive) and not any(other_alive), (alive, other_alive)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        other.llm_engine.add_request("x", {"prompt_token_ids": [1, 2]}, GREEDY)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_utilization_is_this_instances_share() -> None:
    """vLLM's meaning: two instances at 0.4 fit on one card; a second at 0.9 is refused while the first lives, with
    a message that says what holds the memory, and starts once the first is shut down."""
    first = LLM(device="cuda", gpu_memory_utilization=0.4, enforce_eager=True)
    second = LLM(device="cuda", gpu_memory_utilization=0.4, enforce_eager=True)
    for llm in (first, second):
        assert llm.generate("def main():\n", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    second.shutdown()
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.9 asks for .* other LLM instances"):
        LLM(device="cuda", gpu_memory_utilization=0.9, enforce_eager=True)
    first.shutdown()
    third = LLM(device="cuda", gpu_memory_utilization=0.9, enforce_eager=True)
    share = torch.cuda.memory_reserved() / torch.cuda.mem_get_info()[1]
    # The step buffers and logits allocated after planning are not in the budget: allow 1% of the card for them.
    assert 0.8 <= share <= 0.91, f"the instance holds {share:.3f} of the card"
    third.shutdown()
