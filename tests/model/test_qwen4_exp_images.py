"""Qwen4-Exp's VLM form with images, QSA on: hyserve's greedy outputs against transformers 5.24's
``Qwen4ExpForConditionalGeneration`` (float32, full uncached forwards with ``pixel_values`` / ``image_grid_thw``, in
its own process) on a tiny checkpoint whose QSA budget (8 tokens in blocks of 4) is far below the prompts (70-130
tokens): the indexer's block keys turn at their first token's M-RoPE positions, which the layer keeps in the KV's
blocks and slots, so blocks inside an image turn at their (time, height, width) and blocks after it at the shifted
text positions.

The reference's inputs come from the ``tokenizers`` library and transformers' image processor alone
(``reference_vlm_inputs``). Cases: one and two images beside a text-only prompt; the agent episodes of sliding
screenshots with prefix caching, 16-token chunks cutting the image spans, MTP k = 2 and async scheduling, with
CUDA graphs emulated. Sabotaged: the block keys turned at their first sequence index (the text layout), the
outputs part from the reference.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from hyserve import LLM, SamplingParams
from hyserve.testing import IM_END, IM_START, reference_vlm_inputs
from hyserve.testing.images import tiny_image as image
from hyserve.testing.qwen4_exp import Qwen4ExpReference, load_qwen4_exp_reference, write_tiny_qwen4_exp_checkpoint
from hyserve.testing.tokenizer import user_turn

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SYSTEM = f"{IM_START}system\nYou operate a computer from its screenshots. Answer with one action.{IM_END}\n"
MAX_TOKENS = 4
# float32 on both sides; a chosen token's logprob within 3e-3 is agreement (transformers' float32 and float64
# forwards differ by ~1e-3 on a logit of these models), a wrong rotation moves the selection and far more.
LOGPROB_TOL = 3e-3

Case = tuple[str, list[Image.Image]]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Qwen4ExpReference]:
    path = write_tiny_qwen4_exp_checkpoint(tmp_path_factory.mktemp("q4_vlm") / "ckpt", form="vlm", seed=5,
                                           with_mtp=True, indexer_n_heads=8)
    ref = load_qwen4_exp_reference(path)
    yield path, ref
    ref.close()


def episode_prompt(turn: int, label: str) -> str:
    """Turn ``turn`` of an agent episode: every step so far with its reply, the screenshots of the last two steps
    only (older ones replaced by text)."""
    text = SYSTEM
    for j in range(turn + 1):
        shown = IMAGE if j >= turn - 1 else "[an earlier screen]"
        text += user_turn(f"{label} {j}: {shown} what next?")
        if j < turn:
            text += f"I click {label} {j}.{IM_END}\n"
    return text


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def make_llm(path: str, **kw: object) -> LLM:
    args: dict[str, object] = dict(device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=8,
                                   num_kv_blocks=256, num_state_slots=8)
    args.update(kw)
    return LLM(model=path, **args)  # type: ignore[arg-type]


def reference_greedy(ref: Qwen4ExpReference, ids: list[int], pixels: torch.Tensor | None,
                     grid: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
    """``MAX_TOKENS`` greedy tokens after ``ids``, each from a full uncached forward, and the logprobs of the last
    forward's positions after the prompt (float64)."""
    out: list[int] = []
    logits = torch.empty(0)
    for _ in range(MAX_TOKENS + 1):
        logits = ref([ids + out], pixel_values=pixels, image_grid_thw=grid).logits[0]
        if len(out) == MAX_TOKENS:
            break
        out.append(int(logits[-1].argmax()))
    return out, torch.log_softmax(logits[len(ids) - 1 : -1].double(), dim=-1)


