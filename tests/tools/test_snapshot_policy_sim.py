"""``benchmarks/snapshot_policy_sim.py``: the seed's agents on the prefix cache's API. Its episodes give each step's
prompt as the previous step's prompt and answer verbatim until the window of screenshots slides; its figures stay
under the trace's ideal and near it with room for every point, fall with a tight budget, and fall to nothing for a
cache that keeps no snapshot (the harness measures the cache, not itself)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hyserve.cache.prefix_cache import PrefixCache

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import snapshot_policy_sim as sim  # noqa: E402


def test_a_step_extends_the_previous_one_until_the_window_slides() -> None:
    trace = sim.Trace()
    ep = sim.Episode(trace, 0, list(range(trace.prefix_len)), seed=0)
    assert ep.num_steps >= 4
    for s in range(ep.num_steps):
        ep.answers.append([s] * ep.output_lens[s])
    for s in range(ep.num_steps - 1):
        prev, prev_spans = ep.prompt(s)
        cur, spans = ep.prompt(s + 1)
        assert len(spans) == min(s + 2, 3) and all(sp.length == sim.SHOT for sp in spans)
        if s < 2:  # nothing turned into text: the previous prompt and its answer come back whole
            assert cur[:len(prev) + len(ep.answers[s])] == prev + ep.answers[s]
        else:  # the oldest screenshot turned into text: shared up to the previous step's first image
            first = prev_spans[0].offset
            assert cur[:first] == prev[:first] and cur[first:first + sim.SHOT] != prev[first:first + sim.SHOT]
        rec = {"episode": 0, "step": s + 1, "prompt": len(cur), "cached": 0}
        best = sim.best_depth(trace, rec, {0: ep})
        assert best % sim.BS == 0
        assert best == ((len(prev) + len(ep.answers[s])) // sim.BS * sim.BS if s < 2
                        else prev_spans[0].offset // sim.BS * sim.BS)


class KeepsNothing(PrefixCache):
    def reserve_entry(self, spare_only: bool = False) -> int | None:
        return None

    def reserve_snapshot(self, req, position):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize("requests", [96])
def test_the_figures_follow_the_budget(requests: int) -> None:
    ample = sim.simulate((26571, 32, 4096, 0), requests, 0)
    tight = sim.simulate((26571, 32, 12, 0), requests, 0)
    nothing = sim.simulate((26571, 32, 57, 55), requests, 0, KeepsNothing)
    for run in (ample, tight, nothing):
        assert 0 <= run["hit_rate"] <= run["ideal_hit_rate"] + 1e-9
    assert ample["hit_rate"] > 0.95 * ample["ideal_hit_rate"]
    assert ample["second_of_best"] > 0.97 and ample["third_of_best"] > 0.97
    assert tight["hit_rate"] < ample["hit_rate"] - 0.05
    assert nothing["hit_rate"] == 0.0 and nothing["offloads"] == 0


def test_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    monkeypatch.setattr(sys, "argv", ["snapshot_policy_sim.py", "--requests", "48", "--seeds", "0", "--out", str(out)])
    sim.main()
    rows = json.loads(out.read_text())
    assert set(rows) == {"0"} and 0 < rows["0"]["hit_rate"] <= rows["0"]["ideal_hit_rate"]
    assert capsys.readouterr().out.startswith("0 {")
    monkeypatch.setattr(sys, "argv", ["snapshot_policy_sim.py", "--layout", "1,2"])
    with pytest.raises(SystemExit, match="four integers"):
        sim.main()
