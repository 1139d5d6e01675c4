"""The multimodal processor cache (``--mm-processor-cache-gb``): processed images kept by content hash.

Unit: pixels equal transformers' image processor's on each image alone; a repeat is a hit and is not processed
again; least recently used entries go first, within the byte capacity; 0 keeps nothing; concurrent callers keep the
accounting whole. End to end on the tiny VLM: requests whose images repeat (a sliding window) and an image of the
same size as an earlier one with other content give transformers' greedy tokens, with each distinct image processed
once and the hits counted in the metrics; a cache keyed by size alone (a sabotage) is caught.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import hyserve.multimodal.processor_cache as pc
from hyserve import LLM, SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine_args import engine_args
from hyserve.multimodal.image import ImageProcessorSettings
from hyserve.multimodal.processor_cache import ProcessorCache
from hyserve.testing import (
    IM_END,
    IM_START,
    reference_vlm_greedy,
    reference_vlm_inputs,
    reference_vlm_model,
    write_tiny_vlm_checkpoint,
)
from hyserve.testing.images import tiny_image as image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    path = write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), seed=5)
    return path, reference_vlm_model(path)


def transformers_pixels(path: str, img: Image.Image) -> tuple[np.ndarray, tuple[int, ...]]:
    out = Qwen2VLImageProcessorPil.from_pretrained(path)(images=[img], return_tensors="pt")
    return out["pixel_values"].float().numpy(), tuple(out["image_grid_thw"][0].tolist())


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many images the cache sent to the pixel pipeline, one entry per call."""
    seen: list[int] = []
    real = pc.process_images

    def spy(images, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(len(images))
        return real(images, *args, **kwargs)

    monkeypatch.setattr(pc, "process_images", spy)
    return seen


def test_hits_return_the_processed_pixels_without_processing_again(vlm: tuple[str, object],
                                                                   calls: list[int]) -> None:
    path = vlm[0]
    cache = ProcessorCache(ImageProcessorSettings.from_checkpoint(path), pc.GIB)
    a, b = image(40, 24, 1), image(28, 28, 2)
    first = cache.process([a, b, a])  # a repeated inside one request: processed once
    assert calls == [1, 1] and len(cache) == 2 and (cache.queries, cache.hits) == (3, 0)
    assert first[0] is first[2]
    for img, item in zip((a, b), first[:2]):
        pixels, grid = transformers_pixels(path, img)
        assert item.grid_thw == grid and np.array_equal(item.pixel_values, pixels)
        assert item.token_count == math.prod(grid) // 4
    again = cache.process([b, image(40, 24, 1)])  # equal content, another PIL object: a hit
    assert calls == [1, 1] and (cache.queries, cache.hits) == (5, 2)
    assert again[0] is first[1] and again[1] is first[0]
    assert cache.num_bytes == sum(x.pixel_values.nbytes for x in first[:2])


def test_least_recently_used_goes_first_within_the_capacity(vlm: tuple[str, object], calls: list[int]) -> None:
    settings = ImageProcessorSettings.from_checkpoint(vlm[0])
    a, b, c = image(28, 28, 1), image(28, 28, 2), image(28, 28, 3)
    size = ProcessorCache(settings, pc.GIB).process([a])[0].pixel_values.nbytes
    calls.clear()
    cache = ProcessorCache(settings, 2 * size)
    cache.process([a])
    cache.process([b])
    cache.process([a])  # a is now the most recent
    cache.process([c])  # evicts b
    assert calls == [1, 1, 1] and cache.evictions == 1 and cache.num_bytes == 2 * size
    cache.process([a, c])
    assert calls == [1, 1, 1] and cache.hits == 3
    cache.process([b])
    assert calls == [1, 1, 1, 1]
    small = ProcessorCache(settings, size - 1)  # larger than the whole capacity: processed, not kept
    small.process([a])
    small.process([a])
    assert len(small) == 0 and small.num_bytes == 0 and small.hits == 0 and calls[-2:] == [1, 1]
    off = ProcessorCache(settings, 0)
    off.process([a, a])
    off.process([a])
    assert len(off) == 0 and (off.queries, off.hits) == (3, 0)
    with pytest.raises(ValueError, match=">= 0"):
        ProcessorCache(settings, -1)


def test_concurrent_callers_keep_the_accounting_whole(vlm: tuple[str, object]) -> None:
    settings = ImageProcessorSettings.from_checkpoint(vlm[0])
    imgs = [image(28, 20 + 4 * i, i) for i in range(6)]
    cache = ProcessorCache(settings, pc.GIB)
    results: list[list[pc.ProcessedImage]] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        out = cache.process([imgs[(k + j) % 6] for j in range(3)])
        with lock:
            results.append(out)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 6 and cache.queries == 36
    assert cache.num_bytes == sum(cache._entries[d].pixel_values.nbytes for d in cache._entries)
    for out in results:  # every caller got the pixels of the images it asked for
        for item in out:
            assert np.array_equal(item.pixel_values, cache._entries[item.digest].pixel_values)


def test_the_flag_and_its_validation() -> None:
    import argparse

    p = argparse.ArgumentParser()
    engine_args(p)
    assert p.parse_args([]).mm_processor_cache_gb == 4.0 == EngineConfig(model="x").mm_processor_cache_gb
    assert p.parse_args(["--mm-processor-cache-gb", "0"]).mm_processor_cache_gb == 0.0
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="--mm-processor-cache-gb"):
            EngineConfig(model="x", mm_processor_cache_gb=bad).validate()  # type: ignore[arg-type]


