"""Count the kernel launches one decode step makes on CUDA, measured on the CPU.

Every aten op that does work (views and allocations excluded) is one launch, and each of hyserve's kernel entry
points (conv, GDN, attention, KV store, norms, gates, SwiGLU, RoPE, Nemotron 3's routing) counts as one launch, its
CPU reference's ops suppressed. The model is a tiny random checkpoint with the 2B shape's layer pattern (24 layers,
GDN:attention 3:1) in bf16; the count does not depend on the widths. While decode is host-bound (no CUDA graphs yet)
the step time follows this count. A pure decode step's GDN mixers take their fused kernel, as on CUDA (one launch
each: ``hyserve.kernels.gdn.decode``); ``--unfused-gdn`` counts the four-launch sequence (conv, gates, delta rule,
gated norm) instead.

``--nemotron-h`` counts a tiny Nemotron-H checkpoint with the 8B's blocks instead (52: 24 Mamba2, 24 squared-ReLU
MLP, 4 attention; :func:`nemotron_h_checkpoint`). ``--nemotron-h-moe`` counts one with Nemotron 3 Nano's 52 blocks
(23 Mamba2, 23 MoE, 6 attention: ``hybrid_override_pattern`` of ``benchmarks/shapes.py``'s nemotron3-nano-30b-a3b)
and its routing (128 experts, top 6, one group); the experts' sum counts as the launches the fused MoE kernels make at
decode (:data:`FUSED_EXPERTS_LAUNCHES`: gate/up, down, combine), not as the CPU loop over the experts.

    python benchmarks/count_launches.py
    python benchmarks/count_launches.py --nemotron-h --by-op
    python benchmarks/count_launches.py --nemotron-h-moe --by-op
    HYSERVE_DECODE_GEMM=on python benchmarks/count_launches.py --by-op   # norms and SwiGLU in the GEMMs' prologue
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import tempfile
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyserve import LLM, SamplingParams
from hyserve.kernels.gemv import decode_gemm_enabled as gemv_enabled
from hyserve.testing import write_tiny_checkpoint

NOT_LAUNCHES = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "t", "transpose",
                "expand", "permute", "split", "split_with_sizes", "chunk", "alias", "detach", "unbind", "reshape",
                "_reshape_alias", "lift_fresh", "empty", "empty_strided", "empty_like", "resolve_conj",
                "resolve_neg"}
ENTRY_POINTS = {
    "hyserve.layers.gdn": ["causal_conv1d_varlen", "gdn_forward", "gdn_gating", "causal_conv1d_verify", "gdn_verify",
                           "gdn_decode_fused", "gdn_verify_fused", "gdn_replay"],
    "hyserve.layers.attention": ["paged_attention", "store_kv", "sigmoid_mul"],
    "hyserve.layers.mlp": ["silu_mul", "relu_squared"],
    "hyserve.layers.mamba2": ["causal_conv1d_varlen", "causal_conv1d_verify", "mamba2_scan", "mamba2_replay",
                              "grouped_gated_rms_norm", "gated_sum_squares", "silu_gate"],
    "hyserve.layers.norm": ["rms_norm", "gated_rms_norm", "add_rms_norm", "scaled_rms_norm", "add_scaled_rms_norm"],
    "hyserve.layers.rotary": ["apply_rope", "rms_norm_rope"],
    "hyserve.layers.sigmoid_moe": ["route_sigmoid_experts"],
    # (a verify step's commit is gdn_replay / mamba2_replay above: the window's copy and the replay in one launch)
}


# The fused MoE kernels' launches for a decode step of DIRECT_MAX_TOKENS tokens (one) in bf16 (hyserve.kernels.moe:
# gate/up, down, combine; no alignment launches in the direct order).
FUSED_EXPERTS_LAUNCHES = 3


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.count = 0
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.depth == 0 and func.__name__.split(".")[0] not in NOT_LAUNCHES:
            self.count += 1
            self.by_op[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _one_launch(counter: _Counter, fn: Any) -> Any:
    """``fn`` counted as one launch; the ops it runs inside are not counted."""

    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        if counter.depth == 0:
            counter.count += 1
            counter.by_op[fn.__name__] += 1
        counter.depth += 1
        try:
            return fn(*a, **k)
        finally:
            counter.depth -= 1

    return wrapped


def _launches(counter: _Counter, fn: Any, n: int) -> Any:
    """``fn`` counted as ``n`` launches; the ops it runs inside are not counted."""

    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        if counter.depth == 0:
            counter.count += n
            counter.by_op[fn.__name__] += n
        counter.depth += 1
        try:
            return fn(*a, **k)
        finally:
            counter.depth -= 1

    return wrapped


def _count_sigmoid_moe_as_on_cuda(counter: _Counter) -> None:
    """Nemotron 3's experts' sum as on CUDA: the fused kernels' launches (their CPU reference computes it)."""
    from hyserve.kernels.moe import fused_experts_ref
    from hyserve.layers import sigmoid_moe

    def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, expert_start: int = 0, **kw: Any) -> torch.Tensor:
        return fused_experts_ref(x, w13, w2, weights, ids, expert_start, kw.get("scales"),
                                 activation=kw.get("activation", "silu"))

    fused_experts.__name__ = "fused_experts"
    sigmoid_moe.fused_experts = _launches(counter, fused_experts, FUSED_EXPERTS_LAUNCHES)  # type: ignore[assignment]
    sigmoid_moe.uses_triton = lambda t: True  # type: ignore[assignment]


