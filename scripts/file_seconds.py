"""Write tests/file_seconds.json from a pytest log run with ``--durations=0``: each test file's setup, call and
teardown seconds summed (the order ``tests/conftest.py`` hands files to the xdist workers in, longest first)."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown) +(\S+?)::")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/file_seconds.py PYTEST_LOG (a run with --durations=0)")
    seconds: dict[str, float] = defaultdict(float)
    for line in Path(sys.argv[1]).read_text().splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    if not seconds:
        sys.exit(f"no durations in {sys.argv[1]}: run pytest with --durations=0")
    out = Path(__file__).resolve().parents[1] / "tests" / "file_seconds.json"
    out.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=1) + "\n")
    print(f"{out}: {len(seconds)} files, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main()
