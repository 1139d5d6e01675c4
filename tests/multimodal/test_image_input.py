"""Image input end to end on the CPU: hyserve's greedy outputs against transformers' Qwen3_5ForConditionalGeneration
(float32, full uncached forwards with ``pixel_values`` / ``image_grid_thw``) on the tiny VLM checkpoint.

The reference's inputs are built independently of the code under test: the prompt's ids by the ``tokenizers``
library, each placeholder widened by the grid transformers' own image processor gives, its pixels from that
processor. The engine must return those same expanded ids as ``prompt_token_ids``.

Cases: one image; several images of different sizes; an image in an earlier turn (a prefix-cache hit resumes after
it); chunked prefill cutting inside the images' spans; staggered arrivals and an abort; equal text with different
images; a step's new images through the tower in one call. Sabotaged variants (the decode delta dropped; the
encoder rows of a cut chunk taken from the image's start; one call's rows handed out in the wrong order) are caught.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hyserve import LLM, SamplingParams
from hyserve.multimodal.inputs import MultimodalPrompt
from hyserve.testing import (
    IM_END,
    IM_START,
    reference_vlm_greedy,
    reference_vlm_inputs,
    reference_vlm_logits,
    reference_vlm_model,
    write_tiny_vlm_checkpoint,
)
from hyserve.testing.images import tiny_image as image
from hyserve.testing.tokenizer import user_turn
from hyserve.worker.mm_inputs import MMInputs
from hyserve.worker.model_runner import ModelRunner

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    path = write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), seed=3)
    return path, reference_vlm_model(path)


def reference_inputs(path: str, text: str, images: list[Image.Image]
                     ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """Expanded ids, pixel values and grids, from tokenizers and transformers' image processor alone."""
    return reference_vlm_inputs(path, text, images)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def make_llm(path: str, **kw: object) -> LLM:
    args: dict[str, object] = dict(device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=8,
                                   num_kv_blocks=256, num_state_slots=8)
    args.update(kw)
    return LLM(model=path, **args)  # type: ignore[arg-type]


# float32 on both sides: transformers' own float32 and float64 forwards differ by ~1e-3 on a logit of these models,
# so a chosen token's logprob within 3e-3 is agreement; a wrong position or embedding moves it by far more.
LOGPROB_TOL = 3e-3


def assert_matches(vlm: tuple[str, object], text: str, imgs: list[Image.Image], out: object) -> None:
    """``out``'s prompt ids, greedy tokens and their logprobs equal the reference's."""
    path, ref = vlm
    ids, pixels, grid = reference_inputs(path, text, imgs)
    got = out.outputs[0]  # type: ignore[attr-defined]
    assert out.prompt_token_ids == ids  # type: ignore[attr-defined]
    want = reference_vlm_greedy(ref, ids, pixels, grid, MAX_TOKENS)  # type: ignore[arg-type]
    assert got.token_ids == want, text
    logits = reference_vlm_logits(ref, ids + want, pixels, grid)  # type: ignore[arg-type]
    ref_lp = torch.log_softmax(logits[len(ids) - 1 : -1].double(), dim=-1)
    for j, tok in enumerate(want):
        assert abs(got.logprobs[j][tok].logprob - float(ref_lp[j, tok])) < LOGPROB_TOL, (text, j)


def check(vlm: tuple[str, object], llm: LLM, cases: list[tuple[str, list[Image.Image]]]) -> list[object]:
    """Run ``cases`` as one batch; each output matches the reference (``assert_matches``)."""
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text for text, imgs in cases]
    outs = llm.generate(prompts, greedy())
    for (text, imgs), out in zip(cases, outs):
        assert_matches(vlm, text, imgs, out)
    return outs


def test_prepared_inputs_give_the_same_outputs(vlm: tuple[str, object]) -> None:
    """``prepare_images`` (what the server runs off the engine's thread) then ``multi_modal_inputs``: the same
    request as ``multi_modal_data``."""
    llm = make_llm(vlm[0])
    engine = llm.llm_engine
    text, imgs = user_turn(f"Two: {IMAGE} and {IMAGE}?"), [image(40, 32, 5), image(24, 40, 6)]
    ids, inputs = engine.prepare_images(engine.encode_prompt(text)[1], imgs)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_inputs": inputs}], greedy())[0]
    assert_matches(vlm, text, imgs, out)