def expected(vlm: tuple[str, object], text: str, imgs: list[Image.Image]) -> list[int]:
    """transformers' greedy tokens, its inputs built from tokenizers and its image processor alone."""
    ids, pixels, grid = reference_vlm_inputs(vlm[0], text, imgs)
    return reference_vlm_greedy(vlm[1], ids, pixels, grid, MAX_TOKENS)  # type: ignore[arg-type]


# A sliding two-image window, then an image the size of an earlier one with other content.
A, B, C, D = (40, 24, 11), (28, 28, 12), (40, 24, 13), (28, 28, 14)
TURNS = [[A, B], [B, C], [C, D], [D]]


def run_turns(path: str, **kw: object) -> tuple[list[list[int]], dict[str, float | list[float]]]:
    llm = LLM(model=path, device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=4,
              enable_prefix_caching=False, **kw)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for specs in TURNS:
        prompt = {"prompt": turn_text(specs), "multi_modal_data": {"image": [image(*s) for s in specs]}}
        out = llm.generate(prompt, params)[0]
        outs.append(list(out.outputs[0].token_ids))
    metrics = llm.get_metrics()
    llm.shutdown()
    return outs, metrics


def turn_text(specs: list[tuple[int, int, int]]) -> str:
    return f"{IM_START}user\nLook: " + " then ".join(IMAGE for _ in specs) + f"{IM_END}\n{IM_START}assistant\n"


def test_repeated_images_are_processed_once_and_outputs_match_transformers(vlm: tuple[str, object],
                                                                           calls: list[int]) -> None:
    outs, metrics = run_turns(vlm[0])
    assert len(calls) == 4  # A, B, C, D once each
    assert (metrics["hyserve:mm_cache_queries"], metrics["hyserve:mm_cache_hits"]) == (7, 3)
    for specs, got in zip(TURNS, outs):
        assert got == expected(vlm, turn_text(specs), [image(*s) for s in specs]), specs
    calls.clear()
    off, metrics = run_turns(vlm[0], mm_processor_cache_gb=0)
    assert off == outs and len(calls) == 7 and metrics["hyserve:mm_cache_hits"] == 0


