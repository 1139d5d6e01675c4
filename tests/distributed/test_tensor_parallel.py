"""Tensor parallelism on the CPU: two worker processes in a gloo group (``tensor_parallel_size=2``).

Each rank holds its attention heads (KV heads split, or the one it reads when there are fewer KV heads than
ranks), its GDN key and value heads with their conv channels, gates and SSM states, and its MLP channels; the
row-parallel projections sum over the group; the embedding and lm_head are split by vocabulary (lookup summed,
logits gathered), so every rank samples the same tokens (the MTP head's decoder layer is split like the model's).
Checked against the single-process engine (token for token, logprobs) and transformers (teacher-forced), with the
async-scheduling scenario's features on together (prefix hits, chunked prefill, preemption, an abort, stops,
seeded sampling, MTP), through the emulated graphs, through ``hyserve serve`` (answers, stops on SIGTERM, leaves
no worker), with a dead rank, and with a sabotaged loader that gives every rank the first rank's shards.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.executor.multiproc import MultiprocExecutor
from hyserve.testing.engine import assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import reference_run, scenario_engine
from hyserve.testing.server import child_pids

# The PP variant of the two-process tests is in the slow suite (the TP one covers the launch and the shutdown).
PARALLEL_FLAGS = ["--tensor-parallel-size", pytest.param("--pipeline-parallel-size", marks=pytest.mark.slow)]


def _tokens(final: dict) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in final.items()}


@pytest.mark.parametrize("spec,async_scheduling",
                         [pytest.param("plain", False, marks=pytest.mark.slow),
                          pytest.param("ngram", True, marks=pytest.mark.slow), ("mtp", True)])  # budget
def test_tp2_matches_one_process_with_every_feature(ckpts: CheckpointCache, spec: str,
                                                    async_scheduling: bool) -> None:
    path, arrivals, aborts, prompts, want = reference_run(ckpts, spec)
    engine = scenario_engine(path, spec, async_scheduling=async_scheduling, tensor_parallel_size=2)
    assert isinstance(engine.executor, MultiprocExecutor) and len(engine.executor.pids) == 2
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    engine.shutdown()
    assert _tokens(got) == _tokens(want)
    for rid, out in got.items():
        tok = out.outputs[0].token_ids
        for i, lp in enumerate(out.outputs[0].logprobs or []):
            assert abs(lp[tok[i]].logprob - want[rid].outputs[0].logprobs[i][tok[i]].logprob) < 1e-4  # type: ignore[index]
    ref = ckpts.reference(path)
    for rid, out in got.items():
        if rid != "d":  # sampled
            assert_matches_reference(ref, prompts[rid], out)


@pytest.fixture(scope="module")
def spare() -> Iterator[dict[str, LLMEngine]]:
    """Engines a test is done with, left running for a later test that only needs some idle TP 2 engine to kill a
    rank of (its worker processes then start once); shut down at the module's end if no test took them."""
    engines: dict[str, LLMEngine] = {}
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.mark.parametrize("spec", [pytest.param(None, marks=pytest.mark.slow),  # the suite's budget: mtp covers it
                                  {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "mtp"])
def test_tp2_causal_form_with_replicated_kv_heads_and_graphs(ckpts: CheckpointCache, spare: dict[str, LLMEngine],
                                                            spec: dict | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One KV head, two ranks: each rank keeps the KV head its query heads read. The workers run the decode,
    verify and MTP graphs' static forwards (emulated), whose logits are gathered over the vocabulary shards."""
    monkeypatch.setenv("HYSERVE_EMULATE_CUDA_GRAPHS", "1")
    path = ckpts.get("causal", "attn_both_ends", num_key_value_heads=1, tie_word_embeddings=True, with_mtp=True)
    prompts = random_prompts(3, [9, 30, 17], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    llm = make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=16, speculative_config=spec)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    replays = llm.llm_engine.executor.collective_rpc("graph_replays")
    spare.setdefault("tp2", llm.llm_engine)  # for test_a_dead_rank_is_reported_by_rank_within_seconds
    kinds = ("verify", "mtp") if spec else ("decode",)
    assert len(replays) == 2 and all(r[k] > 0 for r in replays for k in kinds), replays
    ref = ckpts.reference(path)
    for p, out in zip(prompts, got, strict=True):
        assert_matches_reference(ref, p, out)


def test_a_rank_holding_the_wrong_shard_is_caught(ckpts: CheckpointCache, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage in the worker processes (through ``sitecustomize``): every rank loads the first rank's rows and
    columns. The outputs must differ from transformers'."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        from hyserve.distributed import parallel_state
        from hyserve.layers import sharding

        def take(self, full):
            r = parallel_state.tp_rank()
            pieces = [full.narrow(self.dim, a - r * (b - a), b - a) for a, b in self.ranges]
            return pieces[0] if len(pieces) == 1 else __import__("torch").cat(pieces, dim=self.dim)

        sharding.Shard.take = take
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    path = ckpts.get()
    prompts = random_prompts(2, [12, 20], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    llm = make_llm(path, tensor_parallel_size=2)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    ref = ckpts.reference(path)
    with pytest.raises(AssertionError):
        for p, out in zip(prompts, got, strict=True):
            assert_matches_reference(ref, p, out)


def test_sizes_that_do_not_split_the_heads_are_refused(ckpts: CheckpointCache) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=4"):
        make_llm(ckpts.get(), tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"needs one process per rank.*--distributed-executor-backend mp"):
        make_llm(ckpts.get(), tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be positive"):
        make_llm(ckpts.get(), tensor_parallel_size=0)






@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the worker processes")
@pytest.mark.parametrize("parallel", PARALLEL_FLAGS, ids=["tp2", "pp2"])
def test_serve_with_two_ranks_answers_and_stops_cleanly_on_sigterm(ckpts: CheckpointCache, parallel: str) -> None:
    import signal
    import subprocess
    import sys

    import openai

    from hyserve.testing.server import free_port, process_gone, wait_up

    path = ckpts.get()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "hyserve.cli", "serve", path, "--device", "cpu", "--port",
                             str(port), parallel, "2", "--shutdown-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # exec: the workers are the server's children (forked ones, the forkserver's)
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HYSERVE_WORKER_MULTIPROC_METHOD": "exec"})
    try:
        wait_up(proc, url)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        resp = client.completions.create(model=os.path.basename(path), prompt="The quick brown fox", max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
        want = make_llm(path).generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=5,
                                                                             ignore_eos=True), use_tqdm=False)[0]
        assert resp.choices[0].text == want.outputs[0].text
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert all(process_gone(w, 10) for w in workers), "a worker outlived hyserve serve"


def test_a_dead_rank_is_reported_by_rank_within_seconds(ckpts: CheckpointCache, spare: dict[str, LLMEngine]) -> None:
    """Rank 1 killed: rank 0 would wait for it in the next all-reduce; the engine reports rank 1 instead. On an idle
    synchronous TP 2 engine an earlier test is done with (``spare``), else a new one."""
    import signal
    import time

    from hyserve.executor.multiproc import WorkerError

    engine = spare.pop("tp2", None) or make_llm(ckpts.get(), tensor_parallel_size=2).llm_engine
    assert not engine.has_unfinished_requests() and not engine.async_scheduling
    os.kill(engine.executor.pids[1], signal.SIGKILL)  # type: ignore[attr-defined]
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1: the process died"):
        engine.step()
    assert time.monotonic() - t0 < 5
    engine.shutdown()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the rank processes")
@pytest.mark.parametrize("parallel", PARALLEL_FLAGS, ids=["tp2", "pp2"])
def test_two_nodes_through_torchrun_on_loopback(ckpts: CheckpointCache, tmp_path: Path, parallel: str) -> None:
    """Two torchrun "nodes" of one process each on loopback, ``--distributed-executor-backend torchrun``: rank 0
    serves the API with rank 1 holding the other half of every layer (TP) or the second stage (PP: rank 1 samples
    and sends each step's result to rank 0); stopping rank 0 (SIGTERM) stops rank 1, and both launchers exit 0."""
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from hyserve.testing.server import free_port, wait_up

    path = ckpts.get()
    port, master = free_port(), free_port()
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master),
                               "-m", "hyserve.cli", "serve", path, "--device", "cpu", "--port", str(port),
                               parallel, "2", "--distributed-executor-backend", "torchrun",
                               "--shutdown-timeout", "2"],
                              stdout=logs[n], stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for n in (0, 1)]
    try:
        wait_up(nodes[0], f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        prompts = ["The quick brown fox", "Hello there, how", "One two three four five six"]

        def complete(prompt: str) -> str:
            resp = client.completions.create(model=os.path.basename(path), prompt=prompt, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
            return resp.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: several steps in flight (PP micro-batches)
            texts = list(pool.map(complete, prompts))
        want = make_llm(path).generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                       use_tqdm=False)
        assert texts == [w.outputs[0].text for w in want]
        (rank0,) = child_pids(nodes[0].pid)
        os.kill(rank0, signal.SIGTERM)
        codes = [node.wait(60) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
        for f in logs:
            f.close()
    out = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], out
    assert "rank 0 stopped; exiting" in out[1], out[1]
