"""Triton kernels compiled for the H200 (sm_90) on a machine without a GPU (Triton's front end and its bundled
ptxas): the type and constexpr errors the interpreter does not see. The kernel packages list their variants as
``(name, jit function, argument types, constexprs)`` (their ``compile_variants()``); the compile tests hand them to
:func:`compile_failures`."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any


def compile_for_sm90(fn: Any, sig: dict[str, str], consts: dict[str, Any], values: dict[str, int] | None = None,
                     num_warps: int = 4) -> Any:
    """Compile jit function ``fn`` for sm_90: ``sig`` types every argument that ``consts`` does not fix.

    ``values``: the integer arguments' values on the card, to compile as Triton's launcher specializes them there
    (an argument equal to 1 becomes the constant 1; pointers, and integers divisible by 16, are marked so), which
    sets the layouts, the vector widths and so the registers (a unit stride left generic, the GDN decode spilled
    1.6-2.8 KB a thread; specialized, nothing). Without it every argument stays generic."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    missing = [p for p in params if p not in sig and p not in consts]
    assert not missing, f"no type given for {missing}"
    consts, attrs = dict(consts), {}
    if values is not None:
        consts.update({p: 1 for p, v in values.items() if v == 1 and p in sig})
        for i, p in enumerate(params):
            if p not in consts and (sig[p].startswith("*") or values.get(p, 1) % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    signature = {p: "constexpr" if p in consts else sig[p] for p in params}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def ptxas_usage(kernel: Any) -> dict[str, int]:
    """A kernel compiled by :func:`compile_for_sm90`: its registers a thread, spill stores and loads (bytes) and
    stack frame, as Triton's bundled ptxas reports them (``-v``) for its PTX."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90).path  # Triton 3.4 on: the tool for the target's arch
    except TypeError:
        ptxas = get_ptxas().path  # type: ignore[call-arg]
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    out = {}
    for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame")):
        m = re.search(pattern, res.stderr)
        assert m is not None, f"ptxas -v printed no {key}: {res.stderr[-400:]}"
        out[key] = int(m.group(1))
    return out


def compile_failures(variants: Iterable[tuple[str, Any, dict[str, str], dict[str, Any]]]) -> dict[str, str]:
    """``{name: error}`` of the variants that do not compile to a cubin for sm_90 (every variant tried)."""
    failures = {}
    for name, fn, sig, consts in variants:
        try:
            kernel = compile_for_sm90(fn, sig, consts)
            assert kernel.asm.get("cubin"), "no cubin"
        except Exception as e:  # report every variant, not the first
            failures[name] = f"{type(e).__name__}: {str(e)[:400]}"
    return failures


def compile_group(variants: list[Any], default_names: set[str], default: bool) -> list[Any]:
    """A compile test's share of ``variants``: those named in ``default_names`` (``default``: the default suite's,
    each of which must be among the variants) or the rest (the slow suite's)."""
    missing = default_names - {name for name, *_ in variants}
    assert not missing, f"default compiles not among the variants: {sorted(missing)}"
    return [v for v in variants if (v[0] in default_names) == default]
