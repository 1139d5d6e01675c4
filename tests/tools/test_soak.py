"""``hyserve soak`` and its detectors: each detector fires on its crafted output and stays quiet on real-looking
English, Python and random token sequences; the verdict logic (explained findings, near-ties, errors); an end-to-end
soak on a tiny checkpoint with prefix caching + MTP speculation + chunked prefill that must report no corruption;
two sabotaged engines (one request's output turned into ``!!!!``, corrupted recurrent snapshots) that must be
reported with a non-zero exit; and the ``--url`` path against an in-process fake server. ``--abort-fraction``: the
plan (the requested share, every abort point), an offline soak that aborts at each point with steps in flight and
checks every other request, a sabotaged engine whose aborts corrupt another request (reported), and the client
that hangs up."""

from __future__ import annotations

import argparse
import json
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer

from hyserve.sampling_params import SamplingParams
from hyserve.testing import tokenizer_json
from hyserve.testing.families import CheckpointCache
from hyserve.tools import soak
from hyserve.tools.client import Completion, parse_prometheus
from hyserve.tools.detectors import (
    detect_degenerate,
    finding_kind,
    first_divergence,
    punctuation_runs,
    trailing_cycle,
    trailing_run,
)
from hyserve.tools.workload import ABORT_PHASES, WorkloadSpec, make_abort_plan, make_conversations

ENGLISH = """\
The committee met on Tuesday to review the budget for the coming year. After a long discussion, members agreed to
increase funding for the library and to postpone the renovation of the community centre until the spring. Several
residents asked whether the new bus route would reach the hospital; the council promised an answer by next month.
"It has been a difficult year," said the chair, "but we are in a better position than we expected!" Questions?
Send them to the office: we read every message, and we reply within a week.
"""

PYTHON = '''\
def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping intervals; the input need not be sorted."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


# ------------------------------------------------------------------ main
if __name__ == "__main__":
    print(merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)]))  # ==> [(1, 6), (8, 10), (15, 18)]
'''

MARKDOWN = """\
Results
=======

| model | score |
| ----- | ----- |
| tiny  | 0.5   |

Wait... really?! Yes!!! ---------------- ************ ________ ######## ........ the end.
"""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json())


def kinds(findings: list[str]) -> set[str]:
    return {finding_kind(f) for f in findings}


# ------------------------------------------------------------------------------------------------------ detectors


@pytest.mark.parametrize("text", [ENGLISH, PYTHON, MARKDOWN])
def test_detectors_quiet_on_normal_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text).ids
    assert detect_degenerate(ids, text, "stop") == []
    assert detect_degenerate(ids, text, "length") == []
    assert detect_degenerate(None, text, "stop") == []  # the word-level fallback too
    for cut in (16, 40, 100):  # and every prefix a max_tokens could cut
        assert detect_degenerate(ids[:cut], tok.decode(ids[:cut]), "length") == []


def test_detectors_quiet_on_random_tokens() -> None:
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 96)
        ids = [rng.randrange(512) for _ in range(n)]
        assert detect_degenerate(ids, None, "length") == [], ids


def test_loop_fires_on_a_token_repeated_to_the_end(tok: Tokenizer) -> None:
    head = tok.encode("The answer is").ids
    f = detect_degenerate(head + [123] * 20, "The answer is duct duct duct", "length")
    assert kinds(f) == {"loop"}, f
    assert "123" in f[0] and "20 times" in f[0]
    # a short run, or one that does not reach the end, or covers too little of the output, is not a loop
    assert detect_degenerate(head + [123] * 5, None, "length") == []
    assert detect_degenerate([123] * 20 + head, None, "length") == []
    assert detect_degenerate(list(range(100, 140)) + [7] * 9, None, "length") == []  # 9 of 49 < 50 %
    # the thresholds are parameters
    assert kinds(detect_degenerate(head + [123] * 5, None, "length", min_run=4, min_fraction=0.1)) == {"loop"}


