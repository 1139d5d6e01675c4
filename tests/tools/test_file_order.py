"""The order the suite hands its files to the xdist workers in (``tests/conftest.py``): the longest measured file
first, unmeasured files at half a second a test, ties in collection order, a file's tests together and in their
order; and ``scripts/file_seconds.py`` summing a ``--durations=0`` log per file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import tests.conftest as conftest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Item:
    nodeid: str


def test_longest_files_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seconds = {"tests/a.py": 5.0, "tests/b.py": 40.0, "tests/c.py": 1.0}
    path = tmp_path / "seconds.json"
    path.write_text(json.dumps(seconds))
    monkeypatch.setattr(conftest, "FILE_SECONDS_PATH", str(path))
    names = ["tests/a.py::t1", "tests/b.py::t1", "tests/new.py::t1", "tests/a.py::t2", "tests/c.py::t1",
             "tests/new.py::t2", "tests/b.py::t2", "tests/new.py::t3", "tests/d.py::t1", "tests/e.py::t1"]
    items = [Item(n) for n in names]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    # b 40 s, a 5, new 1.5 (3 tests, unmeasured), c 1, then d and e at 0.5 each in collection order
    assert [i.nodeid for i in items] == ["tests/b.py::t1", "tests/b.py::t2", "tests/a.py::t1", "tests/a.py::t2",
                                         "tests/new.py::t1", "tests/new.py::t2", "tests/new.py::t3",
                                         "tests/c.py::t1", "tests/d.py::t1", "tests/e.py::t1"]


def test_the_committed_seconds_cover_the_suites_files() -> None:
    seconds = json.loads((ROOT / "tests" / "file_seconds.json").read_text())
    assert all(os.path.exists(ROOT / name) for name in seconds), "a measured file no longer exists"
    assert sum(seconds.values()) > 600


def test_file_seconds_sums_a_durations_log(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("12.50s setup    tests/x.py::test_a\n0.50s call     tests/x.py::test_a[p-1]\n"
                   "3.00s teardown tests/y/z.py::test_b\nsomething else\n")
    script = ROOT / "scripts" / "file_seconds.py"
    copy = tmp_path / "scripts" / "file_seconds.py"  # writes ../tests/file_seconds.json beside itself
    copy.parent.mkdir()
    (tmp_path / "tests").mkdir()
    copy.write_text(script.read_text())
    subprocess.run([sys.executable, str(copy), str(log)], check=True, capture_output=True)
    assert json.loads((tmp_path / "tests" / "file_seconds.json").read_text()) == {"tests/x.py": 13.0,
                                                                                  "tests/y/z.py": 3.0}
    empty = tmp_path / "empty"
    empty.write_text("no durations\n")
    proc = subprocess.run([sys.executable, str(copy), str(empty)], capture_output=True, text=True)
    assert proc.returncode != 0 and "--durations=0" in proc.stderr
