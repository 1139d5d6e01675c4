"""The whole engine with the fused MoE kernels, on the CPU: under ``TRITON_INTERPRET=1`` the MoE layers (and only
they) take the Triton kernels on CPU tensors, so ``benchmarks/moe_check.py``'s check runs a tiny Qwen3.5-MoE
checkpoint through them (float32) against transformers' ``Qwen3_5MoeForCausalLM``, teacher-forced on the engine's
greedy tokens (``FP32_RULE``: every clear position's argmax, logprobs within 3e-3; here every prompt passes it as it
is, errors about 4e-7, none left to the check's search for router flips at near-ties).

What runs: one prefill step of 67 tokens (past ``STACKED_MAX_TOKENS``: the sorted order at the prefill tiles, the
shared expert apart on its dense GEMMs), decode at 10 rows (the sorted order with the shared expert stacked as expert
E), then 8, 6 and 5 rows as rows finish (the same order). The check's control (the reference without its shared
experts) must fail, and a sabotaged engine (the stacked shared expert added ungated: weight 1, not its gate's
sigmoid) must fail the check itself, on four short prompts.

Nemotron-H's MoE blocks (Nemotron 3: the kernels' ungated ``relu2`` experts) the same way: the family's MoE tests
run with ``TRITON_INTERPRET=1``, against transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# 67 prompt tokens: one prefill step past the stacked shared expert's 64 tokens (the routing kernel under the
# interpreter costs about 15 ms a token and layer: 192 tokens were 12 of the run's 27 s).
PROMPT_LENS = (4, 17, 5, 9, 6, 1, 12, 3, 8, 2)
MAX_TOKENS = (6, 3, 6, 2, 6, 4, 6, 3, 6, 2)
# The sabotaged engine on fewer, shorter prompts (the suite's budget): it fails at its first decode steps, which take
# the stacked shared expert as the full run's do.
SABOTAGE_PROMPT_LENS = (17, 5, 9, 12)
SABOTAGE_MAX_TOKENS = (3, 3, 2, 3)


def run_checks() -> dict[str, Any]:
    """In the interpreter subprocess: the check, then the same with the ungated sabotage."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import moe_check

    import hyserve.layers.moe as layer_moe

    out: dict[str, Any] = {}
    calls = {"stacked": 0, "apart": 0}
    real_route = layer_moe.route_experts

    def counting(*args: Any, **kw: Any) -> Any:
        calls["stacked" if kw.get("shared_slot") is not None else "apart"] += 1
        return real_route(*args, **kw)

    def ungated(*args: Any, **kw: Any) -> Any:
        weights, ids, gate = real_route(*args, **kw)
        if kw.get("shared_slot") is not None:
            weights[:, -1] = 1.0
        return weights, ids, gate

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "moe")
        moe_check.write_moe_checkpoint(path, moe_check.TINY_MOE, "cpu")
        layer_moe.route_experts = counting  # type: ignore[assignment]
        out["check"] = moe_check.moe_check(path, "cpu", "float32", prompt_lens=PROMPT_LENS, max_tokens=MAX_TOKENS)
        out["routes"] = dict(calls)
        layer_moe.route_experts = ungated  # type: ignore[assignment]
        out["ungated"] = moe_check.moe_check(path, "cpu", "float32", prompt_lens=SABOTAGE_PROMPT_LENS,
                                             max_tokens=SABOTAGE_MAX_TOKENS)
        layer_moe.route_experts = real_route
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


def test_the_engine_with_the_moe_kernels_matches_transformers(results: dict[str, Any]) -> None:
    r = results["check"]
    assert r["tokens_checked"] >= 40, r
    assert r["pass"] and r["pass_unflipped"] and r["prompts_failing"] == 0, r
    # both shared-expert paths ran: stacked (decode) and apart (the prefill step)
    assert results["routes"]["stacked"] > 0 and results["routes"]["apart"] > 0, results["routes"]


