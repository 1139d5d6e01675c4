"""The image half of the side-by-side peer script and of the GPU check, on the CPU: the screenshot agent trace
(``peer_bench.py measure --measures agent_images``) through hyserve on a tiny VLM, its sliding two-screenshot window,
``write --vision real`` (with a shrunken tower), and ``gpu_check.py``'s image section with ``device="cpu"``; so that a
broken script shows here and not on the H200."""

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
import peer_bench as pb

from hyserve.testing import vlm_special_token_ids, write_tiny_vlm_checkpoint

PAD = "<|image_pad|>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), seed=3)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _engine(model: str) -> pb.Engine:
    return pb.Engine("hyserve", model, "cpu", "float32", enable_prefix_caching=True, limit_mm_per_prompt={"image": 2},
                     disable_log_stats=False, max_model_len=2048)


def _pixels(img: Any) -> bytes:
    return bytes(img.tobytes())


def test_sliding_window_keeps_exactly_the_last_two_screenshots(vlm: str) -> None:
    """Turn t shows screenshots t and t + 1 (message 0 carries 0 and 1, message j the screenshot j + 1); the older
    ones are text; each turn's prompt extends the previous one's up to where its first screenshot was."""
    trace = pb.SCREENSHOT_TRACES["tiny"]
    conv = pb.ScreenshotConversation(trace, 0, [1, 2, 3], pb.text_vocab(vlm))
    builder = pb.PromptBuilder(vlm)
    ids = vlm_special_token_ids()
    outputs = [[5, 6, 7][: t + 1] for t in range(trace.turns)]
    prev: list[int] | None = None
    assert conv.num_screens == trace.turns + 1
    for turn in range(trace.turns):
        assert conv.visible(turn) == [turn, turn + 1]
        messages, pieces = conv.chat(turn, outputs)
        parts = [(j, p) for j, m in enumerate(messages) if m["role"] == "user" for p in m["content"]]
        images = [j for j, p in parts if p["type"] == "image"]
        assert len(images) == 2
        prompt = builder.ids(messages, pieces)
        assert prompt.count(ids[PAD]) == 2 and prompt.count(ids["<|vision_start|>"]) == 2
        for k in range(conv.num_screens):  # an older screenshot's stand-in text is there, a visible one's is not
            stand_in = conv.earlier[k]
            found = any(prompt[i : i + len(stand_in)] == stand_in for i in range(len(prompt)))
            assert found == (k < turn), (turn, k)
        if prev is not None:
            first_image = prev.index(ids["<|vision_start|>"])
            assert prompt[:first_image] == prev[:first_image]
        prev = prompt
    assert max(max(p) for p in [*conv.messages, *conv.earlier]) < 448  # random text stays below the special tokens


def test_agent_images_runs_end_to_end_on_a_tiny_vlm(vlm: str) -> None:
    """The tiny-scale trace through hyserve: every prompt holds its two screenshots' placeholders (expanded), each
    turn sends the conversation's last two screenshots, later turns hit the prefix cache, and the figures are sane."""
    eng = _engine(vlm)
    sent: list[list[dict[str, Any]]] = []
    got: list[list[Any]] = []
    real = eng.generate

    def spy(prompts: Any, max_tokens: Any) -> list[Any]:
        sent.append(prompts)
        got.append(real(prompts, max_tokens))
        return got[-1]

    eng.generate = spy  # type: ignore[method-assign]
    figs, notes = pb.measure_agent_images(eng, vlm, "tiny")
    eng.shutdown()
    trace = pb.SCREENSHOT_TRACES["tiny"]
    assert len(sent) == trace.turns and all(len(b) == trace.concurrency for b in sent)
    pad = vlm_special_token_ids()[PAD]
    per_image = None
    for turn, (batch, outs) in enumerate(zip(sent, got, strict=True)):
        for c, (prompt, out) in enumerate(zip(batch, outs, strict=True)):
            images = prompt["multi_modal_data"]["image"]
            want = [pb.screenshot(0, c, k, trace.screen) for k in (turn, turn + 1)]
            assert [_pixels(i) for i in images] == [_pixels(i) for i in want]
            assert images[0].size == trace.screen
            n = list(out.prompt_token_ids).count(pad)
            per_image = per_image or n // 2
            assert n == 2 * per_image > 0 and prompt["prompt_token_ids"].count(pad) == 2
    assert figs["agent_images_requests"] == trace.turns * trace.concurrency
    assert figs["agent_images_image_tokens_per_request"] == 2 * per_image
    assert figs["agent_images_wall_s"] > 0 and figs["agent_images_out_tok_s"] > 0
    assert 0 < figs["agent_images_cached_share"] < 1
    later = [figs[f"agent_images_cached_share_turn{t}"] for t in range(1, trace.turns)]
    assert max(later) > 0  # turns after the first resume from the cache
    assert 0 < figs["agent_images_ttft_p50_s"] <= figs["agent_images_ttft_p90_s"]
    assert figs["agent_images_ttft_mean_s"] > 0
    assert notes["ttft_source"] == ["RequestOutput.metrics.first_token_time"]
    assert notes["prompt_layout"] == "chat template" and notes["text_ids_below"] == 448
    # Served from cache: never more than the bound (past it, KV or state would be shared across different images)
    cached = figs["agent_images_cached_share"]
    assert 0 < cached <= figs["agent_images_cacheable_share"] < 1
    assert figs["agent_images_cached_of_cacheable"] == pytest.approx(cached / figs["agent_images_cacheable_share"])