def test_a_cache_keyed_by_size_alone_is_caught(vlm: tuple[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: C (A's size, other pixels) served A's pixels. The outputs of the turns holding C or D part from
    transformers' (the tiny tower moves the logits enough for the seeds used here)."""
    monkeypatch.setattr(pc, "image_hash", lambda img: f"{img.size[0]}x{img.size[1]}")
    monkeypatch.setattr(pc, "_processed", lambda img, digest, settings: pc.ProcessedImage(
        *_plain(img, settings), digest))
    outs, _ = run_turns(vlm[0])
    wrong = [specs for specs, got in zip(TURNS, outs)
             if got != expected(vlm, turn_text(specs), [image(*s) for s in specs])]
    assert wrong, "a size-keyed cache went unnoticed"


def _plain(img: Image.Image, settings: ImageProcessorSettings) -> tuple[np.ndarray, tuple[int, int, int], int]:
    from hyserve.multimodal.image import process_images

    out = process_images([img], settings=settings)
    t, h, w = out.grid_thw[0].tolist()
    return out.pixel_values.float().numpy(), (int(t), int(h), int(w)), out.token_counts[0]


def test_a_checkpoint_without_processor_files_serves_text(vlm: tuple[str, object], tmp_path: Path) -> None:
    """The processor settings are read at the first image: a VLM-form checkpoint without preprocessor_config.json
    (a text-only deployment) starts and serves text; an image request is refused naming the file."""
    import shutil

    path = str(tmp_path / "no_processor")
    shutil.copytree(vlm[0], path)
    Path(path, "preprocessor_config.json").unlink()
    llm = LLM(model=path, device="cpu", dtype="float32", max_num_batched_tokens=256, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate("hello", params)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"preprocessor_config\.json"):
        llm.generate({"prompt": turn_text([A]), "multi_modal_data": {"image": [image(*A)]}}, params)
    llm.shutdown()


# ----------------------------------------------------------------------------------------------------------------
# LLM.generate prepares image prompts on several threads (LLMEngine.prepare_prompt), then adds them in order.

EPISODE = [[A, B], [B, C], [C, D], [D, A]]


def generate_episode(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt": turn_text(s), "multi_modal_data": {"image": [image(*x) for x in s]}} for s in EPISODE]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import hyserve.llm

    monkeypatch.setattr(hyserve.llm, "available_cpus", lambda: 4)


def test_generate_prepares_image_prompts_concurrently_and_in_order(vlm: tuple[str, object], four_cpus: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Four image prompts in one generate: their processing overlaps (a barrier only four threads at once pass) and
    each output is transformers' for its own images."""
    barrier = threading.Barrier(4, timeout=20)
    threads: set[str] = set()
    real = ProcessorCache.process

    def meeting(self, images):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        barrier.wait()
        return real(self, images)

    monkeypatch.setattr(ProcessorCache, "process", meeting)
    llm = LLM(model=vlm[0], device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=4,
              enable_prefix_caching=False)
    outs = generate_episode(llm)
    llm.shutdown()
    assert len(threads) == 4 and all(t.startswith("hyserve-images") for t in threads)
    for specs, got in zip(EPISODE, outs):
        assert got == expected(vlm, turn_text(specs), [image(*s) for s in specs]), specs


def test_prepared_prompts_put_back_in_another_order_are_caught(vlm: tuple[str, object], four_cpus: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the prepared prompts returned reversed (as if in the order the threads finished)."""
    from concurrent.futures import ThreadPoolExecutor

    real = ThreadPoolExecutor.map
    monkeypatch.setattr(ThreadPoolExecutor, "map", lambda self, fn, items: reversed(list(real(self, fn, items))))
    llm = LLM(model=vlm[0], device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=4,
              enable_prefix_caching=False)
    outs = generate_episode(llm)
    llm.shutdown()
    assert any(got != expected(vlm, turn_text(s), [image(*x) for x in s]) for s, got in zip(EPISODE, outs))


def test_a_refusal_is_the_one_adding_the_prompts_in_order_gives(vlm: tuple[str, object], four_cpus: None) -> None:
    """An image that is no image, behind a prompt refused for its token ids: generate raises the earlier prompt's
    error, as adding them one by one does, and leaves no request behind. Alone, the bad image is named."""
    llm = LLM(model=vlm[0], device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=4)
    params = SamplingParams(max_tokens=2)
    good = {"prompt": turn_text([A]), "multi_modal_data": {"image": [image(*A)]}}
    not_an_image = {"prompt": turn_text([B]), "multi_modal_data": {"image": [b"not an image"]}}
    bad_ids = {"prompt_token_ids": [10**9]}
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([good, bad_ids, not_an_image, good], params)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="not an image"):
        llm.generate([good, not_an_image, good], params)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate([good, good], params)) == 2  # and the engine goes on
    llm.shutdown()
