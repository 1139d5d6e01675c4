"""The table of benchmarks/results/cpu/snapshot_policy_2026-12-07b/README.md: the earlier rule (52cf7ec's
prefix_cache.py, loaded from git) against the current one on the seed's agents, six seeds each."""
import importlib.util, json, statistics, subprocess, sys, tempfile
sys.path.insert(0, "benchmarks")
import snapshot_policy_sim as sim
from hyserve.cache.prefix_cache import PrefixCache
src = subprocess.run(["git", "show", "52cf7ec:hyserve/cache/prefix_cache.py"], capture_output=True, text=True, check=True).stdout
path = tempfile.mktemp(suffix=".py"); open(path, "w").write(src)
spec = importlib.util.spec_from_file_location("pc_earlier", path)
earlier = importlib.util.module_from_spec(spec); sys.modules["pc_earlier"] = earlier; spec.loader.exec_module(earlier)
rows = {}
for layout in ((26571, 32, 57, 55), (20970, 32, 96, 55)):
    for n in (256, 768):
        for name, cls in (("earlier", earlier.PrefixCache), ("new", PrefixCache)):
            runs = [sim.simulate(layout, n, s, cls) for s in range(6)]
            rows[f"{name} {','.join(map(str, layout))} {n}"] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
            print(f"{name:8s} {layout} {n}", json.dumps({k: round(v, 3) for k, v in rows[f'{name} {",".join(map(str, layout))} {n}'].items()}), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
