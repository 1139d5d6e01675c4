"""The rows a step's chunked (prefill) kernels take, worked out once a step (``ChunkedRows`` in ``StepMetadata``) and
handed to every recurrent layer: a GDN model (Qwen3.5) and a Mamba2 model (Nemotron-H) on the CPU, with staggered
arrivals, chunked prefill, non-identity slots and n-gram verify steps that carry prefill rows.

Each layer's call is recorded: in a step, every recurrent layer gets the same object (so fla-core's memo of its
chunk indices, kept by the arguments' identity, serves every layer after the first), it holds exactly the step's
non-empty rows (their slots and offsets, worked out from the layer's own arguments), a new step gets a new object,
and a verify step's rest rows get theirs. A stale object (last step's, with other rows) is caught by the contents
check, which a sabotage below makes sure of. (On the CPU the references do not read the rows: what they change on
CUDA, fla's path, is checked on the card by ``tests/kernels/test_mamba2_cuda.py``.)
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.kernels.varlen import ChunkedRows, nonempty_rows
from hyserve.layers import gdn as gdn_layer
from hyserve.layers import mamba2 as mamba2_layer
from hyserve.model.metadata import StepMetadata
from hyserve.testing import write_tiny_checkpoint
from hyserve.testing.engine import drive, make_llm, random_prompts
from hyserve.testing.nemotron_h import write_tiny_nemotron_h_checkpoint


def test_chunked_rows_of_drops_empty_rows_and_counts_chunks() -> None:
    slots = torch.tensor([5, 2, 7, 0], dtype=torch.int64)
    qsl = torch.tensor([0, 3, 3, 70, 71], dtype=torch.int32)
    rows = ChunkedRows.of(slots, qsl, qsl.clone())
    assert rows.slots.tolist() == [5, 7, 0]
    assert rows.cu_seqlens.tolist() == [0, 3, 70, 71] and rows.cu_seqlens.dtype == torch.int64
    assert rows.cu_seqlens_cpu is not None and rows.cu_seqlens_cpu.tolist() == [0, 3, 70, 71]
    assert rows.num_chunks(64) == 1 + 2 + 1 and rows.num_chunks(16) == 1 + 5 + 1
    assert ChunkedRows.of(slots, qsl, None).num_chunks(64) is None  # no host offsets: no count without a sync


class Recorder:
    """Wraps a layer module's kernel entry (``gdn_forward`` / ``mamba2_scan``) and its layer's ``forward``: each
    entry call's ``rows`` argument, the engine step it came in, whether that step verifies, and whether the rows are
    the call's own (worked out again from the call's slots and offsets). ``stale``: the sabotage, each call handed
    the object of the call before it (at a step's first layer: the last step's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, entry: str, layer: Any,
                 stale: bool = False) -> None:
        self.calls: list[tuple[int, bool, ChunkedRows | None, bool]] = []  # (step, verify step?, rows, matches)
        self.step = -1
        self.verify_step = False
        self.previous: ChunkedRows | None = None
        real, real_forward = getattr(module, entry), layer.forward
        gdn = entry == "gdn_forward"

        def forward(layer_self: Any, x: Any, meta: StepMetadata) -> Any:
            self.verify_step = meta.verify is not None
            return real_forward(layer_self, x, meta)

        def wrapped(*args: Any, **kw: Any) -> Any:
            if gdn:
                slots, qsl, qsl_cpu = args[6], args[7], args[9] if len(args) > 9 else None
                rows = args[11] if len(args) > 11 else None
            else:
                slots, qsl, qsl_cpu, rows = args[9], args[10], kw.get("query_start_loc_cpu"), kw.get("rows")
            if stale and rows is not None:
                rows, self.previous = (self.previous if self.previous is not None else rows), rows
                if gdn:
                    args = (*args[:11], rows, *args[12:])
                else:
                    kw["rows"] = rows
            matches = True
            if rows is not None:
                want = nonempty_rows(slots, qsl, qsl_cpu)
                matches = (torch.equal(rows.slots, want[0]) and torch.equal(rows.cu_seqlens, want[1])
                           and (want[2] is None) == (rows.cu_seqlens_cpu is None)
                           and (want[2] is None or torch.equal(rows.cu_seqlens_cpu, want[2])))
            self.calls.append((self.step, self.verify_step, rows, matches))
            return real(*args, **kw)

        monkeypatch.setattr(module, entry, wrapped)
        monkeypatch.setattr(layer, "forward", forward)


