"""The Triton interpreter's speed-ups (``hyserve.testing.triton_interpreter._speed_up_interpreter``), in subprocesses
with ``TRITON_INTERPRET=1``: a kernel that calls ``tl.zeros`` (Triton's own helper, whose module holds ``tl.core``,
which the kernel's launch does not patch, and calls its ``full``) and helpers of this file calling ``tl.sum`` and
``tl.sigmoid``,
over a grid of several programs, against torch; the helpers' calls patch the language once a launch, not once a
call; the numpy dtype table gives what the interpreter's own lookup gives for every type, block and pointer types
among them; a Triton tuple's type, built when first read, equals the one built at once; a tuple's element set
after the fact changes its type. Sabotage: a helper call that skips the patch although its modules are not
covered (``tl.core`` unpatched) must fail the kernel, in a fresh process (a patch of ``tl.core`` lasts the
process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

import hyserve.testing.triton_interpreter as ti
from hyserve.testing.triton_interpreter import (
    interpreter_subprocess_results,
    patch_triton_interpreter,
    print_results,
    record_check,
)


@triton.jit
def _scaled_row_sum(x, scale):
    return tl.sum(x, axis=0) * scale


@triton.jit
def _gate(x):
    return tl.sigmoid(x)


@triton.jit
def _row_kernel(x_ptr, out_ptr, width, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * width + cols, mask=cols < width, other=0.0) + tl.zeros([BLOCK], tl.float32)
    total = _scaled_row_sum(_gate(x) * (cols < width), scale)
    tl.store(out_ptr + row, total)


def _run_rows() -> tuple[bool, str]:
    x = torch.randn(9, 37, generator=torch.Generator().manual_seed(3))
    out = torch.empty(9)
    _row_kernel[(9,)](x, out, 37, 0.5, BLOCK=64)
    want = torch.sigmoid(x).sum(1) * 0.5
    err = float((out - want).abs().max())
    return err < 1e-5, f"max err {err:.2e}"


def _counted_patches(fn: Any) -> tuple[Any, list[int]]:
    import triton.runtime.interpreter as interp

    calls = [0]
    original = interp._patch_lang

    def counted(f: Any) -> Any:
        calls[0] += 1
        return original(f)

    interp._patch_lang = counted
    try:
        return fn(), calls
    finally:
        interp._patch_lang = original


def _patches_once_a_launch() -> tuple[bool, str]:
    (ok, msg), calls = _counted_patches(_run_rows)
    # the launch's own patch and at most one for the first helper whose modules it does not cover (tl.zeros's
    # tl.core); every helper call (9 programs x 5 helpers) patched before
    return ok and 1 <= calls[0] <= 2, f"{msg}; language patches in the launch: {calls[0]} (45 helper calls)"


def _np_dtypes() -> tuple[bool, str]:
    import triton.runtime.interpreter as interp
    from triton.language import core

    reference = interp._get_np_dtype.__wrapped__
    types = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
             tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
             tl.float8e4b8, tl.float8e4b15]
    types += [core.block_type(t, [4, 2]) for t in types[:6]] + [tl.pointer_type(tl.bfloat16),
                                                                 core.block_type(tl.pointer_type(tl.int8), [8])]
    wrong = [str(t) for t in types if interp._get_np_dtype(t) != reference(t)]
    return not wrong, f"{len(types)} types, differing: {wrong}"


def _lazy_tuple_type() -> tuple[bool, str]:
    from triton.language import core

    values = [core.constexpr(3), 4, tl.float32]
    lazy = core.tuple(values)
    eager = core._type_for_tuple_values(values)
    same = lazy.type.name == eager.name and lazy.type is lazy.type
    lazy._setitem(1, 5)  # the type follows the element set after the fact
    after = lazy.type.name == core._type_for_tuple_values([core.constexpr(3), 5, tl.float32]).name
    given = core.tuple(values, core.tuple_type(eager.types)).type.name == eager.name
    return same and after and given, f"read later {same}, after a set {after}, given {given}"


def run_checks() -> dict[str, list[Any]]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    probe = os.environ.get(PROBE, "")
    if probe.startswith("hang:") and not os.path.exists(probe[len("hang:"):]):  # until the file is there
        time.sleep(120)
    patch_triton_interpreter()
    results: dict[str, list[Any]] = {"environment": [True, os.environ.get(PROBE, "")], "pid": [True, os.getpid()]}
    record_check(results, "helpers_patch_once_a_launch", _patches_once_a_launch)
    record_check(results, "second_launch", _run_rows)
    record_check(results, "np_dtype_table", _np_dtypes)
    record_check(results, "lazy_tuple_type", _lazy_tuple_type)
    return results


def run_sabotage() -> dict[str, list[Any]]:
    """Every helper call taken as covered by its launch's patch: ``tl.sum`` runs on an unpatched ``tl.core``."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import hyserve.testing.triton_interpreter as ti

    patch_triton_interpreter()
    ti._lang_modules = lambda fn: frozenset()  # type: ignore[assignment]
    results: dict[str, list[Any]] = {}
    record_check(results, "uncovered_helper_skipped", _run_rows)
    return results