def test_one_and_several_images_match_transformers(vlm: tuple[str, object]) -> None:
    llm = make_llm(vlm[0])
    check(vlm, llm, [
        (user_turn(f"{IMAGE}What is shown?"), [image(40, 32, 1)]),
        (user_turn(f"Compare {IMAGE} with {IMAGE} and {IMAGE}."), [image(48, 48, 2), image(16, 40, 3),
                                                                  image(32, 24, 4)]),
        (user_turn("No image here, only text."), []),
    ])


def test_equal_text_with_different_images_differs_and_each_matches(vlm: tuple[str, object]) -> None:
    """Prefix caching on: the second request's text equals the first's, its image does not; it must not reuse the
    first's KV or state past the image (it would then answer as for the first image)."""
    llm = make_llm(vlm[0], enable_prefix_caching=True)
    text = user_turn(f"Look: {IMAGE} and answer in a word, please, the question about the picture.")
    a = check(vlm, llm, [(text, [image(48, 40, 5)])])[0]
    b = check(vlm, llm, [(text, [image(48, 40, 6)])])[0]
    assert a.outputs[0].token_ids != b.outputs[0].token_ids  # type: ignore[attr-defined]
    c = check(vlm, llm, [(text, [image(48, 40, 5)])])[0]  # the first image again: a hit past it
    assert (c.num_cached_tokens or 0) >= 32  # type: ignore[attr-defined]


SYSTEM = f"{IM_START}system\nYou operate a computer. Each turn shows the latest screens; give one action.{IM_END}\n"


def episode_prompt(turn: int, label: str) -> str:
    """Turn ``turn`` of an agent episode: the system text, every step so far with its reply, the screenshot
    placeholders of the last two steps only (older ones replaced by text)."""
    text = SYSTEM
    for j in range(turn + 1):
        shown = IMAGE if j >= turn - 1 else "[an earlier screen]"
        text += user_turn(f"{label} {j}: {shown} what next?")
        if j < turn:
            text += f"I click {label} {j}.{IM_END}\n"
    return text


def test_multi_turn_sliding_screenshots_with_chunks_cutting_the_spans(vlm: tuple[str, object]) -> None:
    """The seed's agent episodes: each turn sends the conversation so far with the last two turns' screenshots (older
    ones replaced by text). Chunked prefill of 16 tokens cuts inside every image's span; prefix caching resumes
    each turn after what the previous turn's prompt shares with it; a screenshot still in the window is encoded
    once (the encoder cache)."""
    llm = make_llm(vlm[0], enable_prefix_caching=True, max_num_batched_tokens=16, recurrent_snapshot_interval=16,
                   num_snapshot_slots=16)
    shots = [image(48, 40, 10 + i) for i in range(4)]
    runner = _runner(llm)
    for turn in range(4):
        window = shots[max(0, turn - 1) : turn + 1]
        out = check(vlm, llm, [(episode_prompt(turn, "Step"), window)])[0]
        if turn:
            assert (out.num_cached_tokens or 0) >= 16  # type: ignore[attr-defined]
    assert runner.mm.num_images_encoded == 4  # each screenshot once, though each is in two turns' prompts


def test_staggered_arrivals_and_an_abort_with_images(vlm: tuple[str, object]) -> None:
    path = vlm[0]
    llm = make_llm(path, max_num_batched_tokens=24)
    engine = llm.llm_engine
    cases = {f"r{i}": (user_turn(f"Picture {i}: {IMAGE} describe it briefly."), [image(40, 40, 20 + i)])
             for i in range(4)}
    done: dict[str, object] = {}
    pending = list(cases)
    engine.add_request(pending.pop(0), {"prompt": cases["r0"][0], "multi_modal_data": {"image": cases["r0"][1]}},
                       greedy())
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and steps % 2 == 1:
            rid = pending.pop(0)
            engine.add_request(rid, {"prompt": cases[rid][0], "multi_modal_data": {"image": cases[rid][1]}},
                               greedy())
            if rid == "r2":
                engine.abort_request("r1")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    assert "r1" not in done and not engine.has_unfinished_requests()
    for rid in ("r0", "r2", "r3"):
        assert_matches(vlm, *cases[rid], done[rid])


def _runner(llm: LLM) -> ModelRunner:
    return llm.llm_engine.executor.worker.runner  # type: ignore[attr-defined,no-any-return]


# ------------------------------------------------------------------------------------------------ sabotage


