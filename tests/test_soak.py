"""``hyserve soak`` and its detectors: each detector fires on its crafted output and stays quiet on real-looking
English, Python and random token sequences; the verdict logic (explained findings, near-ties, errors); an end-to-end
soak on a tiny checkpoint with prefix caching + MTP speculation + chunked prefill that must report no corruption;
two sabotaged engines (one request's output turned into ``!!!!``, corrupted recurrent snapshots) that must be
reported with a non-zero exit; and the ``--url`` path against an in-process fake server."""

from __future__ import annotations

import argparse
import json
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from conftest import CheckpointCache
from tokenizers import Tokenizer

from hyserve.sampling_params import SamplingParams
from hyserve.testing import tokenizer_json
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
from hyserve.tools.workload import WorkloadSpec, make_conversations

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
    """Sabotage (as tests/test_prefix_cache.py): every published snapshot gets its SSM state perturbed."""
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