CHECKS = ["helpers_patch_once_a_launch", "second_launch", "np_dtype_table", "lazy_tuple_type"]
PROBE = "HYSERVE_TEST_ZYGOTE_PROBE"  # read by the checks' process: what environment it got


@pytest.fixture(scope="module")
def results() -> dict[str, list[Any]]:
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


def test_every_check_ran(results: dict[str, list[Any]]) -> None:
    assert sorted(results) == sorted([*CHECKS, "environment", "pid"])


@pytest.mark.parametrize("name", CHECKS)
def test_interpreter_speedup(results: dict[str, list[Any]], name: str) -> None:
    ok, msg = results[name]
    assert ok, msg


def test_uncovered_helper_skipping_its_patch_fails() -> None:
    ok, msg = interpreter_subprocess_results(__file__, "--sabotage")["uncovered_helper_skipped"]
    assert not ok, f"the kernel ran with tl.core unpatched: {msg}"


def _fresh_interpreter(flag: str) -> dict[str, list[Any]]:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, __file__, flag], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("RESULTS ")][-1][len("RESULTS "):])


def test_the_zygote_gives_what_a_fresh_interpreter_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks through the zygote (a child forked for each request) against ``python file flag``, message for
    message; two requests on one environment share one zygote and get two children."""
    monkeypatch.setenv(PROBE, "same")
    first = interpreter_subprocess_results(__file__, "--interpreter-checks")
    second = interpreter_subprocess_results(__file__, "--interpreter-checks")
    fresh = _fresh_interpreter("--interpreter-checks")
    pids = {first.pop("pid")[1], second.pop("pid")[1], fresh.pop("pid")[1]}
    assert first == fresh == second and len(pids) == 3
    assert first["environment"] == [True, "same"]
    # one zygote served both, although pytest's PYTEST_CURRENT_TEST differs from phase to phase and test to test
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    assert interpreter_subprocess_results(__file__, "--interpreter-checks")["environment"] == [True, "same"]
    assert len([key for key in ti._ZYGOTES if (PROBE, "same") in key[1]]) == 1


def _env_reaches_the_child(monkeypatch: pytest.MonkeyPatch) -> bool:
    seen = []
    for value in ("one", "two"):
        monkeypatch.setenv(PROBE, value)
        seen.append(interpreter_subprocess_results(__file__, "--interpreter-checks")["environment"][1])
    return seen == ["one", "two"]


def test_a_changed_environment_gets_its_own_zygote(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _env_reaches_the_child(monkeypatch)


def test_a_zygote_shared_across_environments_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: zygotes keyed by the repository alone, so a variable set after the first request never reaches
    the checks (a kernel module reading it at import would be the zygote's)."""
    monkeypatch.setattr(ti, "_zygote_key", lambda root, env: (str(root), "sabotaged"))
    monkeypatch.setattr(ti, "_ZYGOTES", {})
    assert not _env_reaches_the_child(monkeypatch)


def test_a_hung_check_times_out_and_the_zygote_serves_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    probe = f"hang:{tmp_path / 'go'}"
    monkeypatch.setenv(PROBE, probe)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        interpreter_subprocess_results(__file__, "--interpreter-checks", timeout=5)
    assert time.monotonic() - started < 60
    (zygote,) = [proc for key, proc in ti._ZYGOTES.items() if (PROBE, probe) in key[1]]
    assert zygote.poll() is None, "the zygote went down with its child"
    (tmp_path / "go").touch()
    assert interpreter_subprocess_results(__file__, "--interpreter-checks")["environment"][1] == probe
    assert [proc for key, proc in ti._ZYGOTES.items() if (PROBE, probe) in key[1]] == [zygote]


if __name__ == "__main__":
    flag = sys.argv[1:]
    if flag == ["--interpreter-checks"]:
        print_results(run_checks())
    elif flag == ["--sabotage"]:
        print_results(run_sabotage())
    else:
        sys.exit(f"usage: {sys.argv[0]} --interpreter-checks | --sabotage")