def test_dropping_the_decode_delta_is_caught(vlm: tuple[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode positions without rope_delta (index instead of index + delta): the check above must fail."""
    monkeypatch.setattr(MultimodalPrompt, "position_shift", lambda self, start: 0)
    with pytest.raises(AssertionError):
        check(vlm, make_llm(vlm[0]), [(user_turn(f"{IMAGE}{IMAGE}What is shown?"), [image(48, 48, 30),
                                                                                       image(48, 48, 31)])])


def test_misaligned_encoder_rows_are_caught(vlm: tuple[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk cutting an image's span that takes the image's first rows instead of its own part's."""
    monkeypatch.setattr(MMInputs, "span_rows", lambda self, im, a, b: self.image_embeddings(im)[: b - a])
    with pytest.raises(AssertionError):
        check(vlm, make_llm(vlm[0], max_num_batched_tokens=16),
              [(user_turn(f"Here: {IMAGE} what is it?"), [image(48, 48, 40)])])


# ------------------------------------------------------------------------------------------------ errors


def test_bad_image_requests_are_refused(vlm: tuple[str, object], tmp_path: Path) -> None:
    path = vlm[0]
    llm = make_llm(path, limit_mm_per_prompt={"image": 1})
    engine = llm.llm_engine
    two = {"prompt": user_turn(f"{IMAGE}{IMAGE}"), "multi_modal_data": {"image": [image(16, 16, 1)] * 2}}
    with pytest.raises(ValueError, match=r"2 images; at most 1 per prompt .*--limit-mm-per-prompt"):
        engine.add_request("a", two, greedy())
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        make_llm(path).llm_engine.add_request(
            "b", {"prompt": user_turn(IMAGE), "multi_modal_data": {"image": [image(16, 16, 1)] * 2}}, greedy())
    with pytest.raises(ValueError, match="modality 'video' is not served"):
        engine.add_request("c", {"prompt": "x", "multi_modal_data": {"video": []}}, greedy())
    with pytest.raises(ValueError, match="not an image"):
        engine.add_request("d", {"prompt": user_turn(IMAGE), "multi_modal_data": {"image": b"not a png"}}, greedy())
    with pytest.raises(ValueError, match=r"holds 1 image placeholder tokens \(id \d+\) but no images"):
        engine.add_request("g", user_turn(f"spelled out: {IMAGE}"), greedy())
    ids, inputs = engine.prepare_images(engine.encode_prompt(user_turn(f"Prepared {IMAGE}."))[1], [image(24, 24, 2)])
    with pytest.raises(ValueError, match="multi_modal_inputs do not match prompt_token_ids"):
        engine.add_request("h", {"prompt_token_ids": ids[1:], "multi_modal_inputs": inputs}, greedy())
    with pytest.raises(ValueError, match="multi_modal_inputs must come from prepare_images"):
        engine.add_request("i", {"prompt_token_ids": ids, "multi_modal_inputs": {"image": 1}}, greedy())
    off = make_llm(path, limit_mm_per_prompt={"image": 0})
    assert _runner(off).model.visual is None  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="image input is off"):
        off.llm_engine.add_request("e", {"prompt": user_turn(IMAGE), "multi_modal_data": {"image": image(16, 16, 1)}},
                                   greedy())
    text_only = str(tmp_path / "text")
    from hyserve.testing import write_tiny_checkpoint

    write_tiny_checkpoint(text_only)
    with pytest.raises(ValueError, match="no vision tower"):
        make_llm(text_only).llm_engine.add_request(
            "f", {"prompt": "hi", "multi_modal_data": {"image": image(16, 16, 1)}}, greedy())


@pytest.fixture(scope="module")
def vlm_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    path = write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm_mtp"), seed=3, with_mtp=True)
    return path, reference_vlm_model(path)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_sliding_screenshots_with_mtp_prefix_caching_chunks_and_async(vlm_mtp: tuple[str, object],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      graphs: bool) -> None:
    """The seed's configuration: MTP k = 2, prefix caching, 16-token chunks cutting every image span, async
    scheduling, over the sliding two-screenshot episodes, two conversations interleaved; with CUDA graphs emulated
    too (decode, verify and drafting steps replay graphs; steps reaching an image run eagerly). Verified outputs
    equal transformers' greedy tokens; the MTP passes over image positions take the image rows, one token shifted."""
    from hyserve.worker import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    llm = make_llm(vlm_mtp[0], enable_prefix_caching=True, max_num_batched_tokens=16, recurrent_snapshot_interval=16,
                   num_snapshot_slots=32, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                   async_scheduling=True)
    runner = _runner(llm)
    seen: list[object] = []
    real = MMInputs.image_inputs

    def spy(self: MMInputs, positions, mm_rows, lookahead=0, embed=True):  # type: ignore[no-untyped-def]
        out = real(self, positions, mm_rows, lookahead, embed)
        if lookahead == 1:  # an MTP pass
            seen.append(out[1])
        return out
    MMInputs.image_inputs = spy  # type: ignore[method-assign]
    try:
        shots = {c: [image(48, 40, 50 + 10 * c + i) for i in range(3)] for c in range(2)}
        for turn in range(3):
            cases = []
            for c in range(2):
                cases.append((episode_prompt(turn, f"Task {c}, step"), shots[c][max(0, turn - 1) : turn + 1]))
            outs = check(vlm_mtp, llm, cases)
            if turn:
                assert all((o.num_cached_tokens or 0) >= 16 for o in outs)  # type: ignore[attr-defined]
    finally:
        MMInputs.image_inputs = real  # type: ignore[method-assign]
    assert any(s is not None for s in seen)  # MTP passes consumed image rows
    assert runner.mm.num_images_encoded == 6
    assert (runner.graphs is not None) == graphs


def test_an_evicted_image_is_encoded_again_and_outputs_stay_right(vlm: tuple[str, object]) -> None:
    """An encoder cache of one image's rows and no host tier: two alternating screenshots are encoded again each
    time, and the outputs are unchanged."""
    llm = make_llm(vlm[0], max_num_batched_tokens=16, enable_prefix_caching=False)
    runner = _runner(llm)
    runner.mm.encoder_cache_tokens = 1
    runner.mm.encoder_host_cache_bytes = 0
    a, b = image(48, 40, 70), image(48, 40, 71)
    for imgs in ([a], [b], [a]):
        check(vlm, llm, [(user_turn(f"Screen {IMAGE} now?"), imgs)])
    assert runner.mm.num_images_encoded == 3 and len(runner.mm.encoder_cache) == 1


def _alternate_screens(vlm: tuple[str, object], host_bytes: int) -> ModelRunner:
    """Three screenshots a, b, c, then a, b again, then c with a, one 16-token chunk at a time (the spans cut): an
    encoder cache of one image's rows on the device and ``host_bytes`` of host tier; every output checked."""
    llm = make_llm(vlm[0], max_num_batched_tokens=16, enable_prefix_caching=False)
    runner = _runner(llm)
    runner.mm.encoder_cache_tokens = 1
    runner.mm.encoder_host_cache_bytes = host_bytes
    a, b, c = image(48, 40, 72), image(40, 48, 73), image(48, 48, 74)
    for imgs in ([a], [b], [c], [a], [b], [c, a]):
        check(vlm, llm, [(user_turn(f"Screens {IMAGE * len(imgs)} now?"), imgs)])
    return runner


def test_images_that_left_the_device_come_back_from_the_host_tier(vlm: tuple[str, object]) -> None:
    """With a host tier, what the one-image device cache evicts is brought back from the host, not encoded again:
    three images encoded in six prompts, outputs unchanged; a tier too small for one image keeps none."""
    runner = _alternate_screens(vlm, host_bytes=1 << 20)
    stats = runner.mm.encoder_cache_stats()
    assert stats["images_encoded"] == 3, stats
    assert stats["images_from_host"] == 4, stats  # a, b, then c and a
    assert stats["device_entries"] == 1 and stats["host_entries"] == 2, stats
    assert runner.mm.host_cache_held == sum(t.numel() * t.element_size() for t in runner.mm.host_cache.values())
    small = _alternate_screens(vlm, host_bytes=1)
    assert small.mm.encoder_cache_stats()["images_from_host"] == 0
    assert small.mm.num_images_encoded == 7 and not small.mm.host_cache  # each prompt's images encoded again


def _together(vlm: tuple[str, object], cap: int | None) -> ModelRunner:
    """Three requests in one step with four screenshots among them (one shown by two requests), the tower's cap per
    call ``cap`` (None: the checkpoint's own, its largest image: 144 patches); every output checked."""
    llm = make_llm(vlm[0])
    runner = _runner(llm)
    if cap is not None:
        runner.mm.max_encode_patches = cap
    a, b, c, d = image(40, 32, 80), image(24, 40, 81), image(48, 40, 82), image(16, 40, 83)  # 80, 60, 120, 40
    check(vlm, llm, [(user_turn(f"First {IMAGE} then {IMAGE}?"), [a, b]), (user_turn(f"Now {IMAGE}?"), [c]),
                     (user_turn(f"Here {IMAGE} and {IMAGE}."), [d, a])])
    return runner


def test_a_steps_new_images_go_through_the_tower_together(vlm: tuple[str, object]) -> None:
    """The step's new images in one tower call where the cap allows (each image once, the repeated one too); at the
    checkpoint's cap, in order: 80 + 60 patches, then 120, then 40 (three calls). The outputs match transformers
    either way."""
    stats = _together(vlm, cap=1000).mm.encoder_cache_stats()
    assert stats["images_encoded"] == 4 and stats["tower_calls"] == 1, stats
    runner = _together(vlm, cap=None)
    assert runner.mm.max_encode_patches == 144
    stats = runner.mm.encoder_cache_stats()
    assert stats["images_encoded"] == 4 and stats["tower_calls"] == 3, stats


def test_a_tower_call_split_in_the_wrong_order_is_caught(vlm: tuple[str, object],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: one call's rows handed to its images the other way round (two screenshots of one size)."""
    import hyserve.worker.mm_inputs as mm_inputs

    real = mm_inputs.split_encoded
    monkeypatch.setattr(mm_inputs, "split_encoded", lambda rows, images: real(rows, images)[::-1])
    llm = make_llm(vlm[0])
    with pytest.raises(AssertionError):
        check(vlm, llm, [(user_turn(f"Two {IMAGE} and {IMAGE}?"), [image(24, 40, 84), image(24, 40, 85)])])
    assert _runner(llm).mm.num_tower_calls == 1


def test_a_host_tier_that_returns_another_images_rows_is_caught(vlm: tuple[str, object],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the host tier files each evicted image's rows under the next image's key; the outputs' check
    must fail."""
    real = MMInputs._keep_on_host
    held: list[torch.Tensor] = []

    def shifted(self: MMInputs, key: str, rows: torch.Tensor) -> None:
        held.append(rows)
        real(self, key, held[-2] if len(held) > 1 and held[-2].shape == rows.shape else rows.flip(0))

    monkeypatch.setattr(MMInputs, "_keep_on_host", shifted)
    with pytest.raises(AssertionError):
        _alternate_screens(vlm, host_bytes=1 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the pinned copies and the stream order)")
def test_the_host_tier_round_trips_on_cuda() -> None:
    """On CUDA: rows evicted to pinned host memory while the stream is busy, their device memory reused at once,
    then brought back: equal to what was encoded."""
    class Tower(torch.nn.Module):
        def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            return pixels[:, :8] * 2 + 1

    from hyserve.multimodal.inputs import ImageInput
    from hyserve.multimodal.spans import ImageSpan

    dev = torch.device("cuda")
    mm = MMInputs(Tower(), dev, torch.float32, max_num_batched_tokens=1)
    mm.encoder_cache_tokens = 1
    ims = [ImageInput(ImageSpan(0, 64, f"h{i}"), np.random.default_rng(i).random((64, 16), dtype=np.float32),
                      (1, 8, 8)) for i in range(4)]
    want = [torch.from_numpy(im.pixel_values[:, :8] * 2 + 1) for im in ims]
    big = torch.randn(4096, 4096, device=dev)
    for im in ims:
        big = big @ big  # keeps the stream busy while the evictions' copies queue behind it
        mm.image_embeddings(im)
        torch.full((64, 8), -1.0, device=dev)  # reuses the evicted rows' memory at once
    for im, w in zip(ims, want):
        assert torch.equal(mm.image_embeddings(im).cpu(), w)
    assert mm.num_images_encoded == 4 and mm.num_images_from_host == 4


@pytest.mark.parametrize("layout", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)],
                         ids=["pp2", "tp2"])
def test_images_across_pipeline_stages_and_tensor_ranks(vlm_mtp: tuple[str, object], layout: dict,  # type: ignore[type-arg]
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes (what the scheduler sends them pickled): with two pipeline stages the first holds the
    vision tower and embeds the images, both read the three-axis positions; with two tensor-parallel ranks each
    holds the whole tower. MTP k = 2, prefix caching and 16-token chunks on; outputs equal transformers'. Every
    array of a step crosses through shared memory here (the threshold lowered from a megabyte to a byte: the tiny
    images' pixels take the path a screenshot's do), read by both workers, and no segment outlives the steps."""
    from hyserve.executor import multiproc

    monkeypatch.setattr(multiproc, "SHARED_ARRAY_MIN_BYTES", 1)
    shared: list[str] = []
    real_reduce = multiproc._StepPickler.reducer_override

    def recorded(self: multiproc._StepPickler, obj: object) -> object:
        got = real_reduce(self, obj)
        if got is not NotImplemented:
            shared.append(self.segments.shms[-1][0].name)
        return got

    monkeypatch.setattr(multiproc._StepPickler, "reducer_override", recorded)
    llm = make_llm(vlm_mtp[0], enable_prefix_caching=True, max_num_batched_tokens=16, recurrent_snapshot_interval=16,
                   num_snapshot_slots=32, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                   distributed_executor_backend="mp", **layout)
    try:
        shots = [image(48, 40, 80 + i) for i in range(3)]
        for turn in range(3):
            check(vlm_mtp, llm, [(episode_prompt(turn, "Step"), shots[max(0, turn - 1) : turn + 1]),
                                 (user_turn(f"Other {IMAGE} screen."), [image(40, 32, 90 + turn)])])
    finally:
        llm.llm_engine.shutdown()
    assert len(shared) >= 6, shared  # every image's pixels at least, each turn's new ones
    assert not [name for name in shared if os.path.exists(f"/dev/shm/{name.lstrip('/')}")], "segments left behind"


def test_mtp_pass_takes_the_image_row_of_the_next_token(vlm_mtp: tuple[str, object],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """MTP position p consumes token p + 1: with an image's placeholders at [5, 9), a pass over positions [3, 7)
    (tokens 4-7) takes the image's rows 0, 1, 2 at its tokens 1, 2, 3; a pass over [7, 9) (tokens 8, 9) takes row 3
    at its token 0."""
    from hyserve.multimodal.inputs import ImageInput
    from hyserve.multimodal.spans import ImageSpan

    runner = _runner(make_llm(vlm_mtp[0], speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    im = ImageInput(ImageSpan(5, 4, "h"), np.zeros((16, 1), dtype=np.float32), (1, 4, 4))
    mm = MultimodalPrompt((im,), np.tile(np.arange(20), (3, 1)), 0)
    rows = torch.arange(4.0).unsqueeze(1) + 100  # row r of the image is 100 + r
    monkeypatch.setattr(MMInputs, "image_embeddings", lambda self, image: rows)
    runner.mm.prompts["x"] = mm
    _, (index, embeds) = runner.mm.image_inputs(torch.zeros(6, dtype=torch.long), [(0, 3, 4, mm), (4, 7, 2, mm)],
                                              lookahead=1)
    assert index.tolist() == [1, 2, 3, 4] and embeds.flatten().tolist() == [100.0, 101.0, 102.0, 103.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (SDPA's fused kernels)")
def test_cuda_tower_attention_takes_a_fused_kernel_for_every_image(vlm: tuple[str, object]) -> None:
    """Two images of different sizes in one bf16 tower call on the card: each image's attention is one 4-D SDPA call
    (a 3-D one falls to SDPA's math path), and the rows equal those of each image alone."""
    from hyserve.model.vision import VisionModel

    cpu = _runner(make_llm(vlm[0])).model.visual  # type: ignore[attr-defined]
    tower = VisionModel(cpu.cfg).to("cuda", torch.bfloat16)
    tower.load_state_dict(cpu.state_dict())
    grids = [[1, 12, 10], [1, 4, 10]]
    pixels = [torch.randn(t * h * w, cpu.cfg.patch_dim, device="cuda", dtype=torch.bfloat16) for t, h, w in grids]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        both = tower(torch.cat(pixels), torch.tensor(grids))
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_attention_math" not in names, sorted(n for n in names if "attention" in n)
    alone = torch.cat([tower(p, torch.tensor([g])) for p, g in zip(pixels, grids, strict=True)])
    torch.testing.assert_close(both.float(), alone.float(), atol=2e-2, rtol=2e-2)


def test_the_memory_profile_encodes_the_largest_image(vlm: tuple[str, object]) -> None:
    """The CUDA memory profile runs the tower on the largest square image the processor makes (max_pixels 48 x 48,
    patches of 4, merged by 2: 12 x 12 patches) and counts the full encoder cache."""
    from hyserve.worker.mm_inputs import largest_image_inputs

    tower = _runner(make_llm(vlm[0])).model.visual  # type: ignore[attr-defined]
    pixels, grid = largest_image_inputs(vlm[0], tower.cfg)
    assert grid.tolist() == [[1, 12, 12]] and pixels.shape == (144, tower.cfg.patch_dim)
    assert tower(pixels, grid).shape == (36, tower.cfg.out_hidden_size)


@pytest.mark.parametrize("sabotage", [False, True])
def test_a_prompt_dropping_a_screenshot_resumes_before_it(vlm: tuple[str, object], monkeypatch: pytest.MonkeyPatch,
                                                          sabotage: bool) -> None:
    """The sliding window: turn 1 keeps turn 0's text and replaces its oldest screenshot by text. The recurrent
    state before that screenshot was kept (a snapshot point before each image), so turn 1 hits up to the block
    boundary before it; without those points (the interval is far away) it hits nothing."""
    import hyserve.cache.prefix_cache as pc

    if sabotage:
        monkeypatch.setattr(pc, "image_points", lambda req, block_size: [])
    # Snapshots every 2048 tokens: none inside these prompts.
    llm = make_llm(vlm[0], enable_prefix_caching=True, num_snapshot_slots=16)
    head = SYSTEM + user_turn("Step 0: the task is to open the settings and change the language.") + \
        f"{IM_START}user\nScreens: "
    first = head + f"{IMAGE} then {IMAGE}{IM_END}\n{IM_START}assistant\n"
    second = head + f"[an earlier screen] then {IMAGE} and {IMAGE}{IM_END}\n{IM_START}assistant\n"
    a, b, c = image(48, 40, 60), image(48, 40, 61), image(48, 40, 62)
    check(vlm, llm, [(first, [a, b])])
    out = check(vlm, llm, [(second, [b, c])])[0]
    before = len(reference_inputs(vlm[0], head, [])[0])  # tokens before the dropped screenshot
    if sabotage:
        assert (out.num_cached_tokens or 0) == 0  # type: ignore[attr-defined]
    else:
        assert (out.num_cached_tokens or 0) == (before // 16) * 16 > 0  # type: ignore[attr-defined]


def test_preempted_image_requests_recompute_right(vlm: tuple[str, object]) -> None:
    """A KV cache too small for the batch: requests with images are preempted and recomputed from their prompts
    (the worker keeps their images and positions); outputs equal transformers' and the pools end empty."""
    llm = make_llm(vlm[0], num_kv_blocks=20, max_num_batched_tokens=32, enable_prefix_caching=False)
    cases = [(user_turn(f"Case {i}: {IMAGE} and {IMAGE} describe."), [image(48, 40, 100 + i), image(40, 48, 110 + i)])
             for i in range(4)]
    check(vlm, llm, cases)
    assert llm.get_metrics()["hyserve:num_preemptions"] > 0
    llm.llm_engine.assert_no_leaks()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory)")
def test_pixels_prepared_for_an_in_process_cuda_worker_are_pinned(vlm: tuple[str, object]) -> None:
    """``build_multimodal_prompt(pinned=True)``: each image's pixels in pinned host memory, equal to the processor's;
    ``host_to_device`` takes them without a host copy of its own (the same memory), and they reach the device
    equal."""
    from hyserve.model.registry import load_model_config
    from hyserve.multimodal.inputs import build_multimodal_prompt
    from hyserve.utils import host_to_device

    path = vlm[0]
    mm_config = load_model_config(path).multimodal
    assert mm_config is not None
    ids = [mm_config.image_token_id, 7]
    img = image(48, 40, 80)
    _, plain = build_multimodal_prompt(ids, [img], path, mm_config)
    _, pinned = build_multimodal_prompt(ids, [img], path, mm_config, pinned=True)
    got = torch.from_numpy(pinned.images[0].pixel_values)
    assert got.is_pinned() and not torch.from_numpy(plain.images[0].pixel_values).is_pinned()
    assert torch.equal(got, torch.from_numpy(plain.images[0].pixel_values))
    assert got.pin_memory().data_ptr() == got.data_ptr()
    assert torch.equal(host_to_device(got, torch.device("cuda")).cpu(), got)
