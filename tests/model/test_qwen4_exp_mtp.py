"""Qwen4-Exp's MTP head (``hyserve.model.qwen4_exp_mtp``) on the CPU, float32, on tiny checkpoints whose
``mtp.*`` tensors ``hyserve.testing.qwen4_exp`` adds (transformers 5.24 has no MTP head for the family and ignores
them, so there is no reference head):

* the ``mtp.*`` names and shapes, listed from the config's sizes, are the checkpoint's and the head's; both
  architectures draft with it; its layer is an attention (QSA) layer with its own MoE block and no PLE;
* MTP with k = 1, 2 and 4 gives plain decoding's greedy tokens and log-probabilities, on prompts with EOS inside
  (PLE restarts) and longer than the indexer budget;
* with the trunk's and the head layer's block outputs zeroed (the trunk is then a bigram model: its streams at
  position p are S copies of token p's embedding), every draft and the head's wide output are the §6.1 formula's,
  written here in plain torch from the checkpoint's tensors; two sabotages (``fc_hidden`` over the wrong stream
  layout, the head reading the trunk's mixed hidden state instead of its streams) are caught; a planted head that
  predicts the bigram's next token has every draft accepted (k = 2, chained) and the tokens unchanged;
* prefix caching, chunked prefill, preemption, an abort, MTP (planted drafts, accepted and rejected) and async
  scheduling together give the plain run's outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from hyserve import SamplingParams
from hyserve.layers.moe import SparseMoeBlock
from hyserve.layers.qsa import IndexedAttention
from hyserve.model import registry
from hyserve.model.qwen4_exp_mtp import Qwen4ExpMTPHead
from hyserve.model.registry import load_model_config
from hyserve.testing import read_checkpoint_tensors
from hyserve.testing.engine import SlotRecorder, drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.qwen4_exp import QWEN4_EXP
from hyserve.testing.scenarios import assert_same_outputs, scenario, scenario_engine
from hyserve.testing.speculative import record_drafts

FAMILY = QWEN4_EXP.name
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


def _path(ckpts: CheckpointCache) -> str:
    """Eight indexer heads (exact block-score ties rare, as tests/model/test_qwen4_exp.py), and an MTP head."""
    return ckpts.get("causal", "attn_mid", family=FAMILY, indexer_n_heads=8, with_mtp=True)


def _prompts(path: str) -> list[list[int]]:
    """Lengths 1 to 40 (the indexer budget is 8), EOS inside two of them."""
    eos = load_model_config(path).ple_eos_token_id  # type: ignore[attr-defined]
    prompts = random_prompts(5, [1, 7, 23, 40, 17], seed=3)
    prompts[2][5] = eos
    prompts[3][11] = prompts[3][12] = eos
    return prompts


def _mtp(k: int) -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": k}


def test_tensor_names_and_shapes(ckpts: CheckpointCache) -> None:
    path = _path(ckpts)
    cfg = load_model_config(path)
    h, s, w, r = cfg.hidden_size, cfg.hc_count, cfg.hc_width, cfg.hc_lowrank  # type: ignore[attr-defined]
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    e, i, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size  # type: ignore[attr-defined]
    idd, ih = cfg.indexer_head_dim, cfg.indexer_n_heads  # type: ignore[attr-defined]
    layer = {"self_attn.q_proj.weight": (2 * nh * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
             "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, nh * hd),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "self_attn.indexer.index_qk_proj.weight": ((ih + 1) * idd, h),
             "self_attn.indexer.q_layernorm.weight": (idd,), "self_attn.indexer.k_layernorm.weight": (idd,),
             "mlp.gate.weight": (e, h), "mlp.shared_expert.gate_proj.weight": (si, h),
             "mlp.shared_expert.up_proj.weight": (si, h), "mlp.shared_expert.down_proj.weight": (h, si),
             "mlp.shared_expert_gate.weight": (1, h)}
    for x in range(e):
        layer.update({f"mlp.experts.{x}.gate_proj.weight": (i, h), f"mlp.experts.{x}.up_proj.weight": (i, h),
                      f"mlp.experts.{x}.down_proj.weight": (h, i)})
    for hc in ("attn_hyper_connection", "mlp_hyper_connection"):
        layer.update({f"{hc}.hc_norm.weight": (w,), f"{hc}.input_mix_weight_down.weight": (r, w),
                      f"{hc}.input_mix_weight_up.weight": (w, r), f"{hc}.block_inject_weight.weight": (s, w)})
    want = {"mtp.fc_embedding.weight": (h, h), "mtp.fc_hidden.weight": (h, h),
            "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (s * h,),
            "mtp.hyper_connection_mixer.hc_norm.weight": (w,),
            "mtp.hyper_connection_mixer.input_mix_weight_down.weight": (r, w),
            "mtp.hyper_connection_mixer.input_mix_weight_up.weight": (w, r),
            **{f"mtp.layers.0.{n}": shape for n, shape in layer.items()}}
    tensors = read_checkpoint_tensors(path)
    assert {n: tuple(t.shape) for n, t in tensors.items() if n.startswith("mtp.")} == want
    assert cfg.mtp_num_hidden_layers == 1
    for arch, model_type in (("Qwen4ExpForCausalLM", "qwen4_exp_text"),
                             ("Qwen4ExpForConditionalGeneration", "qwen4_exp")):
        head = registry.resolve_architecture(arch, model_type).draft_head
        assert head is not None and head.build is Qwen4ExpMTPHead
    llm = make_llm(path, speculative_config=_mtp(1))
    mtp = llm.llm_engine.runner.mtp
    assert isinstance(mtp, Qwen4ExpMTPHead) and len(mtp.layers) == 1
    (only,) = mtp.layers
    assert only.ple is None and isinstance(only.self_attn, IndexedAttention) and isinstance(only.mlp, SparseMoeBlock)
    torch.testing.assert_close(mtp.fc_hidden.weight, tensors["mtp.fc_hidden.weight"], rtol=0, atol=0)
    torch.testing.assert_close(mtp.pre_fc_norm_hidden.weight, tensors["mtp.pre_fc_norm_hidden.weight"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def plain(ckpts: CheckpointCache) -> list[Any]:
    path = _path(ckpts)
    return make_llm(path, max_num_batched_tokens=16).generate(
        [{"prompt_token_ids": p} for p in _prompts(path)], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_mtp_greedy_is_plain_decoding(ckpts: CheckpointCache, plain: list[Any], k: int) -> None:
    path = _path(ckpts)
    llm = make_llm(path, max_num_batched_tokens=16, speculative_config=_mtp(k))
    got = llm.generate([{"prompt_token_ids": p} for p in _prompts(path)], GREEDY, use_tqdm=False)
    assert_same_outputs({str(n): o for n, o in enumerate(got)}, {str(n): o for n, o in enumerate(plain)})
    assert llm.get_metrics()["hyserve:spec_decode_num_draft_tokens"] > 0  # type: ignore[operator]


def test_steps_at_k0_commit_the_ple_state_and_leave_the_gdn_state_in_place(ckpts: CheckpointCache,
                                                                          plain: list[Any]) -> None:
    """A speculation length scripted through 0 (hyserve.speculative.adaptive): at k = 0 the GDN layers advance
    their slots in place and only the PLE layers commit their candidates; the tokens stay plain decoding's."""
    path = _path(ckpts)
    llm = make_llm(path, max_num_batched_tokens=16, speculative_config={**_mtp(2), "adaptive": True})
    drafts = llm.llm_engine.drafts
    assert drafts is not None
    drafts.policy.script([0, 2, 0, 0, 1])
    got = llm.generate([{"prompt_token_ids": p} for p in _prompts(path)], GREEDY, use_tqdm=False)
    assert_same_outputs({str(n): o for n, o in enumerate(got)}, {str(n): o for n, o in enumerate(plain)})
    assert drafts.policy.histogram[0] > 0 and drafts.policy.histogram[2] > 0


