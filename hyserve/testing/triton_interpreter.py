"""The Triton interpreter (``TRITON_INTERPRET=1``) made to compute as the GPU does, for tests that run kernels on
CPU tensors: kernel tests, and whole-engine runs whose MoE layers take the fused kernels under the interpreter
(``hyserve.kernels.moe.uses_triton``). Call :func:`patch_triton_interpreter` once in the interpreter's process,
before any kernel runs. A test file's checks run in such a process through :func:`interpreter_subprocess_results`
(a child of ``hyserve.testing.interpreter_zygote``, or a fresh interpreter)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


def patch_triton_interpreter() -> None:
    """Work around two interpreter bugs seen with triton 3.6 + numpy >= 2.3 (interpreter only; GPU code unaffected):

    * a scalar loaded from memory is a 1-element array, and ``range(lo, hi)`` with it as a bound calls ``int()`` on
      it, which numpy 2.3+ refuses for 1-d arrays;
    * ``tl.dot`` on bfloat16 operands multiplies their raw uint16 storage;
    * float32 -> bfloat16 casts truncate, where GPUs (and torch) round to nearest even;
    * float32 -> float8_e4m3 casts lose the carry of a mantissa rounded up into the exponent (124.3 gives 64).
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig_patch = interp._patch_lang_tensor

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    orig_dot = interp.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        def up(h: Any) -> Any:
            if getattr(h.dtype, "scalar", h.dtype) == tl.bfloat16:
                return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h

        return orig_dot(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot
    orig_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
            nan = np.isnan(src.data)
            rounded[nan] = 0x7FC0
            return interp.TensorHandle(rounded, dst_type.scalar)
        return orig_cast(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl
    orig_fp_to_fp = interp.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:  # round to nearest even, as torch
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interp.TensorHandle(data.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), dst_type.scalar)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    _speed_up_interpreter()


_LAUNCH_LANGS: list[set[int]] = []  # the language modules each running launch has patched (innermost last)


@functools.cache
def _lang_modules(fn: Any) -> frozenset[int]:
    """The ids of the Triton language modules (``tl``, ``tl.core``) that ``fn``'s module holds, as the interpreter's
    ``_patch_lang`` finds them."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _speed_up_interpreter() -> None:
    """Three of the interpreter's per-operation costs, which made up about a third of a kernel file's checks (a
    profile of ``test_gdn_decode_fused.py``'s): the results are unchanged, only work that gives the same result
    every time is skipped.

    * every call of a ``@triton.jit`` helper inside a kernel patched the language modules again (``inspect``
      over all their members) although the launch around it, or an earlier helper call in it, had patched them
      (a helper's patch is never undone): the call skips it when those patches cover the helper's modules;
    * the numpy dtype of a Triton type was looked up in a dict built again on every call;
    * every tensor's shape is a Triton tuple whose type (with its printed name) was built as it was made, and is
      almost never read: the type is built when first read.
    """
    import triton.language as tl
    import triton.language.core as core
    import triton.runtime.interpreter as interp

    if getattr(interp, "_hyserve_sped_up", False):
        return
    interp._hyserve_sped_up = True
    grid_call = interp.GridExecutor.__call__

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        _LAUNCH_LANGS.append(set(_lang_modules(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _LAUNCH_LANGS.pop()

    interp.GridExecutor.__call__ = launch
    helper_call = interp.InterpretedFunction.__call__

    def call_helper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _LAUNCH_LANGS:
            return helper_call(self, *args, **kwargs)
        langs = _lang_modules(self.fn)
        if not langs <= _LAUNCH_LANGS[-1]:  # e.g. ``tl.sum``, whose module holds ``tl.core``: patched (for good)
            _LAUNCH_LANGS[-1].update(langs)
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.InterpretedFunction.__call__ = call_helper
    np_dtype = interp._get_np_dtype
    table = {ty: np_dtype(ty) for ty in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                          tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16,
                                          tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np_dtype(tl.pointer_type(tl.float32))

    def get_np_dtype(tt_dtype: Any) -> Any:
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        return table[tt_dtype]

    get_np_dtype.__wrapped__ = np_dtype  # type: ignore[attr-defined]  # the original, for the tests
    interp._get_np_dtype = get_np_dtype
    tuple_init = core.tuple.__init__

    class LazyType:
        def __get__(self, obj: Any, owner: Any = None) -> Any:
            if obj is None:
                return self
            ty = obj.__dict__.get("_lazy_type")
            if ty is None:
                ty = obj.__dict__["_lazy_type"] = core._type_for_tuple_values(obj.values)
            return ty

        def __set__(self, obj: Any, value: Any) -> None:
            obj.__dict__["_lazy_type"] = value

    def init_tuple(self: Any, args: Any, type: Any = None) -> None:
        if type is not None:
            tuple_init(self, args, type)
        else:
            self.values = list(args)

    core.tuple.type = LazyType()
    core.tuple.__init__ = init_tuple


def mutated_module(module_name: str, edits: list[tuple[str, str]]) -> ModuleType:
    """A fresh copy of module ``module_name`` made from its source with ``edits`` (``(text, replacement)``, each text
    found exactly once): the sabotaged kernels a test must see fail. The original module is left as it is; a test
    swaps the copy's kernel in for the launcher and puts the original back."""
    src = Path(str(importlib.import_module(module_name).__file__)).read_text()
    for replaced, replacement in edits:
        assert src.count(replaced) == 1, f"mutation target not found once: {replaced!r}"
        src = src.replace(replaced, replacement)
    name = "mutated_" + module_name.replace(".", "_")
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # Triton's jit reads the function's module by name
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def swapped_kernel(module_name: str, kernel: str, edits: list[tuple[str, str]]) -> Iterator[None]:
    """Within the block, module ``module_name``'s ``kernel`` is the one compiled from its source with ``edits`` made
    (:func:`mutated_module`; the kernel's own helpers mutated with it), so a launcher that imports it by name at call
    time launches the sabotaged kernel; the original is put back on the way out."""
    module = importlib.import_module(module_name)
    original = getattr(module, kernel)
    setattr(module, kernel, getattr(mutated_module(module_name, edits), kernel))
    try:
        yield
    finally:
        setattr(module, kernel, original)


# The flags whose checks run kernels alone (no engine, no worker processes): these go through a zygote
# (``hyserve.testing.interpreter_zygote``); the others (``--engine-check`` and the like) get a fresh interpreter.
ZYGOTE_FLAGS = ("--interpreter-checks", "--interpreter-checks-slow", "--kernel-checks", "--sabotage")
_ZYGOTES: dict[tuple[str, frozenset[tuple[str, str]]], subprocess.Popen[bytes]] = {}


def _zygote_key(root: Path, env: dict[str, str]) -> tuple[str, frozenset[tuple[str, str]]]:
    """The environment but pytest's name of the running test (which changes with every test; no import reads it)."""
    return str(root), frozenset((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST")


def _zygote(root: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """This process's zygote for ``env`` (one per distinct environment, as a child reads the variables the
    zygote's imports read), started on first use; it ends when this process closes its stdin (at exit)."""
    key = _zygote_key(root, env)
    proc = _ZYGOTES.get(key)
    if proc is None or proc.poll() is not None:
        proc = subprocess.Popen([sys.executable, "-m", "hyserve.testing.interpreter_zygote"], env=env, cwd=root,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        _ZYGOTES[key] = proc
    return proc


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """The zygote's next reply, waiting until ``deadline`` (``TimeoutError``), read a byte at a time from the pipe
    itself (a reply is a few bytes; a buffer in between would hold the next reply where ``select`` cannot see it)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    line = b""
    while not line.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError
        byte = os.read(fd, 1)
        assert byte, f"the interpreter zygote ended (exit code {proc.wait()})"
        line += byte
    reply: dict[str, Any] = json.loads(line)
    return reply


def _zygote_run(path: Path, flag: str, root: Path, env: dict[str, str], timeout: int) -> tuple[int, str]:
    """Run ``python path flag`` in a child forked from the zygote; (exit code, its stdout and stderr)."""
    proc = _zygote(root, env)
    assert proc.stdin is not None
    with tempfile.NamedTemporaryFile(prefix="interp-", suffix=".log", delete=False) as log:
        pass
    try:
        proc.stdin.write((json.dumps({"file": str(path), "flag": flag, "log": log.name}) + "\n").encode())
        deadline = time.monotonic() + timeout
        child = _read_line(proc, deadline)["pid"]
        try:
            rc = int(_read_line(proc, deadline)["rc"])
        except TimeoutError:
            os.kill(child, 9)
            _read_line(proc, time.monotonic() + 30)
            raise subprocess.TimeoutExpired([str(path), flag], timeout) from None
        return rc, Path(log.name).read_text(errors="replace")
    finally:
        os.unlink(log.name)


def interpreter_subprocess_results(test_file: str, flag: str, timeout: int = 300) -> dict[str, list[Any]]:
    """Run ``python test_file flag`` with ``TRITON_INTERPRET=1`` (from the repository root, on ``PYTHONPATH``) and
    return the ``{name: [ok, message]}`` it prints on its last ``RESULTS <json>`` line. The variable must be set
    before any kernel is decorated: a subprocess keeps it away from the test process's other kernels. The kernel
    checks' flags (``ZYGOTE_FLAGS``) run in a child forked from a process that has imported torch, triton and the
    kernels once (``hyserve.testing.interpreter_zygote``), the same code on the same environment."""
    path = Path(test_file).resolve()
    root = next(p for p in path.parents if (p / "pyproject.toml").exists())
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    if flag in ZYGOTE_FLAGS:
        returncode, out = _zygote_run(path, flag, root, env, timeout)
        detail = out[-6000:]
    else:
        proc = subprocess.run([sys.executable, str(path), flag], env=env, cwd=root, capture_output=True, text=True,
                              timeout=timeout)
        returncode, out = proc.returncode, proc.stdout
        detail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULTS ")]
    assert returncode == 0 and lines, f"interpreter subprocess failed:\n{detail}"
    results: dict[str, list[Any]] = json.loads(lines[-1][len("RESULTS "):])
    return results


def record_check(results: dict[str, list[Any]], name: str, fn: Callable[[], tuple[bool, str]]) -> None:
    """Run one interpreter check ``fn`` (``(ok, message)``) into ``results[name]``; an exception is its failure, so
    the other checks still run and report."""
    try:
        ok, msg = fn()
    except Exception as e:  # report, don't abort the other checks
        ok, msg = False, f"{type(e).__name__}: {e}"
    results[name] = [bool(ok), msg]


def case_and_sabotage_checks(module_name: str, cases: list[str], sabotages: dict[str, list[tuple[str, str]]],
                             sabotage_case: dict[str, str],
                             run: Callable[[ModuleType, torch.dtype, str], tuple[bool, str]]) -> dict[str, list[Any]]:
    """Each of ``cases`` in float32 and bf16 through module ``module_name``'s own kernels (``{case}_{dtype}``), then
    each sabotaged copy of the module (``sabotages``: name -> edits, :func:`mutated_module`) on its case
    (``sabotage_case``) in float32 (``sabotage_{name}``): ``run(kernels, dtype, case)`` gives ``(ok, message)``."""
    own = importlib.import_module(module_name)
    results: dict[str, list[Any]] = {}
    for case in cases:
        for dtype in (torch.float32, torch.bfloat16):
            record_check(results, f"{case}_{str(dtype)[6:]}", functools.partial(run, own, dtype, case))
    for name, edits in sabotages.items():
        mutated = mutated_module(module_name, edits)
        record_check(results, f"sabotage_{name}", functools.partial(run, mutated, torch.float32, sabotage_case[name]))
    return results


def print_results(results: dict[str, list[Any]]) -> None:
    """The interpreter subprocess's report (its ``__main__``): each check on stderr, then the ``RESULTS <json>`` line
    :func:`interpreter_subprocess_results` reads."""
    for name, (ok, msg) in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {msg}", file=sys.stderr)
    print("RESULTS " + json.dumps(results))
