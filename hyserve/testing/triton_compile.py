"""Triton kernels compiled for the H200 (sm_90) on a machine without a GPU (Triton's front end and its bundled
ptxas): the type and constexpr errors the interpreter does not see. The kernel packages list their variants as
``(name, jit function, argument types, constexprs)`` (their ``compile_variants()``); the compile tests hand them to
:func:`compile_failures`."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any


def compile_for_sm90(fn: Any, sig: dict[str, str], consts: dict[str, Any]) -> Any:
    """Compile jit function ``fn`` for sm_90: ``sig`` types every argument that ``consts`` does not fix."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    missing = [p for p in params if p not in sig and p not in consts]
    assert not missing, f"no type given for {missing}"
    signature = {p: "constexpr" if p in consts else sig[p] for p in params}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))


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