# ------------------------------------------------------------------ the formula, on a bigram trunk, and a planted head

_BLOCK_OUTPUTS = ("o_proj.weight", "out_proj.weight", "experts.down_proj", "shared_expert.down_proj.weight",
                  "ple.value_proj.weight")


def _zero_block_outputs(module: torch.nn.Module) -> None:
    """Every mixer, MoE block and PLE adds exactly 0 to the streams."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(_BLOCK_OUTPUTS):
                p.zero_()


def _norm(x: torch.Tensor, w: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """Zero-centred RMSNorm over each ``group``-wide chunk."""
    g = x.unflatten(-1, (-1, group))
    return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * (1 + w)


def _mix(x: torch.Tensor, t: dict[str, torch.Tensor], prefix: str, s: int, h: int) -> torch.Tensor:
    """§3.8: ``mean_s(sigmoid(W_up silu(W_down N / S))_s * N_s)``, ``N`` the per-stream norm of ``x``."""
    n = _norm(x, t[f"{prefix}.hc_norm.weight"], h)
    a = F.silu(n @ t[f"{prefix}.input_mix_weight_down.weight"].T / s)
    m = torch.sigmoid(a @ t[f"{prefix}.input_mix_weight_up.weight"].T)
    return (m.view(-1, s, h) * n.view(-1, s, h)).mean(1)


def _reference_head(t: dict[str, torch.Tensor], prev: list[int], nxt: list[int], s: int, h: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head at positions whose tokens are ``prev`` and next tokens ``nxt``, over the bigram trunk (streams: S
    copies of the embedding) and a head layer adding 0: its wide output and its logits (§6.1)."""
    emb = t["model.embed_tokens.weight"]
    x = emb[prev].repeat(1, s)  # the trunk's streams
    e = _norm(emb[nxt], t["mtp.pre_fc_norm_embedding.weight"], h) @ t["mtp.fc_embedding.weight"].T
    streams = _norm(x, t["mtp.pre_fc_norm_hidden.weight"], h).view(-1, s, h) @ t["mtp.fc_hidden.weight"].T
    y = (e[:, None, :] + streams).flatten(1)
    return y, _mix(y, t, "mtp.hyper_connection_mixer", s, h) @ t["lm_head.weight"].T


