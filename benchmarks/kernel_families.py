"""Device kernels sorted into families by name, for profiles of either engine (``profile_step.py`` on hyserve,
``peer_bench.py measure --measures profile`` on hyserve and on vLLM): one table in both, so that two engines' steps
are compared family by family.

    from kernel_families import families, format_families
    print(format_families(families([("nvjet_sm90_tst_192x64", 71_125.0)], steps=30)))
"""

from __future__ import annotations

# Kernel families by name, first match wins (cuBLAS's are nvjet / cutlass / gemm / splitKreduce; torch's own are
# at::native's element-wise, index and reduce kernels, run eagerly around the graph; torch.compile's generated
# Triton kernels, vLLM's residual adds, norms and activations among them, are triton_poi / triton_red / triton_per).
# Attention before GEMMs: FlashAttention's kernel names carry ``cutlass::`` in their template arguments.
FAMILIES = (
    ("attention", ("paged", "attn", "flash", "store_kv", "norm_rope", "qsa", "reshape_and_cache")),
    ("GEMMs", ("nvjet", "cutlass", "gemm", "splitkreduce", "_fp8_gemm", "decode_linear", "xmma", "_scaled_mm")),
    ("GDN (and fla chunk kernels)", ("gdn", "chunk_", "fused_recurrent", "_replay", "delta_rule")),
    ("Mamba2", ("mamba2",)),
    ("conv", ("conv1d", "_conv_")),
    ("MoE", ("moe", "expert", "router")),
    ("torch.compile fused kernels", ("triton_poi", "triton_red", "triton_per")),
    ("norms, activations, FP8 quantization", ("norm", "silu", "swiglu", "gelu", "relu", "_quant", "act_and_mul")),
    ("memcpy, memset", ("memcpy", "memset")),
    ("torch eager (indexing, copies, sampling)", ("at::native", "aten::")),
)


def family_of(name: str) -> str:
    """The family of a kernel named ``name`` (``FAMILIES``; ``other`` where none matches)."""
    low = name.lower()
    return next((family for family, keys in FAMILIES if any(k in low for k in keys)), "other")


def families(kernels: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step by family of ``(kernel name, device us in all)`` pairs over ``steps`` steps, largest
    first."""
    out: dict[str, float] = {}
    for name, us in kernels:
        fam = family_of(name)
        out[fam] = out.get(fam, 0.0) + us / 1e3 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def format_families(by_family: dict[str, float]) -> str:
    total = sum(by_family.values()) or 1.0
    rows = [f"  {name:<42} {ms:8.3f} ms/step {100 * ms / total:5.1f} %" for name, ms in by_family.items()]
    return "\n".join(["kernel time by family:", *rows])
