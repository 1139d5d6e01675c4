"""Each test file's seconds in a pytest run, for the order in which the two test workers take the files.

``scripts/test.sh`` runs the suite on two workers, a file's tests on one (``--dist loadfile``). xdist hands out the
files in the order it is given (``--no-loadscope-reorder``); ``tests/conftest.py`` orders them longest first by
``tests/file_costs.json`` (files it does not list keep their place after those it lists), so that no long file
starts last and keeps one worker busy while the other has finished. This writes that JSON from the output of a run
with ``--durations=0``:

    PYTEST_ADDOPTS="--durations=0" bash scripts/test.sh > run.log 2>&1
    python scripts/file_costs.py run.log            # writes tests/file_costs.json (files of 2 s or more)

The seconds are each file's tests' setup, call and teardown summed, as measured on that machine: only their order
matters."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(tests/[^:\s]+\.py)")


def file_costs(log: str) -> dict[str, float]:
    costs: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            costs[m.group(3)] += float(m.group(1))
    return dict(costs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the output of a pytest run with --durations=0")
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "tests" / "file_costs.json"))
    ap.add_argument("--min-s", type=float, default=2.0, help="files below this many seconds are left out")
    args = ap.parse_args()
    costs = file_costs(Path(args.log).read_text())
    if not costs:
        raise SystemExit(f"{args.log}: no --durations=0 lines (run pytest with --durations=0)")
    kept = {f: round(s, 1) for f, s in sorted(costs.items(), key=lambda kv: -kv[1]) if s >= args.min_s}
    Path(args.out).write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{len(kept)} of {len(costs)} files, {sum(kept.values()):.0f} of {sum(costs.values()):.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