def test_the_check_sees_the_shared_expert(results: dict[str, Any]) -> None:
    """The control (the reference without shared experts) fails: the comparison would see a lost shared expert."""
    assert results["check"]["control_sees_the_shared_expert"], results["check"]["control_without_shared_experts"]


def test_an_ungated_stacked_shared_expert_is_caught(results: dict[str, Any]) -> None:
    r = results["ungated"]
    assert not r["pass"] and r["tokens_mismatched"] + (r["max_logprob_abs_err"] >= 3e-3) > 0, r
    assert r["prompts_explained_by_router_flips"] < r["prompts_failing"], r


# The family's scheduling scenario (its plain run against transformers, then MTP drafts accepted with async
# scheduling, preemption, prefix hits and aborts against it), run on the kernels: about 75 s under the interpreter
# (the whole file: 280 s, over the suite's budget; test_matches_transformers's cases are the check above's ground).
FAMILY_TESTS = ["tests/model/test_qwen3_5_moe.py::test_features_compose_with_moe[mtp-True-False]"]


@pytest.mark.slow  # about 100 s on one worker: the suite's budget (scripts/test.sh -m slow)
def test_the_familys_tests_pass_on_the_moe_kernels() -> None:
    """The Qwen3.5-MoE tests above with ``TRITON_INTERPRET=1``: their MoE layers run the fused kernels (decode and
    verify steps with the stacked shared expert) instead of the reference (``tests/conftest.py`` patches the
    interpreter in that process)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAMILY_TESTS], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and f"{len(FAMILY_TESTS)} passed" in proc.stdout, proc.stdout[-3000:]


# Nemotron 3's MoE blocks (sigmoid router, ungated squared-ReLU experts: the kernels' ``relu2`` variant) on the
# kernels against transformers: the latent MoE (which also checks that the kernels ran), FP8 experts with their
# channel scales in the kernels, and ModelOpt FP8 experts (static activation scales: the experts' maxima) (about
# 30 s under the interpreter).
NEMOTRON_TESTS = ["tests/model/test_nemotron_h.py::test_moe_with_latent_projections_matches_transformers",
                  "tests/model/test_fp8_mamba2.py::test_greedy_matches_the_fp8_reference[nemotron_h]",
                  "tests/model/test_fp8_mamba2.py::test_modelopt_fp8_experts_match_the_static_fp8_reference"]
# Slow (about 80 s): the four-block MoE pattern, the sabotaged routing weights (which must still be caught), block-FP8
# experts, the scheduling scenario with emulated CUDA graphs (decode batches padded to the graphs' sizes), and the
# ModelOpt FP8 experts' wrong static scales (which must still be caught).
NEMOTRON_SLOW_TESTS = ["tests/model/test_nemotron_h.py::test_matches_transformers[moe]",
                       "tests/model/test_nemotron_h.py::test_routing_weights_from_the_biased_scores_are_caught",
                       "tests/model/test_fp8_mamba2.py::test_greedy_matches_the_fp8_reference[nemotron_h_block]",
                       "tests/model/test_nemotron_h.py::test_features_compose[graphs]",
                       "tests/model/test_fp8_mamba2.py::test_modelopt_fp8_experts_with_the_wrong_static_scale_are_caught"]


def _run_on_the_kernels(tests: list[str]) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and f"{len(tests)} passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow  # about 45 s: Nemotron-H's MoE tests under the interpreter (the suite's budget)
def test_nemotron_h_moe_on_the_kernels_matches_transformers() -> None:
    _run_on_the_kernels(NEMOTRON_TESTS)


@pytest.mark.slow  # about 80 s on one worker
def test_nemotron_h_scenario_with_emulated_graphs_on_the_kernels() -> None:
    _run_on_the_kernels(NEMOTRON_SLOW_TESTS)


if __name__ == "__main__" and "--run" in sys.argv:
    print("RESULTS " + json.dumps(run_checks()))