def _bigram_next(t: dict[str, torch.Tensor], token: int, s: int, h: int) -> int:
    x = t["model.embed_tokens.weight"][[token]].repeat(1, s)
    return int((_mix(x, t, "model.hyper_connection_mixer", s, h) @ t["lm_head.weight"].T).argmax())


def _wrong_stream_layout(head: Qwen4ExpMTPHead, model: Any) -> Callable[..., torch.Tensor]:
    def fuse(input_ids: torch.Tensor, hidden: torch.Tensor, meta: Any, embed: Any) -> torch.Tensor:
        t, s, h = hidden.shape[0], head.hc_count, head.hidden_size
        e = head.fc_embedding(head.pre_fc_norm_embedding(embed(input_ids)))
        x = head.pre_fc_norm_hidden(hidden).view(t, h, s).transpose(1, 2).reshape(t * s, h)  # channel-major
        return (e.unsqueeze(1) + head.fc_hidden(x).view(t, s, h)).view(t, s * h)
    return fuse


def _mixed_hidden(head: Qwen4ExpMTPHead, model: Any) -> Callable[..., torch.Tensor]:
    original = head.fuse

    def fuse(input_ids: torch.Tensor, hidden: torch.Tensor, meta: Any, embed: Any) -> torch.Tensor:
        return original(input_ids, model.head_input(hidden).repeat(1, head.hc_count), meta, embed)
    return fuse


@pytest.mark.parametrize("sabotage", [None, _wrong_stream_layout, _mixed_hidden],
                         ids=["as_built", "wrong_stream_layout", "mixed_hidden"])
