"""The state operations of a step around its forward: slot resets and snapshot copy-ins before it; the commit of
verified candidates and the snapshot copy-outs after it (docs/design.md invariants 2, 3, 10, 12).

Every operation addresses state through explicit slot and entry ids (invariant 1). With CUDA graphs a verify step's
commit and its candidate snapshots each run as one replay over persistent buffers (``commit``, ``snapshot``).
"""

from __future__ import annotations

import torch

from hyserve.cache.specs import CacheSpecs
from hyserve.cache.state_pool import StatePool
from hyserve.model.base import CausalLM, RecurrentLayer
from hyserve.scheduler.output import ScheduledRow
from hyserve.utils import device_tensor
from hyserve.worker.cuda_graphs import GraphBody, StepGraphs, weak_forward
from hyserve.worker.input_batch import InputBatch


class StateOps:
    """The step's operations on the state pool and the recurrent layers' verify scratch (one scratch set per
    uncommitted verify step of a pipeline stage before the last; one otherwise)."""

    def __init__(self, model: CausalLM, state_pool: StatePool, batch: InputBatch, graphs: StepGraphs,
                 specs: CacheSpecs, num_speculative_tokens: int, num_scratch_sets: int, max_num_seqs: int) -> None:
        self.model = model
        self.state_pool = state_pool
        self.batch = batch
        self.graphs = graphs
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = batch.block_size
        self.scratch: list[list[dict[str, torch.Tensor]]] = []
        if num_speculative_tokens:
            # Per recurrent layer and tensor of its scratch spec: (max_num_seqs, k + 1, *shape), one per position.
            self.scratch = [[spec.allocate((max_num_seqs, num_speculative_tokens + 1), batch.device)
                             for spec in specs.scratch_specs] for _ in range(num_scratch_sets)]
            self.bind_scratch(0)

    def bind_scratch(self, index: int) -> None:
        for layer, tensors in zip(self.model.recurrent_layers(), self.scratch[index], strict=True):
            layer.bind_verify_scratch(tensors)

    def graph_bodies(self) -> dict[str, GraphBody]:
        return {"commit": GraphBody(weak_forward(self._graph_commit), lambda n: self.fill_commit([], n)),
                "snapshot": GraphBody(weak_forward(self._graph_snapshot), self._snapshot_pads)}

    # ------------------------------------------------------------------ before the forward

    def offload_snapshots(self, moves: list[tuple[int, int]]) -> None:
        """The prefix cache's moves of evicted snapshots to its host tier (``SchedulerOutput.snapshot_offloads``):
        first of a step, before anything of it writes those entries."""
        self.state_pool.offload(moves)

    def load_states(self, rows: list[ScheduledRow]) -> None:
        # A request's slot starts from zeros, or from the snapshot of its prefix hit (copied, never shared), on the
        # device or in the host tier.
        self.state_pool.reset([r.state_slot for r in rows if r.reset_state])
        loads = [(r.load_snapshot, r.state_slot) for r in rows if r.load_snapshot is not None]
        self.state_pool.copy([e for e, _ in loads], [s for _, s in loads])
        self.state_pool.load_host([(r.load_host_snapshot, r.state_slot) for r in rows
                                   if r.load_host_snapshot is not None])

    # ------------------------------------------------------------------ after the forward

    def fill_commit(self, num_accepted: list[int], size: int) -> None:
        """The accepted counts of the verify rows, then -1 up to ``size`` rows (pad rows commit nothing)."""
        n = len(num_accepted)
        host = self.batch.np_bufs["num_accepted"]
        host[:n] = num_accepted
        host[n:size] = -1
        self.batch.dev_bufs["num_accepted"][:size].copy_(self.batch.host_bufs["num_accepted"][:size],
                                                         non_blocking=True)

    def commit_verified(self, num_accepted: list[int] | torch.Tensor) -> None:
        """Live slots of the last step's verify rows take candidate ``num_accepted[r]`` (-1: leave untouched): one
        replay of the ``commit`` graph when the verify graph ran the step (its pad rows are on the pad slot). The
        counts come from the host, or are already on the device (the device chain). After a step of one-token verify
        rows the layers that advanced their slots in place are left out (``committing_layers``)."""
        last = self.batch.last_meta
        vm = last.verify if last is not None else None
        if vm is None:
            return
        n = len(num_accepted)
        assert n == vm.num_rows
        layers = self.committing_layers(self._one_token_step())
        if not layers:
            return
        size = self.batch.verify_graph_size
        graphs = self.graphs.get("commit") if size is not None else None
        # The graph commits every recurrent layer: only where every one still has candidates to commit.
        use_graph = graphs is not None and size in graphs.sizes and len(layers) == len(self.model.recurrent_layers())
        buf = self.batch.dev_bufs["num_accepted"]
        if isinstance(num_accepted, torch.Tensor):
            buf[:n].copy_(num_accepted)
            if use_graph:
                buf[n:size].fill_(-1)  # pad rows commit nothing
        elif use_graph:
            self.fill_commit(num_accepted, size)  # type: ignore[arg-type]
        else:
            self.batch.np_bufs["num_accepted"][:n] = num_accepted
            buf[:n].copy_(self.batch.host_bufs["num_accepted"][:n], non_blocking=True)
        if use_graph:
            graphs.run(size)  # type: ignore[union-attr,arg-type]
            return
        for layer in layers:
            layer.commit_verified(vm.state_slots, buf[:n])

    def committing_layers(self, one_token: bool) -> list[RecurrentLayer]:
        """The recurrent layers a verify step leaves candidates to commit in: all, or after a step whose verify rows
        all hold one token, those that do not advance such rows in place (``verifies_one_token_rows_in_place``)."""
        return [layer for layer in self.model.recurrent_layers() if not _in_place(layer, one_token)]

    def _one_token_step(self) -> bool:
        """Whether the last step's verify rows all held one token (its metadata's layout, graph or eager)."""
        last = self.batch.last_meta
        return last is not None and last.verify is not None and last.verify.max_query_len == 1

    def _graph_commit(self, size: int) -> tuple[torch.Tensor, ...]:
        """``commit`` graph: every recurrent layer's commit of ``size`` verify rows (slots and accepted counts from
        the persistent buffers; -1 rows, pads included, are left alone)."""
        slots, acc = self.batch.dev_bufs["state_slots"][:size], self.batch.dev_bufs["num_accepted"][:size]
        for layer in self.model.recurrent_layers():
            layer.commit_verified(slots, acc)
        return ()

    def save_snapshots(self, rows: list[ScheduledRow], num_accepted: list[int] | torch.Tensor) -> None:
        """The step's snapshot copy-outs (entries the scheduler reserved): a row's slot after the forward, or a
        verify row's candidate state at the reserved position if the accepted length reached it. With the counts
        on the device (the device chain) every candidate is copied, an unreached one into the pad slot (nobody's)
        instead of its entry, which the scheduler then releases."""
        device_counts = num_accepted if isinstance(num_accepted, torch.Tensor) else None
        on_device = device_counts is not None
        src, dst = [], []
        cand_rows, cand_pos, cand_dst = [], [], []
        behind_rows, behind_dst = [], []
        for i, row in enumerate(rows):
            if row.snapshot_entry is not None:
                src.append(row.state_slot)
                dst.append(row.snapshot_entry)
            if row.candidate_snapshot is not None and row.start_on_device:
                assert on_device, "a row behind another with its start on the host"
                behind_rows.append(i)
                behind_dst.append(row.candidate_snapshot[1])
            elif row.candidate_snapshot is not None:
                point, entry = row.candidate_snapshot
                j = point - row.start - 1
                if on_device or num_accepted[i] >= j:
                    cand_rows.append(i)  # verify rows come first: row i is verify row i
                    cand_pos.append(j)
                    cand_dst.append(entry)
        self.state_pool.copy(src, dst)
        self.snapshot_candidates(cand_rows, cand_pos, cand_dst, device_counts, behind_rows, behind_dst)

    def snapshot_candidates(self, rows: list[int], positions: list[int], entries: list[int],
                            accepted: torch.Tensor | None = None, behind_rows: list[int] | None = None,
                            behind_entries: list[int] | None = None, state_slots: torch.Tensor | None = None,
                            one_token: bool | None = None) -> None:
        """Fill snapshot ``entries`` from verify row ``rows[i]``'s candidate state after position ``positions[i]``;
        with ``accepted`` (counts on the device), only where it reached that position, the others into the pad
        slot. ``behind_rows`` (rows whose start is on the device) take the last block boundary they reach as their
        point, as the scheduler will (``Scheduler._place``); one that reaches none copies into the pad slot.
        ``state_slots``: the verify rows' slots (by default the step's, which lead the ``state_slots`` buffer). Runs
        before the step's commit (``RecurrentLayer.snapshot_candidates``). ``one_token``: the verify rows all held
        one token (by default read from the last step's metadata); a layer that advanced them in place gives its
        slots' states (``RecurrentLayer.copy_slots``)."""
        behind_rows, behind_entries = behind_rows or [], behind_entries or []
        n = len(rows) + len(behind_rows)
        if not n:
            return
        graphs = self.graphs.get("snapshot")
        size = graphs.padded_size(n) if graphs is not None else None
        pad = self.state_pool.pad_slot
        device = self.batch.device
        # Rows, positions and entries of the candidates, one copy, each a contiguous row of ``snap`` (the replay
        # kernels read their index vectors at unit stride); pads (with a graph) copy row 0's candidate into the pad
        # slot. A row behind's position is set on the device below.
        m = size or n
        pads = m - n
        flat = [*rows, *behind_rows, *[0] * pads, *positions, *[0] * len(behind_rows), *[0] * pads,
                *entries, *behind_entries, *[pad] * pads]
        snap = device_tensor(flat, device, torch.long).view(3, m)
        if size is not None:
            self.batch.dev_bufs["snap"][:, :size].copy_(snap)
            snap = self.batch.dev_bufs["snap"][:, :size]
        r, p, e = snap[:, :n].unbind(0)
        if behind_rows:
            assert accepted is not None
            b = r[len(rows) :]
            start = self.batch.dev_bufs["verify_starts"].index_select(0, b)
            q = self.num_speculative_tokens + 1
            j = ((start + q) // self.block_size) * self.block_size - start - 1  # -1: no boundary reached
            p[len(rows) :].copy_(j.clamp(min=0))
            e[len(rows) :].copy_(torch.where(j >= 0, e[len(rows) :], pad))
        if accepted is not None:
            e.copy_(torch.where(accepted.index_select(0, r) >= p, e, pad))
        if one_token is None:
            one_token = self._one_token_step()
        layers = self.model.recurrent_layers()
        # The graph replays every layer's candidate snapshots: not where a layer's are its slots.
        if graphs is not None and size is not None and state_slots is None \
                and not any(_in_place(layer, one_token) for layer in layers):
            graphs.run(size)  # every recurrent layer's copies in one replay
            return
        slots = self.batch.dev_bufs["state_slots"] if state_slots is None else state_slots
        for layer in layers:
            if _in_place(layer, one_token):
                layer.copy_slots(r, e, slots)
            else:
                layer.snapshot_candidates(r, p, e, slots)

    def _snapshot_pads(self, size: int) -> None:
        """The snapshot graph's inputs as pads only (capture): row 0's candidate 0 into the pad slot."""
        self.batch.dev_bufs["snap"][:, :size].copy_(torch.tensor([[0], [0], [self.state_pool.pad_slot]]))

    def _graph_snapshot(self, size: int) -> tuple[torch.Tensor, ...]:
        """``snapshot`` graph: every recurrent layer's candidate snapshots of ``size`` (row, position, entry)
        triples from the persistent ``snap`` buffer (pads: into the pad slot)."""
        r, p, e = self.batch.dev_bufs["snap"][:, :size].unbind(0)
        slots = self.batch.dev_bufs["state_slots"]
        for layer in self.model.recurrent_layers():
            layer.snapshot_candidates(r, p, e, slots)
        return ()


def _in_place(layer: RecurrentLayer, one_token: bool) -> bool:
    """Whether ``layer`` advanced a step's verify rows in place: rows of one token, a layer that does so."""
    return one_token and layer.verifies_one_token_rows_in_place