def _count_fp8_gemms_as_on_cuda(counter: _Counter) -> None:
    """An FP8 GEMM as on CUDA: its activation's quantization launch and the GEMM's (two launches), or the GEMM's
    alone where the producer handed the activation quantized (``Fp8Activation``); the CPU reference's ops (the
    weight dequantized, the float32 matmul) not counted."""
    from hyserve.kernels.fp8 import Fp8Activation
    from hyserve.layers.quantization import fp8 as fp8_method

    linear = fp8_method.fp8_linear

    @functools.wraps(linear)
    def fp8_linear(x: Any, *a: Any, **k: Any) -> Any:
        if counter.depth == 0:
            if isinstance(x, Fp8Activation):
                counter.count += 1
                counter.by_op["fp8_gemm"] += 1
            else:
                counter.count += 2
                counter.by_op["fp8_gemm"] += 1
                counter.by_op["quantize_rows"] += 1
        counter.depth += 1
        try:
            return linear(x, *a, **k)
        finally:
            counter.depth -= 1

    fp8_method.fp8_linear = fp8_linear  # type: ignore[assignment]


def _count_decode_gemms_as_on_cuda(counter: _Counter) -> None:
    """``HYSERVE_DECODE_GEMM=on`` as on CUDA: a decode step's norm and SwiGLU deferred into the next GEMM's
    prologue, that GEMM one launch (its CPU reference computes the deferred input, uncounted)."""
    from hyserve.kernels import gemv
    from hyserve.layers import linear

    gemv.uses_triton = lambda t: True  # type: ignore[assignment]
    linear.decode_linear = _one_launch(counter, gemv.decode_linear_ref)  # type: ignore[assignment]


def _count_entry_points(counter: _Counter) -> None:
    for modname, names in ENTRY_POINTS.items():
        mod = importlib.import_module(modname)
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, _one_launch(counter, getattr(mod, name)))


def _gdn_decode_as_on_cuda() -> None:
    """The Gated DeltaNet mixer takes its fused decode and verify kernels where CUDA would (a pure decode step; verify
    rows of drafts): one launch for conv, gates, delta rule and gated norm, its CPU reference sequence suppressed."""
    from hyserve.layers import gdn

    gdn.uses_fused_decode = lambda x: True  # type: ignore[assignment]
    gdn.uses_fused_verify = lambda x: True  # type: ignore[assignment]


def _count_graph_replays(counter: _Counter) -> None:
    """A graph replay is one launch; what runs inside it (emulated on the CPU) is not counted."""
    from hyserve.worker.cuda_graphs import GraphSet

    GraphSet.run = _one_launch(counter, GraphSet.run)  # type: ignore[method-assign]


def nemotron_h_checkpoint(path: str) -> str:
    """A tiny random Nemotron-H checkpoint in ``path`` with the 8B's block counts (4 x (6 x Mamba2, MLP), attention)."""
    from hyserve.testing.nemotron_h import ATTN, MLP, M, write_tiny_nemotron_h_checkpoint

    return write_tiny_nemotron_h_checkpoint(path, layer_types=([M, MLP] * 6 + [ATTN]) * 4)