def test_cache_bound_counts_common_prefixes_and_keys_each_image() -> None:
    """``CacheBound``: a request's cacheable tokens are its longest common prefix with an earlier turn's prompt and
    output or an earlier prompt of its own turn, at most its length less one; placeholder rows of different images
    never match, though their ids are equal."""
    pad = 9
    keys = pb.CacheBound.keys
    one, other = keys([1, 2, pad, pad, pad, 3], pad, [0]), keys([1, 2, pad, pad, pad, 3], pad, [1])
    assert one[:2] == [1, 2] and one[-1] == 3 and len(set(one[2:5])) == 3 and not set(one[2:5]) & set(other[2:5])
    assert keys([pad, pad, 4, pad], pad, [5, 6])[:2] == keys([pad, pad], pad, [5])
    with pytest.raises(ValueError, match="2 placeholder spans for 1 images"):
        keys([pad, 4, pad], pad, [0])
    b = pb.CacheBound()
    assert b.add(one) == 0  # nothing before it
    assert b.add(other) == 2  # same turn: the text before the image, not the other image's rows
    assert b.add(one) == 5  # the same prompt again: all but its last token
    b.end_turn([[*one, 7, 8], [*other, 7]])
    assert b.add([*one, 7, 8, 10, 11]) == 8  # the first request's prompt and output, then new text
    assert b.add([1, 2, 3]) == 2
    assert b.tokens == 0 + 2 + 5 + 8 + 2
    # Sabotage: with the placeholder ids as they come (images not keyed), the other image would count as cached.
    raw = pb.CacheBound()
    raw.add([1, 2, pad, pad, pad, 3])
    assert raw.add([1, 2, pad, pad, pad, 3]) == 5