def outputs_match(vlm: tuple[str, Qwen4ExpReference], cases: list[Case], outs: list[object]) -> list[str]:
    """The cases whose prompt ids, greedy tokens or logprobs differ from the reference's (empty: all agree)."""
    path, ref = vlm
    bad = []
    for (text, imgs), out in zip(cases, outs, strict=True):
        ids, pixels, grid = reference_vlm_inputs(path, text, imgs)
        want, ref_lp = reference_greedy(ref, ids, pixels, grid)
        got = out.outputs[0]  # type: ignore[attr-defined]
        ok = out.prompt_token_ids == ids and got.token_ids == want  # type: ignore[attr-defined]
        ok = ok and all(abs(got.logprobs[j][tok].logprob - float(ref_lp[j, tok])) < LOGPROB_TOL
                        for j, tok in enumerate(want))
        if not ok:
            bad.append(text)
    return bad


def run(llm: LLM, cases: list[Case]) -> list[object]:
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text for text, imgs in cases]
    return llm.generate(prompts, greedy())  # type: ignore[arg-type]


CASES: list[Case] = [
    (SYSTEM + user_turn(f"{IMAGE}What is shown on this screen, and where should I click?"), [image(48, 40, 1)]),
    (SYSTEM + user_turn(f"Compare {IMAGE} with {IMAGE}: which one changed?"), [image(40, 48, 2), image(32, 24, 3)]),
    (SYSTEM + user_turn("No screen this time; repeat the last action and say why it was right."), []),
]


def test_images_match_transformers_with_qsa_selecting(vlm: tuple[str, Qwen4ExpReference]) -> None:
    llm = make_llm(vlm[0])
    budget = vlm[1].config.indexer_budget
    ids = [reference_vlm_inputs(vlm[0], text, imgs)[0] for text, imgs in CASES]
    assert min(len(i) for i in ids) > 4 * budget  # the selection matters at every prompt
    assert outputs_match(vlm, CASES, run(llm, CASES)) == []


@pytest.mark.parametrize("graphs", [pytest.param(False, marks=pytest.mark.slow), True],  # budget: every feature on
                         ids=["eager", "graphs"])
def test_sliding_screenshots_with_mtp_prefix_caching_chunks_and_async(vlm: tuple[str, Qwen4ExpReference],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      graphs: bool) -> None:
    """The seed's agents: MTP k = 2, prefix caching, 16-token chunks cutting every image span, async scheduling,
    two episodes interleaved over three turns (each turn resumes from the cache past the previous turn's images);
    with CUDA graphs emulated too (decode, verify and drafting steps replay graphs, with text positions only)."""
    from hyserve.worker import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    llm = make_llm(vlm[0], enable_prefix_caching=True, max_num_batched_tokens=16, recurrent_snapshot_interval=16,
                   num_snapshot_slots=32, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                   async_scheduling=True)
    shots = {c: [image(48, 40, 50 + 10 * c + i) for i in range(3)] for c in range(2)}
    for turn in range(3):
        cases = [(episode_prompt(turn, f"Task {c}, step"), shots[c][max(0, turn - 1) : turn + 1]) for c in range(2)]
        outs = run(llm, cases)
        assert outputs_match(vlm, cases, outs) == [], turn
        if turn:
            assert all((o.num_cached_tokens or 0) >= 16 for o in outs)  # type: ignore[attr-defined]


def test_block_keys_at_sequence_positions_are_caught(vlm: tuple[str, Qwen4ExpReference],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotaged: the block keys turn at ``j * c`` (each block's first sequence index, the text layout) instead of
    their first token's stored positions, so every block inside and after an image turns at the wrong angle: the
    outputs part from the reference."""
    import hyserve.layers.qsa as qsa

    real = qsa.pool_block_keys_batched

    def text_layout(*args: object, **kwargs: object) -> torch.Tensor:
        return real(*args[:6], None, None)  # type: ignore[arg-type]

    monkeypatch.setattr(qsa, "pool_block_keys_batched", text_layout)
    llm = make_llm(vlm[0])
    assert outputs_match(vlm, CASES[:2], run(llm, CASES[:2])) != []