def nemotron_h_moe_checkpoint(path: str) -> str:
    """A tiny random Nemotron-H checkpoint in ``path`` with Nemotron 3 Nano's blocks and routing (128 experts, top 6,
    one group)."""
    from shapes import MAMBA2_SHAPES

    from hyserve.testing.nemotron_h import ATTN, MLP, MOE, M, write_tiny_nemotron_h_checkpoint

    nano = MAMBA2_SHAPES["nemotron3-nano-30b-a3b"]
    blocks = {"M": M, "*": ATTN, "-": MLP, "E": MOE}
    layer_types = [blocks[c] for c in nano["hybrid_override_pattern"]]
    return write_tiny_nemotron_h_checkpoint(path, layer_types=layer_types, n_routed_experts=nano["n_routed_experts"],
                                            num_experts_per_tok=nano["num_experts_per_tok"], n_group=nano["n_group"],
                                            topk_group=nano["topk_group"], moe_intermediate_size=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--graphs", action="store_true",
                    help="count with CUDA graphs (emulated on the CPU): a replay is one launch")
    ap.add_argument("--spec", choices=("mtp",), default=None, help="speculative decoding with the MTP head, k = 3")
    ap.add_argument("--steps", type=int, default=4, help="steps averaged (speculative steps vary)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="async scheduling (with MTP: verify rows behind rows in flight)")
    ap.add_argument("--by-op", action="store_true", help="also list the launches per step by op")
    ap.add_argument("--nemotron-h", action="store_true",
                    help="a tiny Nemotron-H with the 8B's 52 blocks in place of the Qwen 2B shape")
    ap.add_argument("--nemotron-h-moe", action="store_true",
                    help="a tiny Nemotron-H with Nemotron 3 Nano's 52 blocks (23 MoE) and routing")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 weights (online, per channel, activations per token): each GEMM's quantization launch "
                         "counted, or none where its producer quantizes (HYSERVE_FP8_FUSED_QUANT=0 to compare)")
    ap.add_argument("--unfused-gdn", action="store_true",
                    help="count the Gated DeltaNet's decode as the unfused sequence (conv, gates, delta rule, norm)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="prefix caching on (speculative steps then copy candidate snapshots at block boundaries)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    counter = _Counter()
    _count_entry_points(counter)
    if args.fp8:
        _count_fp8_gemms_as_on_cuda(counter)
    if gemv_enabled():
        _count_decode_gemms_as_on_cuda(counter)
    if not args.unfused_gdn:
        _gdn_decode_as_on_cuda()
    if args.graphs:
        from hyserve.worker import cuda_graphs

        cuda_graphs.EMULATE = True
        _count_graph_replays(counter)
    pattern = (["linear_attention"] * 3 + ["full_attention"]) * 6
    if args.nemotron_h:
        path = nemotron_h_checkpoint(tempfile.mkdtemp())
    elif args.nemotron_h_moe:
        _count_sigmoid_moe_as_on_cuda(counter)
        path = nemotron_h_moe_checkpoint(tempfile.mkdtemp())
    else:
        path = write_tiny_checkpoint(tempfile.mkdtemp(), layer_types=pattern, dtype=torch.bfloat16,
                                     tie_word_embeddings=True, with_mtp=args.spec == "mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 3} if args.spec else None
    llm = LLM(model=path, device="cpu", dtype="bfloat16", enable_prefix_caching=args.prefix_caching,
              speculative_config=spec, quantization="fp8" if args.fp8 else None,
              async_scheduling=args.async_scheduling)
    eng = llm.llm_engine
    for i in range(args.batch):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(1 + i, 40 + i))},
                        SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    for _ in range(4):  # prefill, the first decode (drafts from the prefill) and the first verify steps
        eng.step()  # every row decodes, with full verify rows, from here on
    counter.count = 0
    counter.by_op.clear()
    with counter:
        for _ in range(args.steps):
            eng.step()
    what = "speculative (MTP, k = 3)" if args.spec else "decode"
    layers = ("Nemotron-H, 52 blocks" if args.nemotron_h else
              "Nemotron 3 Nano's 52 blocks" if args.nemotron_h_moe else "24 layers")
    print(f"launches per {what} step at batch {args.batch} ({layers}, bf16, sampling included"
          f"{', CUDA graphs' if args.graphs else ''}{', async' if args.async_scheduling else ''}): "
          f"{counter.count / args.steps:.1f}")
    if args.by_op:
        for op, n in counter.by_op.most_common():
            print(f"  {op}: {n / args.steps:.1f}")


if __name__ == "__main__":
    main()