def test_drafts_are_the_formulas(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                 sabotage: Callable | None) -> None:
    """MTP k = 1 on the bigram trunk: the head's wide output and every draft are the plain-torch formula's; a
    sabotaged head's output is not."""
    path = _path(ckpts)
    t = read_checkpoint_tensors(path)
    cfg = load_model_config(path)
    s, h = cfg.hc_count, cfg.hidden_size  # type: ignore[attr-defined]
    llm = make_llm(path, speculative_config=_mtp(1))
    runner = llm.llm_engine.runner
    head = runner.mtp
    assert isinstance(head, Qwen4ExpMTPHead)
    _zero_block_outputs(runner.model)
    _zero_block_outputs(head.layers)
    if sabotage is not None:
        monkeypatch.setattr(head, "fuse", sabotage(head, runner.model))
    seen = record_drafts(llm.llm_engine)
    prompt = random_prompts(1, [19], seed=11)[0]
    out = drive(llm.llm_engine, {0: [("r", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                                   ignore_eos=True))]})["r"].outputs[0].token_ids
    want = [_bigram_next(t, prompt[-1], s, h)]  # the trunk is the bigram model: its tokens from the formula
    for _ in range(len(out) - 1):
        want.append(_bigram_next(t, want[-1], s, h))
    assert out == want
    seq = prompt + out
    y, logits = _reference_head(t, seq[:-1], seq[1:], s, h)  # position p: (token p, token p + 1)
    assert len(seen["r"]) == len(out) - 2
    errors = []
    for n, (drafts, got) in enumerate(seen["r"], start=1):
        p = len(prompt) + n - 2  # the n-th draft: after n outputs, from position p
        assert sabotage is not None or float(logits[p].max() - logits[p][drafts[0]]) <= 1e-4, n
        errors.append(float((got.float() - y[p]).abs().max()))
    assert (max(errors) > 1e-3) == (sabotage is not None), errors


def test_a_planted_head_that_is_right_is_accepted(ckpts: CheckpointCache) -> None:
    """On the bigram trunk, a head that embeds the next token alone (``fc_embedding`` = I, ``fc_hidden`` = 0, the
    trunk's mixer as its own) predicts the bigram's next token: with k = 2 every draft, chained ones included, is
    accepted, and the tokens are the bigram's."""
    path = _path(ckpts)
    t = read_checkpoint_tensors(path)
    cfg = load_model_config(path)
    s, h = cfg.hc_count, cfg.hidden_size  # type: ignore[attr-defined]
    llm = make_llm(path, speculative_config=_mtp(2))
    runner = llm.llm_engine.runner
    head = runner.mtp
    assert isinstance(head, Qwen4ExpMTPHead)
    _zero_block_outputs(runner.model)
    _zero_block_outputs(head.layers)
    with torch.no_grad():
        head.fc_embedding.weight.copy_(torch.eye(h))
        head.fc_hidden.weight.zero_()
        head.pre_fc_norm_embedding.weight.zero_()
        for name, p in head.hyper_connection_mixer.named_parameters():
            p.copy_(t[f"model.hyper_connection_mixer.{name}"])
    prompts = random_prompts(3, [19, 5, 33], seed=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        want = [_bigram_next(t, prompt[-1], s, h)]
        for _ in range(12):
            want.append(_bigram_next(t, want[-1], s, h))
        assert out.outputs[0].token_ids == want
    metrics = llm.get_metrics()
    drafted, accepted = metrics["hyserve:spec_decode_num_draft_tokens"], metrics[
        "hyserve:spec_decode_num_accepted_tokens"]
    assert isinstance(drafted, int | float) and drafted >= 3 * 8
    assert accepted == drafted, (accepted, drafted)


# -------------------------------------------------------------------------------------------------- features compose


def test_features_compose(ckpts: CheckpointCache, plant_drafts: Callable) -> None:
    """Prefix caching, chunked prefill, preemption, an abort, MTP (planted drafts, accepted and rejected) and async
    scheduling give the synchronous plain run's outputs, rows mapped to slots other than their own."""
    path = _path(ckpts)
    arrivals, aborts, _ = scenario(path)
    plain_engine = scenario_engine(path, "plain")
    want = drive(plain_engine, arrivals, aborts)
    plain_engine.assert_no_leaks()
    engine = scenario_engine(path, "mtp", async_scheduling=True)
    assert isinstance(engine.runner.mtp, Qwen4ExpMTPHead)
    slots = SlotRecorder(engine)
    plant_drafts(engine, {rid: out.outputs[0].token_ids for rid, out in want.items() if rid != "d"})
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert slots.saw_non_identity()
    assert set(got) == set(want) and "c" not in got and len(got["d"].outputs[0].token_ids) == 12
    assert_same_outputs({r: o for r, o in got.items() if r != "d"}, {r: o for r, o in want.items() if r != "d"})
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    assert metrics["hyserve:spec_decode_num_accepted_tokens"] > 0  # type: ignore[operator]