def test_cache_bound_command_without_weights_matches_the_measured_trace(vlm: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``write --no-weights`` gives the files ``cache-bound`` needs, and ``cache-bound`` the same trace as a
    measure on that checkpoint with its weights (prompt tokens, image tokens) and the same bound."""
    monkeypatch.setitem(pb.VISIONS, "real", dict(pb.VISIONS["real"], depth=1, hidden_size=32, intermediate_size=64,
                                                 num_heads=2))
    bare, full = str(tmp_path / "bare"), str(tmp_path / "full")
    monkeypatch.setattr(sys, "argv", ["peer_bench.py", "write", "--shape", "tiny", "--vision", "real", "--device",
                                      "cpu", "--no-weights", "--out", bare])
    assert pb.main() == 0
    assert not [f for f in os.listdir(bare) if f.endswith(".safetensors")]
    out = tmp_path / "bound.json"
    monkeypatch.setattr(sys, "argv", ["peer_bench.py", "cache-bound", "--model", bare, "--agent-scale", "tiny",
                                      "--agent-concurrency", "2", "--out", str(out)])
    assert pb.main() == 0
    bound = json.loads(out.read_text())["figures"]
    pb.write("tiny", full, "cpu", vision="real")
    eng = _engine(full)
    figs, _ = pb.measure_agent_images(eng, full, "tiny", concurrency=2)
    eng.shutdown()
    for k in ("cacheable_share", "prompt_tokens_mean", "requests", "image_tokens_per_request"):
        assert bound[f"agent_images_{k}"] == pytest.approx(figs[f"agent_images_{k}"]), k
    assert 0 < figs["agent_images_cached_share"] <= bound["agent_images_cacheable_share"]


def test_agent_images_from_the_command_line_and_in_the_report(vlm: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure --measures agent_images --agent-concurrency 2`` writes the ``agent_images_c2_*`` figures and its
    notes; the report pairs the 8-conversation figures with a stand-in peer's."""
    out = tmp_path / "hyserve_images.json"
    monkeypatch.setattr(sys, "argv", ["peer_bench.py", "measure", "--engine", "hyserve", "--model", vlm, "--device",
                                      "cpu", "--dtype", "float32", "--out", str(out), "--measures", "agent_images",
                                      "--agent-scale", "tiny", "--agent-concurrency", "2", "--max-model-len", "2048"])
    assert pb.main() == 0
    res = json.loads(out.read_text())
    assert not res["errors"]
    figs = res["figures"]
    assert figs["agent_images_c2_requests"] == 2 * pb.SCREENSHOT_TRACES["tiny"].turns
    assert figs["agent_images_c2_wall_s"] > 0 and "agent_images_wall_s" not in figs
    assert res["notes"]["agent_images_c2"]["trace"]["conversations"] == 2
    ours = dict(res, figures={"agent_images_wall_s": 2.0, "agent_images_ttft_p90_s": 0.5,
                              "agent_images_cached_share": 0.6, "agent_images_image_tokens_per_request": 1760})
    peer = dict(res, engine="vllm", version="stand-in", notes={},
                figures={"agent_images_wall_s": 4.0, "agent_images_ttft_p90_s": 1.5, "agent_images_cached_share": 0.3,
                         "agent_images_image_tokens_per_request": 1760})
    (tmp_path / "a.json").write_text(json.dumps(ours))
    (tmp_path / "b.json").write_text(json.dumps(peer))
    pb.report([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(tmp_path / "rep"))
    merged = json.loads((tmp_path / "rep" / "peer.json").read_text())
    entries = {e["measure"]: e for e in merged["entries"]}
    assert entries["agent_images_image_tokens_per_request"]["ratio"] is None  # a check on the trace, not a speed
    assert merged["meta"]["notes"][f"{os.path.basename(vlm)}/hyserve/agent_images_c2"]["prompt_layout"] == \
        "chat template"
    assert entries["agent_images_wall_s"]["ratio"] == pytest.approx(2.0)
    assert entries["agent_images_ttft_p90_s"]["ratio"] == pytest.approx(3.0)
    assert entries["agent_images_cached_share"]["ratio"] == pytest.approx(2.0)


def test_write_vision_real_gives_a_tokenizer_and_processor_files_that_match(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``write --vision real`` with the tower shrunk (the sizes are checked below against transformers on the meta
    device): the vision token ids of config.json, tokenizer.json and transformers' AutoTokenizer agree, the processor
    files carry the tower's patch and merge sizes and Qwen3.5's pixel bounds, and hyserve serves the trace on it."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    monkeypatch.setitem(pb.VISIONS, "real", dict(pb.VISIONS["real"], depth=1, hidden_size=32, intermediate_size=64,
                                                 num_heads=2))
    out = str(tmp_path / "real")
    pb.write("tiny", out, "cpu", vision="real")
    cfg = json.loads(Path(out, "config.json").read_text())
    tok, auto = Tokenizer.from_file(os.path.join(out, "tokenizer.json")), AutoTokenizer.from_pretrained(out)
    for key, token in pb.VISION_TOKEN_KEYS.items():
        assert cfg[key] == tok.token_to_id(token) == auto.convert_tokens_to_ids(token) >= 498
        assert auto.encode(token, add_special_tokens=False) == [cfg[key]]
    pre = json.loads(Path(out, "preprocessor_config.json").read_text())
    vision = cfg["vision_config"]
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (
        vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]) == (16, 2, 2)
    assert (pre["size"]["shortest_edge"], pre["size"]["longest_edge"]) == pb.QWEN35_IMAGE_PIXELS
    assert json.loads(Path(out, "video_preprocessor_config.json").read_text())["merge_size"] == 2
    assert pb.special_token_ids(248320)[PAD] == 248056 and pb.special_token_ids(248320)["<|endoftext|>"] == 248044
    eng = _engine(out)
    figs, notes = pb.measure_agent_images(eng, out, "tiny", concurrency=1)
    eng.shutdown()
    # 64x48 is scaled up to Qwen's 256^2-pixel floor: 224x320, 14x20 patches, 70 placeholders each.
    assert figs["agent_images_image_tokens_per_request"] == 140
    assert notes["text_ids_below"] == 498


def test_the_real_tower_is_the_one_transformers_and_hyserve_build_alike() -> None:
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from hyserve.model.vision import VisionModel

    real = dict(pb.VISIONS["real"], out_hidden_size=2048)
    assert {k: real[k] for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                                 "spatial_merge_size", "temporal_patch_size", "num_position_embeddings")} == dict(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=2304)
    with torch.device("meta"):
        ref = Qwen3_5VisionModel(Qwen3_5VisionConfig(**real))
        ours = VisionModel.from_config_dict({"model_type": "qwen3_5_vision", **real})
    assert {k: v.shape for k, v in ref.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}


def test_gpu_check_image_section_passes_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``gpu_check.image_check`` with ``device="cpu"``: one and two images, the sliding episode resuming from the
    prefix cache, MTP drafting, 16-token chunks; token-exact against transformers. The reference's command-line
    entry gives the same verdict, and fails a record whose output was changed."""
    res = gpu_check.image_check(str(tmp_path), "cpu", isolate_reference=False)
    assert res["pass"], res
    assert res["num_token_exact"] == res["num_cases"] == 5 and res["max_images_per_prompt"] == 2
    assert len(res["resumed_cached_tokens"]) == 2 and min(res["resumed_cached_tokens"]) > 0
    assert res["mtp_drafts"] > 0
    cases = tmp_path / "image_cases.json"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--image-reference", str(cases)])
    capsys.readouterr()
    assert gpu_check.main() == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pass"] is True
    record = json.loads(cases.read_text())
    record["cases"][1]["output"][-1] = (record["cases"][1]["output"][-1] + 1) % 400
    cases.write_text(json.dumps(record))
    bad = gpu_check.image_reference(str(cases))
    assert not bad["pass"] and bad["num_token_exact"] == 4
