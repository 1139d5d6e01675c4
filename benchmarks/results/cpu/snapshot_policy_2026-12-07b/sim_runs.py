"""The table of this folder's README: the earlier rule (52cf7ec's ``hyserve/cache/prefix_cache.py``, loaded from git)
against the current one on the seed's agents (``benchmarks/snapshot_policy_sim.py``), six seeds each.

    python benchmarks/results/cpu/snapshot_policy_2026-12-07b/sim_runs.py OUT.json
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import snapshot_policy_sim as sim  # noqa: E402

from hyserve.cache.prefix_cache import PrefixCache  # noqa: E402


def earlier_rule() -> type:
    src = subprocess.run(["git", "show", "52cf7ec:hyserve/cache/prefix_cache.py"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    path = Path(tempfile.mkdtemp()) / "pc_earlier.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("pc_earlier", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pc_earlier"] = module
    spec.loader.exec_module(module)
    return module.PrefixCache  # type: ignore[no-any-return]


def main() -> None:
    rules = {"earlier": earlier_rule(), "new": PrefixCache}
    rows = {}
    for layout in ((26571, 32, 57, 55), (20970, 32, 96, 55)):
        for n in (256, 768):
            for name, cls in rules.items():
                runs = [sim.simulate(layout, n, s, cls) for s in range(6)]
                key = f"{name} {','.join(map(str, layout))} {n}"
                rows[key] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
                print(key, json.dumps({k: round(v, 3) for k, v in rows[key].items()}), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
