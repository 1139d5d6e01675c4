"""A pipeline stage's side of a step: the previous stage's output received into a persistent buffer, this stage's
output sent on, and (a stage before the last) the verify steps whose accepted counts come later.

Only the last stage knows a verify step's accepted counts when it runs it. A stage before it keeps that step's own
verify-row slots, snapshot reservations and verify scratch (a scratch set per uncommitted step) and applies the
counts when a later step brings them (``SchedulerOutput.verify_commits``, by step id), before that later step's state
operations and forward (docs/design.md invariants 6 and 14).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.distributed.parallel_state import StageLink
from hyserve.model.base import CausalLM
from hyserve.model.metadata import StepMetadata
from hyserve.scheduler.output import ScheduledRow
from hyserve.utils import device_tensor
from hyserve.worker.state_ops import StateOps


class StageIO:
    """The stage's link to its neighbours (None with one stage) and ``pp_in``, where a later stage receives the
    previous stage's handover per token (``ModelConfig.stage_handover_parts`` tensors: Qwen3.5's residual and
    pending MLP output, Qwen4-Exp's streams alone): graphs read it there."""

    def __init__(self, link: StageLink | None, is_first: bool, is_last: bool) -> None:
        self.link = link
        self.is_first_stage, self.is_last_stage = is_first, is_last
        self.pp_in: torch.Tensor | None = None

    def allocate(self, max_num_batched_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, parts: int = 2) -> None:
        if self.link is not None and not self.is_first_stage:
            self.pp_in = torch.zeros((max_num_batched_tokens, parts, hidden_size), dtype=dtype, device=device)

    def _received(self, t: int) -> tuple[torch.Tensor, ...]:
        assert self.pp_in is not None
        return tuple(self.pp_in[:t, i] for i in range(self.pp_in.shape[1]))

    def recv_stage_input(self, num_tokens: int) -> None:
        """The previous stage's output of this step's ``num_tokens`` tokens, into ``pp_in``."""
        if self.link is not None and not self.is_first_stage:
            assert self.pp_in is not None
            self.link.recv_into(self.pp_in[:num_tokens])

    def send(self, *parts: torch.Tensor) -> None:
        assert self.link is not None
        self.link.send(*parts)

    def forward(self, model: CausalLM, input_ids: torch.Tensor, meta: StepMetadata
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The model over input already received: a later stage's input is the previous stage's output (in
        ``pp_in``); a stage before the last returns its handover."""
        if self.is_first_stage:
            return model(input_ids, meta)  # type: ignore[no-any-return]
        return model(input_ids, meta, self._received(input_ids.shape[0]))  # type: ignore[no-any-return]

    def run_model(self, model: CausalLM, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """This stage's eager forward of a prepared step: after the previous stage's output arrives, and sent on to
        the next stage (the last stage returns the hidden states; the others an empty tensor)."""
        if self.link is None:
            return model(input_ids, meta)  # type: ignore[no-any-return]
        inter = None
        if not self.is_first_stage:
            t = input_ids.shape[0]
            self.recv_stage_input(t)
            inter = self._received(t)
        out = model(input_ids, meta, inter)
        if self.is_last_stage:
            return out  # type: ignore[no-any-return]
        self.link.send(*out)
        return input_ids.new_empty((0,))


@dataclass(slots=True)
class PendingCommit:
    """A verify step that a pipeline stage other than the last ran before its accepted counts were known: the
    step's own verify-row slots and snapshot reservations, and the scratch set holding its candidates. Applied when
    the counts arrive (``SchedulerOutput.verify_commits``, by step id), whatever steps ran in between."""

    step_id: int
    scratch_set: int
    state_slots: torch.Tensor  # (verify rows,) this step's, not the buffer the next step overwrites
    candidates: list[tuple[int, int, int]]  # (verify row, position, snapshot entry) of candidate_snapshot
    one_token: bool = False  # every verify row held one token (RecurrentLayer.verifies_one_token_rows_in_place)


class StageCommits:
    """The uncommitted verify steps of a stage before the last, each holding a scratch set of its own."""

    def __init__(self, state_ops: StateOps, num_scratch_sets: int) -> None:
        self.state_ops = state_ops
        self._free_scratch_sets: list[int] = list(range(num_scratch_sets))
        self._uncommitted: dict[int, PendingCommit] = {}

    @property
    def num_uncommitted_steps(self) -> int:
        return len(self._uncommitted)

    def take_scratch_set(self, step_id: int) -> int:
        """A free scratch set for verify step ``step_id``'s candidates, bound to the recurrent layers."""
        if not self._free_scratch_sets:
            raise RuntimeError(f"step {step_id}: every verify scratch set holds an uncommitted step "
                               f"({sorted(self._uncommitted)}); more steps are in flight than planned")
        scratch = self._free_scratch_sets.pop(0)
        self.state_ops.bind_scratch(scratch)
        return scratch

    def keep(self, step_id: int, scratch_set: int, rows: list[ScheduledRow], verify: list[int],
             meta: StepMetadata) -> None:
        """Step ``step_id`` ran its verify rows into ``scratch_set``: keep its slots and candidate reservations."""
        assert meta.verify is not None
        cands = []
        for i in verify:
            if rows[i].candidate_snapshot is not None:
                point, entry = rows[i].candidate_snapshot  # type: ignore[misc]
                cands.append((i, point - rows[i].start - 1, entry))
        self._uncommitted[step_id] = PendingCommit(step_id, scratch_set, meta.verify.state_slots.clone(), cands,
                                                   meta.verify.max_query_len == 1)

    def pending_commit(self, step_id: int) -> PendingCommit:
        """The uncommitted verify step ``step_id`` (its own slots and scratch set, not the latest step's)."""
        pending = self._uncommitted.pop(step_id, None)
        if pending is None:
            raise RuntimeError(f"accepted counts for step {step_id}, which has no uncommitted verify rows here "
                               f"(uncommitted: {sorted(self._uncommitted)})")
        return pending

    def apply_commit(self, pending: PendingCommit, num_accepted: list[int]) -> None:
        """``pending``'s candidate snapshots whose position the accepted length reached are copied out, and the
        live slots of its verify rows take candidate ``num_accepted[r]`` (-1: untouched), in that order
        (``RecurrentLayer.snapshot_candidates``); then its scratch set is free."""
        n = len(num_accepted)
        if n != pending.state_slots.shape[0]:
            raise RuntimeError(f"step {pending.step_id}: {n} accepted counts for {pending.state_slots.shape[0]} "
                               "verify rows")
        ops = self.state_ops
        ops.bind_scratch(pending.scratch_set)
        acc = device_tensor(num_accepted, ops.batch.device, torch.long)
        cands = [(r, p, e) for r, p, e in pending.candidates if num_accepted[r] >= p]
        ops.snapshot_candidates([r for r, _, _ in cands], [p for _, p, _ in cands], [e for _, _, e in cands],
                                state_slots=pending.state_slots, one_token=pending.one_token)
        for layer in ops.committing_layers(pending.one_token):
            layer.commit_verified(pending.state_slots, acc)
        self._free_scratch_sets.append(pending.scratch_set)