def _run(path: str, family: str, monkeypatch: pytest.MonkeyPatch, stale: bool = False) -> Recorder:
    _, module, entry, layer = FAMILIES[family]
    llm = make_llm(path, max_num_batched_tokens=48, enable_prefix_caching=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    rec = Recorder(monkeypatch, module, entry, layer, stale)
    eng = llm.llm_engine
    real_step = eng.step

    def counted() -> Any:
        rec.step += 1
        return real_step()

    monkeypatch.setattr(eng, "step", counted)
    # Repetitive prompts, so that n-gram drafts exist and verify steps carry the later arrivals' prefill chunks.
    prompts = [(p[:6] * 12)[:n] for p, n in zip(random_prompts(5, [6], seed=4), [30, 70, 9, 55, 21], strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    arrivals = {0: [("a", prompts[0], params), ("b", prompts[1], params)], 3: [("c", prompts[2], params)],
                5: [("d", prompts[3], params)], 9: [("e", prompts[4], params)]}
    outs = drive(eng, arrivals)
    assert sorted(outs) == list("abcde") and all(len(o.outputs[0].token_ids) == 12 for o in outs.values())
    return rec


FAMILIES = {
    "gdn": (lambda d: write_tiny_checkpoint(d, seed=7, layer_types=["linear_attention"] * 3 + ["full_attention"]),
            gdn_layer, "gdn_forward", gdn_layer.GatedDeltaNet),
    "mamba2": (lambda d: write_tiny_nemotron_h_checkpoint(d, seed=7), mamba2_layer, "mamba2_scan",
               mamba2_layer.Mamba2Mixer),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layer_of_a_step_gets_the_steps_rows(family: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = FAMILIES[family][0](str(tmp_path / family))
    rec = _run(path, family, monkeypatch)
    by_step: dict[int, list[tuple[bool, ChunkedRows | None, bool]]] = defaultdict(list)
    for step, verify, rows, ok in rec.calls:
        by_step[step].append((verify, rows, ok))
    assert all(ok for _, _, _, ok in rec.calls), "a layer's rows are not its call's rows"
    seen: set[int] = set()
    prefill_steps = rest_steps = 0
    for step, calls in by_step.items():
        objs = {id(r) for _, r, _ in calls if r is not None}
        assert len(objs) <= 1, f"step {step}: the layers got {len(objs)} row objects"
        assert not (objs & seen), f"step {step} reused an earlier step's rows"
        seen |= objs
        if objs:
            prefill_steps += 1
            rest_steps += calls[0][0]  # a verify step whose prefill rows took the rest rows' object
    assert prefill_steps >= 4 and rest_steps >= 1, (prefill_steps, rest_steps)
    assert any(all(r is None for _, r, _ in calls) for calls in by_step.values()), "decode steps take none"


def test_a_stale_rows_object_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sabotage (each call handed the object of the call before it) is seen by the contents check."""
    path = FAMILIES["gdn"][0](str(tmp_path / "gdn"))
    rec = _run(path, "gdn", monkeypatch, stale=True)
    assert not all(ok for _, _, _, ok in rec.calls), "stale rows went unseen"


def test_metadata_without_rows_leaves_each_layer_to_work_them_out() -> None:
    """``StepMetadata.chunked_rows`` defaults to None (graphs' static metadata, decode steps): a layer then works
    its rows out itself, as before."""
    meta = StepMetadata(positions=torch.zeros(1, dtype=torch.long), query_start_loc=torch.tensor([0, 1]),
                        seq_lens=torch.tensor([1]), state_slots=torch.tensor([0]),
                        block_tables=torch.zeros(1, 1, dtype=torch.int32),
                        slot_mapping=torch.zeros(1, dtype=torch.long), max_query_len=1, max_seq_len=1)
    assert meta.chunked_rows is None


def test_chunk_indices_are_each_rows_chunks_in_order() -> None:
    """``ChunkedRows.chunk_indices``: row n's chunk j as [n, j], the non-empty rows in order, against a plain loop;
    made once per chunk size (the same object after), None without the host's offsets."""
    slots = torch.tensor([3, 1, 4, 6, 0], dtype=torch.int64)
    lens = [64, 0, 130, 1, 65]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = ChunkedRows.of(slots, qsl, qsl.clone())
    for chunk in (16, 64):
        want = [[n, j] for n, ln in enumerate(x for x in lens if x) for j in range(-(-ln // chunk))]
        got = rows.chunk_indices(chunk)
        assert got is not None and got.dtype == torch.int64 and got.tolist() == want
        assert rows.chunk_indices(chunk) is got
        assert rows.num_chunks(chunk) == len(want)
    assert ChunkedRows.of(slots, qsl, None).chunk_indices(64) is None