def test_cycle_fires_on_a_short_period_repeated_to_the_end(tok: Tokenizer) -> None:
    text = "Sure, here it is:" + " duct" * 12
    ids = tok.encode(text).ids
    f = detect_degenerate(ids, text, "length")
    assert kinds(f) == {"cycle"}, f
    assert "period" in f[0]
    # words when the server returned no token ids
    assert kinds(detect_degenerate(None, "ok " + "duct " * 12, "stop")) == {"loop"}
    assert kinds(detect_degenerate(None, "ok " + "a b " * 10, "stop")) == {"cycle"}
    for period in range(2, 9):
        unit = list(range(300, 300 + period))
        got = detect_degenerate([1, 2, 3] + unit * max(4, 16 // period + 1), None, "length")
        assert kinds(got) == {"cycle"} and f"period {period})" in got[0], (period, got)
    # three repeats are not enough; period 9 is beyond the default
    assert detect_degenerate(list(range(40)) + [5, 6, 7] * 3, None, "length") == []
    assert detect_degenerate([1] + list(range(200, 209)) * 5, None, "length") == []


def test_punctuation_fires_on_runs(tok: Tokenizer) -> None:
    for text in ("Of course!!!!!!!!!!!!", "!!!!!!!!", "好的！！！！！！！！！", "? ? ? ? ? ? ? ?", "ok,,,,,,,,,,"):
        f = detect_degenerate(tok.encode(text).ids if text.isascii() else None, text, "stop")
        assert "punctuation" in kinds(f), (text, f)
    assert punctuation_runs("Yes!!! No?! " + "-" * 30 + "=" * 30 + "." * 20) == []
    assert punctuation_runs("a!!!!!!!b", min_len=8) == []
    assert punctuation_runs("a!!!!!!!!b", min_len=8) == [(1, "!!!!!!!!")]


def test_the_reported_bang_output_fires_loop_and_punctuation(tok: Tokenizer) -> None:
    ids = tok.encode("Clicking the button").ids + [tok.token_to_id("!")] * 24
    f = detect_degenerate(ids, tok.decode(ids), "length")
    assert kinds(f) == {"loop", "punctuation"}, f


def test_empty_fires_only_with_a_normal_finish_reason() -> None:
    assert kinds(detect_degenerate([], "", "stop")) == {"empty"}
    assert kinds(detect_degenerate([], None, "length")) == {"empty"}
    assert kinds(detect_degenerate([448], "", "stop")) == {"empty"}  # EOS only: empty content
    assert kinds(detect_degenerate([220, 198], " \n", "length")) == {"empty"}
    assert kinds(detect_degenerate(None, "", "stop")) == {"empty"}
    for reason in (None, "abort", "error"):
        assert detect_degenerate([], "", reason) == []
    assert detect_degenerate([5], "x", "stop") == []


def test_helpers() -> None:
    assert trailing_run([]) == (None, 0)
    assert trailing_run([1, 2, 2, 2]) == (2, 3)
    assert trailing_cycle([9, 1, 2, 1, 2, 1, 2]) == (2, 6)
    assert trailing_cycle([1, 1, 1, 1]) == (0, 0)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [4]) == 0
    with pytest.raises(ValueError):
        finding_kind("nonsense")
    m = parse_prometheus('# HELP x y\nhyserve:prefix_cache_hits_total{model_name="a b"} 12\nfoo 3.5\n')
    assert m["hyserve:prefix_cache_hits"] == 12.0 and m["foo"] == 3.5


def test_workload_shares_prefixes_and_is_deterministic() -> None:
    spec = WorkloadSpec(num_conversations=6, turns=3, prefix_len=40, message_len=10, fork_every=3)
    a = make_conversations(spec, seed=1, vocab_size=100)
    assert a == make_conversations(spec, seed=1, vocab_size=100)
    assert all(c.system_prefix == a[0].system_prefix and len(c.system_prefix) == 40 for c in a)
    assert a[2].messages[0] == a[1].messages[0] and a[1].messages[0] != a[0].messages[0]  # a fork
    assert all(c.num_turns == 3 for c in a)
    p1 = a[0].next_prompt(1, a[0].first_prompt(), [7, 8])
    assert p1[: len(a[0].first_prompt()) + 2] == [*a[0].first_prompt(), 7, 8]
    assert len(p1) + spec.max_tokens <= spec.max_total_len()


# ------------------------------------------------------------------------------------------------------ verdicts


def rec(ids: list[int] | None, text: str | None = "x", reason: str | None = "length", error: str | None = None,
        rid: str = "r") -> soak.TurnRecord:
    return soak.TurnRecord(rid, 0, 0, [1, 2, 3], Completion(ids, text, reason, error=error))


def test_verdicts() -> None:
    loop = [9] * 16
    recs = [rec(loop), rec(loop), rec([1, 2, 3, 4]), rec(None, error="HTTP 500"), rec([1, 2, 3, 4])]
    replays = [
        Completion(loop, "x", "length"),  # the clean engine loops too: the model's own behaviour
        Completion([1, 2, 3, 4] + [5] * 12, "x", "length"),  # only the soaked engine loops: corruption
        Completion([1, 2, 7, 4], "x", "length", top_logprobs=[{}, {}, {7: -1.0, 3: -1.001}, {}]),  # near-tie
        Completion([1], "x", "length"),
        Completion([1, 2, 7, 4], "x", "length", top_logprobs=[{}, {}, {7: -1.0, 3: -3.0}, {}]),  # a real flip
    ]
    checks = soak.check_requests(recs, replays, None, tol=2e-3)
    assert [c.reasons for c in checks] == [[], ["divergence", "loop"], [], ["error"], ["divergence"]]
    assert checks[0].explained and checks[0].findings
    assert checks[2].near_tie and checks[2].divergence == 2
    s = soak.summarize(checks, {"hyserve:prefix_cache_hits": 30.0, "hyserve:prefix_cache_queries": 40.0,
                                "hyserve:spec_decode_num_drafts": 10.0,
                                "hyserve:spec_decode_num_accepted_tokens": 5.0})
    assert (s["loops"], s["divergences"], s["near_ties_excused"], s["errors"], s["corrupt_requests"]) == (1, 2, 1, 1, 3)
    assert s["prefix_cache_hit_rate"] == 0.75 and s["mean_acceptance_length"] == 1.5 and not s["ok"]
    assert "CORRUPTION in 3 requests" in soak.format_table(s)
    # without a replay, a finding is explained only by the reference
    ref_ok: soak.ReferenceFn = lambda p, o: {"ok": True}
    assert soak.check_requests([rec(loop)], None, ref_ok, tol=1e-3)[0].reasons == []
    assert soak.check_requests([rec(loop)], None, None, tol=1e-3)[0].reasons == ["loop"]
    ref_bad: soak.ReferenceFn = lambda p, o: {"ok": False, "position": 0}
    assert soak.check_requests([rec([1, 2])], None, ref_bad, tol=1e-3)[0].reasons == ["reference"]


# ------------------------------------------------------------------------------------------------------ end to end


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyserve")
    soak.register(p.add_subparsers(dest="command", required=True))
    return p


def run_soak(argv: list[str]) -> tuple[int, dict[str, Any]]:
    args = parser().parse_args(["soak", *argv])
    rc = args.func(args)
    with open(args.report, encoding="utf-8") as f:
        return rc, json.load(f)


SMALL = ["--conversations", "4", "--turns", "3", "--concurrency", "3", "--prefix-len", "64", "--message-len", "16",
         "--max-tokens", "12"]


def test_help_lists_every_flag_with_its_default() -> None:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices["soak"]
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and "default" in action.help.lower(), action.option_strings


def test_soak_alone_runs_every_feature_without_corruption(tmp_path, capsys) -> None:
    """No MODEL_DIR: a tiny checkpoint with an MTP head; prefix caching, MTP k=2, chunked prefill (budget 32)."""
    rc, rep = run_soak([*SMALL, "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    s, cfg = rep["summary"], rep["config"]
    assert rc == 0, out
    assert "OK: no corruption" in out and "prefix-cache hit rate" in out and "mean acceptance length" in out
    assert s["ok"] and s["requests"] == 12 and s["corrupt_requests"] == 0
    assert s["replayed"] == 12 and s["reference_checked"] == 12
    assert cfg["enable_prefix_caching"] and cfg["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert cfg["max_num_batched_tokens"] == 32 and cfg["tol"] == soak.TOL_FLOAT32
    assert all(r["prompt_len"] > 32 for r in rep["requests"])  # every prompt was prefilled in chunks
    assert s["prefix_cache_hit_rate"] > 0.5 and s["spec_decode_num_drafts"] > 0
    assert sum(r["num_cached_tokens"] or 0 for r in rep["requests"]) == s["prefix_cache_hits"]


def _bang_loop(llm: Any, victim: str = "soak-c1-t1", start: int = 2) -> None:
    """Sabotage: from output position ``start`` on, the victim's output becomes the ``!`` token (the reports'
    symptom), text included, and the next turn is built from it."""
    eng = llm.llm_engine
    bang = eng.tokenizer.token_to_id("!")
    original = eng.output_processor.make_output

    def make_output(req: Any) -> Any:
        out = original(req)
        if out is not None and out.request_id == victim:
            c = out.outputs[0]
            c.token_ids = c.token_ids[:start] + [bang] * max(0, len(c.token_ids) - start)
            c.text = eng.tokenizer.decode(c.token_ids)
        return out

    eng.output_processor.make_output = make_output


def _corrupt_snapshots(llm: Any) -> None:
    """Sabotage (as tests/cache/test_prefix_cache.py): every published snapshot gets its SSM state perturbed."""
    eng = llm.llm_engine
    original = eng.scheduler.update_from_output

    def update(*a: Any) -> Any:
        ran = original(*a)
        pool = eng.runner.state_pool
        if pool.num_snapshots:
            for ssm in pool.ssm_states:
                ssm[pool.snapshot_entry(0):] += 0.05
        return ran

    eng.scheduler.update_from_output = update


def _sabotage_main(monkeypatch: pytest.MonkeyPatch, sabotage: Callable[[Any], None]) -> None:
    original = soak.build_llm

    def build(args: argparse.Namespace, model: str, role: str) -> Any:
        llm = original(args, model, role)
        if role == "main":
            sabotage(llm)
        return llm

    monkeypatch.setattr(soak, "build_llm", build)


def test_soak_reports_a_bang_loop(ckpts: CheckpointCache, tmp_path, monkeypatch, capsys) -> None:
    path = ckpts.get("causal", "gdn3_attn1", with_mtp=True)
    _sabotage_main(monkeypatch, _bang_loop)
    rc, rep = run_soak([path, *SMALL, "--ignore-eos", "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    s = rep["summary"]
    assert rc == 1, out
    assert "CORRUPTION in 1 requests" in out and "soak-c1-t1" in out
    assert (s["loops"], s["punctuation_runs"], s["divergences"], s["reference_failures"]) == (1, 1, 1, 1)
    bad = next(r for r in rep["requests"] if r["corrupt"])
    assert bad["request_id"] == "soak-c1-t1" and bad["divergence"] == 2 and bad["reference"]["position"] == 2
    assert set(bad["reasons"]) == {"loop", "punctuation", "divergence", "reference"}


def test_soak_reports_corrupted_snapshots(ckpts: CheckpointCache, tmp_path, monkeypatch) -> None:
    path = ckpts.get("causal", "gdn3_attn1", with_mtp=True)
    _sabotage_main(monkeypatch, _corrupt_snapshots)
    rc, rep = run_soak([path, *SMALL, "--ignore-eos", "--report", str(tmp_path / "r.json")])
    s = rep["summary"]
    assert rc == 1
    assert s["divergences"] >= 1 and s["reference_failures"] >= 1 and s["corrupt_requests"] >= 1
    assert all(r["turn"] > 0 or r["conversation"] > 0 for r in rep["requests"] if r["corrupt"])  # needs a hit


# ------------------------------------------------------------------------------------------------------ --url


class FakeServer:
    """An in-process stand-in for ``hyserve serve`` (``httpx.MockTransport`` handler) backed by an offline ``LLM``:
    ``/v1/models``, ``/metrics`` and ``/v1/completions`` with token-id prompts, ``return_token_ids``, ``logprobs``
    (as ``token_id:N``) and streaming."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.lock = threading.Lock()
        self.num_completions = 0

    def __call__(self, request: Any) -> Any:
        import httpx

        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if path == "/metrics":
            with self.lock:
                m = self.llm.get_metrics()
            lines = [f"{k}_total {v}" for k, v in m.items() if isinstance(v, (int, float))]
            return httpx.Response(200, text="\n".join(lines) + "\n")
        if path != "/v1/completions":
            return httpx.Response(404, json={"error": "not found"})
        body = json.loads(request.content)
        params = SamplingParams(temperature=body.get("temperature", 1.0), max_tokens=body.get("max_tokens", 16),
                                ignore_eos=body.get("ignore_eos", False), logprobs=body.get("logprobs"))
        with self.lock:
            out = self.llm.generate({"prompt_token_ids": body["prompt"]}, params, use_tqdm=False)[0]
            self.num_completions += 1
        c = out.outputs[0]
        if body.get("stream"):
            chunks = [{"choices": [{"index": 0, "text": "t", "token_ids": [t], "finish_reason": None}]}
                      for t in c.token_ids]
            chunks[-1]["choices"][0]["finish_reason"] = c.finish_reason
            chunks.append({"choices": [], "usage": {"completion_tokens": len(c.token_ids)}})
            text = "".join(f"data: {json.dumps(ch)}\n\n" for ch in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        choice: dict[str, Any] = {"index": 0, "text": c.text, "finish_reason": c.finish_reason,
                                  "token_ids": c.token_ids, "prompt_token_ids": body["prompt"]}
        if c.logprobs is not None:
            choice["logprobs"] = {
                "tokens": [f"token_id:{t}" for t in c.token_ids],
                "token_logprobs": [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)],
                "top_logprobs": [{f"token_id:{k}": v.logprob for k, v in e.items()} for e in c.logprobs],
            }
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(c.token_ids),
                 "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
        return httpx.Response(200, json={"object": "text_completion", "choices": [choice], "usage": usage})


def use_fake_server(monkeypatch: pytest.MonkeyPatch, module: Any, server: FakeServer) -> None:
    """Route ``module.CompletionsClient`` to ``server`` instead of the network."""
    import httpx

    real = module.CompletionsClient

    def client(*a: Any, **kw: Any) -> Any:
        return real(*a, transport=httpx.MockTransport(server), **kw)

    monkeypatch.setattr(module, "CompletionsClient", client)


def test_soak_against_a_server(ckpts: CheckpointCache, tmp_path, monkeypatch) -> None:
    """--url: conversations over /v1/completions (threads), replay on a local clean engine, reference check."""
    pytest.importorskip("httpx")
    from hyserve import LLM

    path = ckpts.get("causal", "gdn3_attn1", with_mtp=True)
    server = FakeServer(LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                            max_num_batched_tokens=32))
    use_fake_server(monkeypatch, soak, server)
    rc, rep = run_soak([path, "--url", "http://fake:8000", "--conversations", "3", "--turns", "2",
                        "--concurrency", "3", "--prefix-len", "48", "--message-len", "12", "--max-tokens", "8",
                        "--report", str(tmp_path / "r.json")])
    s = rep["summary"]
    assert rc == 0, s
    assert s["requests"] == 6 and s["replayed"] == 6 and s["reference_checked"] == 6 and server.num_completions == 6
    assert rep["config"]["served_model_name"] == "tiny"
    assert s["prefix_cache_queries"] and s["prefix_cache_hit_rate"] is not None


# ---------------------------------------------------------------------------------------------------- --abort-fraction


def test_abort_plan_picks_the_fraction_at_every_point() -> None:
    spec = WorkloadSpec(num_conversations=10, turns=4, max_tokens=8, abort_fraction=0.3)
    plan = make_abort_plan(spec, seed=2)
    assert len(plan) == 12 and plan == make_abort_plan(spec, seed=2) and plan != make_abort_plan(spec, seed=3)
    assert all(0 <= c < 10 and 0 <= t < 4 for c, t in plan)
    assert {p.phase for p in plan.values()} == set(ABORT_PHASES)
    assert len({t for _, t in plan}) > 1 and len({c for c, _ in plan}) > 3  # spread over turns and conversations
    for p in plan.values():
        assert 0.05 <= p.prompt_fraction <= 0.95 and 1 <= p.num_tokens <= 7 and 0 <= p.delay_s <= 0.5
        assert 0 <= p.lag_steps <= 2
    assert make_abort_plan(WorkloadSpec(num_conversations=10, turns=4), seed=2) == {}  # the default: none
    assert len(make_abort_plan(WorkloadSpec(num_conversations=10, turns=4, abort_fraction=1.0))) == 40
    one = make_abort_plan(WorkloadSpec(num_conversations=10, turns=4, max_tokens=1, abort_fraction=0.5))
    assert {p.phase for p in one.values()} <= {"queued", "prefill"}  # no token to abort before
    with pytest.raises(ValueError, match="abort_fraction"):
        WorkloadSpec(abort_fraction=1.5)


ABORTS = ["--conversations", "6", "--turns", "3", "--concurrency", "4", "--prefix-len", "64", "--message-len", "16",
          "--max-tokens", "12", "--ignore-eos", "--async-scheduling", "--abort-fraction", "0.5"]


def test_soak_aborts_at_every_point_and_checks_the_others(ckpts: CheckpointCache, tmp_path, capsys) -> None:
    """Async scheduling (a step in flight between two step() calls), MTP, prefix caching, chunked prefill: half the
    requests are aborted, before scheduling, mid-prefill and mid-decode, some with their own step in flight; they
    are reported and not checked, their conversations go on, and every other request is checked clean."""
    path = ckpts.get("causal", "gdn3_attn1", with_mtp=True)
    rc, rep = run_soak([path, *ABORTS, "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    s = rep["summary"]
    assert rc == 0, out
    assert "aborted mid-flight (not checked)" in out and "OK: no corruption" in out
    assert rep["config"]["workload"]["abort_fraction"] == 0.5
    assert s["requests"] == 18 and s["aborts_planned"] == 9 and s["aborted"] == 9 and s["engine_aborts"] == 9
    assert all(n >= 1 for n in s["aborted_by_phase"].values()), s["aborted_by_phase"]
    assert s["aborted_with_own_step_in_flight"] >= 1
    assert s["checked"] == 9 and s["replayed"] == 9 and s["reference_checked"] == 9 and s["corrupt_requests"] == 0
    aborted = [r for r in rep["requests"] if r.get("aborted")]
    assert len(aborted) == 9
    for r in aborted:
        a = r["abort"]
        assert r["finish_reason"] == "abort" and not r["corrupt"] and r["reasons"] == []
        assert r["divergence"] is None and r["reference"] is None and "replay_token_ids" not in r
        assert r["output_len"] == a["output_tokens"] < 12  # partial: the tokens received
        assert (a["phase"] == "decode") == (a["output_tokens"] > 0)
        assert (a["phase"] == "queued") == (a["prompt_scheduled"] == 0)
    # conversations go on after an abort: every turn ran, and a turn's prompt holds what its predecessor received
    by_turn = {(r["conversation"], r["turn"]): r for r in rep["requests"]}
    assert len(by_turn) == 18
    for (c, t), r in by_turn.items():
        if t:
            prev = by_turn[(c, t - 1)]
            assert r["prompt_len"] > prev["prompt_len"] + prev["output_len"]


def _aborts_corrupt_another(victims: list[str]) -> Callable[[Any], None]:
    """Sabotage (the failure class of an abort landing on another request's memory): every abort also scrambles the
    recurrent state of another running request that has computed tokens (its name goes to ``victims``)."""

    def sabotage(llm: Any) -> None:
        eng = llm.llm_engine
        original = eng.abort_request

        def abort_request(request_id: Any) -> None:
            others = [r for r in eng.scheduler.running if r.request_id != request_id and r.state_slot is not None
                      and r.num_computed_tokens > 0]
            if others:
                victim = others[0]
                victims.append(victim.request_id)
                pool = eng.runner.state_pool
                for t in pool.ssm_states:
                    t[victim.state_slot] += 0.5
            original(request_id)

        eng.abort_request = abort_request

    return sabotage


def test_soak_reports_aborts_that_corrupt_another_request(ckpts: CheckpointCache, tmp_path, monkeypatch,
                                                          capsys) -> None:
    path = ckpts.get("causal", "gdn3_attn1", with_mtp=True)
    victims: list[str] = []
    _sabotage_main(monkeypatch, _aborts_corrupt_another(victims))
    rc, rep = run_soak([path, *ABORTS, "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    s = rep["summary"]
    assert rc == 1, out
    assert victims and s["aborted"] == 9 and s["corrupt_requests"] >= 1 and s["divergences"] >= 1
    corrupt = [r for r in rep["requests"] if r["corrupt"]]
    assert all(not r.get("aborted") and r["request_id"] in victims for r in corrupt), (corrupt, victims)
    assert f"CORRUPTION in {s['corrupt_requests']} requests" in out
    # the same broken engine without aborts is never triggered: the abort mode is what exposes it
    victims.clear()
    rc, rep = run_soak([path, *ABORTS[:-2], "--report", str(tmp_path / "r0.json")])
    assert rc == 0 and not victims and rep["summary"]["aborted"] == 0 and "aborted" not in rep["requests"][0]


def test_client_abandons_requests() -> None:
    """``CompletionsClient.abandon`` against a mock server streaming one token per chunk: a stream closed after N
    tokens, before its first chunk, one that finished first, and a plain request given up on before the answer."""
    httpx = pytest.importorskip("httpx")
    from hyserve.tools.client import CompletionsClient

    def handler(request: Any) -> Any:
        body = json.loads(request.content)
        if not body.get("stream"):
            raise httpx.ReadTimeout("no answer yet", request=request)
        ids = list(range(100, 100 + body["max_tokens"]))
        chunks = [{"choices": [{"text": "t", "token_ids": [t], "finish_reason": None}]} for t in ids]
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    client = CompletionsClient("http://fake", "tiny", transport=httpx.MockTransport(handler))
    comp, abandoned = client.abandon([1, 2], max_tokens=8, after_tokens=3)
    assert abandoned and comp.token_ids == [100, 101, 102] and comp.finish_reason == "abort"
    comp, abandoned = client.abandon([1, 2], max_tokens=8, after_tokens=0)
    assert abandoned and comp.token_ids == [] and comp.finish_reason == "abort"
    comp, abandoned = client.abandon([1, 2], max_tokens=2, after_tokens=5)  # finished first: a whole answer
    assert not abandoned and comp.token_ids == [100, 101] and comp.finish_reason == "length" and comp.error is None
    comp, abandoned = client.abandon([1, 2], max_tokens=8, stream=False, delay_s=0.01)
    assert abandoned and comp.token_ids == [] and comp.finish_reason == "abort"
    client.close()
