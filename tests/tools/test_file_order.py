"""The test files' order for the two workers (``hyserve.testing.ordering``, ``scripts/file_costs.py``): longest
first by the measured seconds, unlisted files after in their own order, each file's tests together and in order;
the costs read from a ``--durations=0`` run summed per file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hyserve.testing.ordering import longest_files_first

ROOT = Path(__file__).parents[2]


def test_longest_files_first_keeps_each_files_tests_together_and_in_order() -> None:
    items = [("tests/a.py", 1), ("tests/a.py", 2), ("tests/b.py", 1), ("tests/c.py", 1), ("tests/c.py", 2),
             ("tests/d.py", 1), ("tests/e.py", 1)]
    got = longest_files_first(items, lambda it: it[0], {"tests/c.py": 90.0, "tests/e.py": 30.0, "tests/x.py": 5.0})
    assert got == [("tests/c.py", 1), ("tests/c.py", 2), ("tests/e.py", 1), ("tests/a.py", 1), ("tests/a.py", 2),
                   ("tests/b.py", 1), ("tests/d.py", 1)]
    assert longest_files_first(items, lambda it: it[0], {}) == items  # no costs: the collection's order


def test_file_costs_sums_a_durations_run_per_file(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("\n".join([
        "============================= slowest durations =============================",
        "132.06s setup    tests/kernels/test_gdn_decode_fused.py::test_every_check_ran",
        "12.50s call     tests/kernels/test_gdn_decode_fused.py::test_triton_kernel_interpreter[x]",
        "3.00s call     tests/server/test_a.py::test_b[one-two]",
        "0.50s teardown tests/server/test_a.py::test_b[one-two]",
        "1.00s call     tests/tools/test_small.py::test_c",
        "(120 durations < 0.005s hidden.)",
    ]))
    out = tmp_path / "costs.json"
    proc = subprocess.run([sys.executable, "scripts/file_costs.py", str(log), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got == {"tests/kernels/test_gdn_decode_fused.py": 144.6, "tests/server/test_a.py": 3.5}
    assert list(got) == ["tests/kernels/test_gdn_decode_fused.py", "tests/server/test_a.py"]  # longest first


def test_the_shipped_costs_name_existing_test_files() -> None:
    """``tests/file_costs.json`` lists files that exist (a renamed file would fall to the end unseen)."""
    costs = json.loads((ROOT / "tests" / "file_costs.json").read_text())
    assert costs and all((ROOT / f).is_file() for f in costs), [f for f in costs if not (ROOT / f).is_file()]
