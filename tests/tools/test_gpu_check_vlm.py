"""``gpu_check.py``'s 2B-shape VLM section (``--vlm-2b``) on the CPU with the tiny VLM in float32: the same prompts,
images and comparison the H200 runs in bf16, here where every position must agree; sabotaged references (other
images, other image sizes) must fail; the command line writes the JSON the H200 run will."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import gpu_check

from hyserve.testing import write_tiny_vlm_checkpoint

LLM_KWARGS = {"max_model_len": 2048}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), seed=3)


@pytest.fixture(scope="module")
def record(vlm: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return gpu_check.vlm_generate(vlm, "cpu", "float32", gpu_check.vlm_2b_batches(), 8, LLM_KWARGS)


def test_float32_agrees_on_every_position_and_the_ids_match(record: dict[str, Any]) -> None:
    res = gpu_check.vlm_reference(record, gpu_check.FP32_RULE, control=True)
    assert res["pass"], res
    assert res["num_cases"] == 4 and res["max_images_per_prompt"] == 2 and res["prompt_ids_match"]
    assert res["tokens_checked"] == res["tokens_scored"] == res["tokens"] == 4 * 8
    assert res["tokens_mismatched"] == 0 and res["max_logprob_abs_err"] < 1e-3
    cases = res["cases"]
    assert [len(c["images"]) for c in cases] == [1, 2, 2, 1] and all(c["image_tokens"] > 0 for c in cases)
    assert cases[2]["num_cached_tokens"] > 0  # the third prompt resumes from the first's prefix
    assert res["control_other_images"]["rule_would_pass"] is False  # the images matter to the comparison
    assert res["control_other_images"]["images_seen"] is True


def test_a_control_given_the_same_images_fails_the_check(record: dict[str, Any]) -> None:
    """Sabotage: a control that shows the reference the same images cannot tell them apart, so the check fails
    although every token agrees (a tower that barely moves the logits looks the same)."""
    res = gpu_check.vlm_reference(record, gpu_check.FP32_RULE, control=True, control_image=lambda w, h, s: (w, h, s))
    c = res["control_other_images"]
    assert res["tokens_mismatched"] == 0 and c["rule_would_pass"] and not c["images_seen"]
    assert not res["pass"]


def test_images_seen_by_the_mean_error_where_the_rule_passes(record: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on random weights: the control may pass the rule (few clear positions); then the images count as seen
    only where the control's mean logprob error is IMAGES_SEEN_RATIO times the real one's."""
    loose = gpu_check.ClearMarginRule(margin=1e9, logprob_tol=1e9, mismatches_per=None)  # nothing checked, all pass
    res = gpu_check.vlm_reference(record, loose, control=True)
    c = res["control_other_images"]
    assert c["rule_would_pass"] and c["mean_logprob_abs_err"] > 10 * res["mean_logprob_abs_err"]
    assert c["images_seen"]
    monkeypatch.setattr(gpu_check, "IMAGES_SEEN_RATIO", 1e12)
    assert not gpu_check.vlm_reference(record, loose, control=True)["control_other_images"]["images_seen"]


def test_a_reference_given_other_images_fails(record: dict[str, Any]) -> None:
    bad = gpu_check.vlm_reference(record, gpu_check.FP32_RULE, reference_image=lambda w, h, s: (w, h, s + 7))
    assert bad["prompt_ids_match"]  # same sizes: same ids
    assert not bad["pass"] and bad["max_logprob_abs_err"] > gpu_check.FP32_RULE.logprob_tol


def test_a_reference_given_other_image_sizes_fails_on_the_ids(record: dict[str, Any]) -> None:
    bad = gpu_check.vlm_reference(record, gpu_check.FP32_RULE, reference_image=lambda w, h, s: (w, h // 2, s))
    assert not bad["pass"] and not bad["prompt_ids_match"]


def test_clear_margin_rule_is_the_2b_text_checks() -> None:
    rule = gpu_check.BF16_RULE
    assert (rule.margin, rule.logprob_tol, rule.mismatches_per) == (0.25, 0.3, 50)
    r = {"tokens_checked": 100, "tokens_mismatched": 2, "max_logprob_abs_err": 0.1}
    assert rule.passes(r) and not rule.passes(dict(r, tokens_mismatched=3))
    assert not rule.passes(dict(r, max_logprob_abs_err=0.3))
    assert gpu_check.FP32_RULE.passes(dict(r, tokens_mismatched=0, max_logprob_abs_err=1e-4))
    assert not gpu_check.FP32_RULE.passes(dict(r, tokens_mismatched=1, max_logprob_abs_err=1e-4))
    # Scoring stops at the first clear divergence; a near tie (margin below the rule's) is not checked.
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.1, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    lps = [float(torch.log_softmax(logits[i].double(), -1)[t]) for i, t in enumerate([1, 1, 1, 2])]
    s = gpu_check.score_positions(logits, [1, 1, 1, 2], lps, 0.25)
    assert (s["tokens_scored"], s["tokens_checked"], s["tokens_mismatched"]) == (3, 2, 1)


def test_the_command_line_writes_the_vlm_json(vlm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "VLM_2B_MAX_TOKENS", 4)
    monkeypatch.setattr(gpu_check, "VLM_2B_LLM_KWARGS", LLM_KWARGS)
    monkeypatch.setattr(gpu_check, "OUT_DIR", gpu_check.OUT_DIR)
    monkeypatch.setattr(gpu_check, "OUT_NAME", gpu_check.OUT_NAME)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--vlm-2b", vlm, "--vlm-2b-only", "--device", "cpu",
                                      "--vlm-dtype", "float32", "--out", str(tmp_path)])
    assert gpu_check.main() == 0
    res = json.loads((tmp_path / "gpu_check_vlm_2b.json").read_text())
    assert res["all_correctness_pass"] is True and res["device"] == "cpu"
    r = res["vlm_2b_vs_fp32_reference"]
    assert r["pass"] and r["dtype"] == "float32" and r["rule"] == gpu_check.FP32_RULE._asdict()
    assert r["tokens_checked"] == r["tokens"] == 4 * 4 and "control_other_images" in r


def test_the_check_on_a_write_vision_real_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``vlm_check`` on what ``peer_bench.py write --vision real`` gives (text shape tiny, tower shrunk): Qwen3.5's
    processor files and pixel bounds, the tokenizer's vision tokens at config.json's ids. The 2B run's images give
    220 (640x360) and 100 (320x320) placeholders, and the third prompt resumes from the first's cached prefix."""
    import peer_bench as pb

    monkeypatch.setitem(pb.VISIONS, "real", dict(pb.VISIONS["real"], depth=1, hidden_size=32, intermediate_size=64,
                                                 num_heads=2))
    out = str(tmp_path / "real")
    pb.write("tiny", out, "cpu", vision="real")
    res = gpu_check.vlm_check(out, "cpu", "float32", llm_kwargs=LLM_KWARGS, max_tokens=8)
    assert res["pass"], res
    assert res["tokens_checked"] == res["tokens"] == 4 * 8 and res["prompt_ids_match"]
    assert [c["image_tokens"] for c in res["cases"]] == [220, 320, 320, 100]
    assert res["cases"][2]["num_cached_tokens"] > 0
