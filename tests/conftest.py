"""Shared test setup: one CPU thread (tiny matmuls run fastest so, and a 2-core CI machine is not oversubscribed),
the session's tiny checkpoints, each written once (``hyserve.testing.families.CheckpointCache``), and the planting
of known MTP drafts (``plant_drafts``: it writes requests' drafts, which only the scheduler and tests may do, so it
lives here rather than in ``hyserve.testing``; docs/design.md invariant 13)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import Phase, settings

from hyserve.engine.llm_engine import LLMEngine
from hyserve.scheduler.output import PREVIOUS_DRAFT
from hyserve.testing.families import CheckpointCache


def pytest_configure(config: pytest.Config) -> None:
    """Under ``TRITON_INTERPRET=1`` (a subprocess that runs a family's tests on the fused MoE kernels,
    ``tests/kernels/test_moe_engine.py``) the interpreter computes as the GPU does.

    With ``PYTHONDONTWRITEBYTECODE`` set (as on the machines the sessions and CI run on) no hyserve module ever had
    its bytecode cached, so every process the tests start (each worker rank, server, reference or interpreter
    process: hundreds in a run) compiled the ~120 modules it imports anew, 0.4-0.8 s of CPU each on two cores: the
    run's processes write and read it (``__pycache__``, ignored by git), as Python does by default.

    Engine workers (``distributed_executor_backend="mp"``, every parallel engine) are forked from a server that has
    imported torch (``HYSERVE_WORKER_MULTIPROC_METHOD=forkserver``): about 3 s of CPU less for each of the run's
    hundreds of workers. The tests that plant code in the workers through ``sitecustomize`` take fresh interpreters
    (``exec``, the default outside the tests), as do ``tests/executor/test_multiproc.py``'s lifetime tests, which
    run both ways."""
    import os
    import sys

    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        sys.dont_write_bytecode = False
    os.environ.setdefault("HYSERVE_WORKER_MULTIPROC_METHOD", "forkserver")

    if os.environ.get("TRITON_INTERPRET") == "1":
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()


# Seconds a test file took in a measured run (``python scripts/file_seconds.py LOG``, LOG from ``--durations=0``).
FILE_SECONDS_PATH = os.path.join(os.path.dirname(__file__), "file_seconds.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first: with ``--dist loadfile --no-loadscope-reorder`` (``scripts/test.sh``) xdist hands
    the files out in this order, so the run ends on short files rather than one worker finishing a long file alone
    (xdist's own order is by the number of tests, which puts a file of a few long engine tests last). A file not
    measured weighs half a second a test. A file's tests keep their order."""
    import json
    from collections import Counter

    with open(FILE_SECONDS_PATH) as f:
        seconds: dict[str, float] = json.load(f)
    count = Counter(item.nodeid.split("::")[0] for item in items)
    rank = {name: i for i, name in enumerate(count)}  # collection order (a Counter keeps first insertion)

    def key(item: pytest.Item) -> tuple[float, int]:
        name = item.nodeid.split("::")[0]
        return -seconds.get(name, 0.5 * count[name]), rank[name]

    items.sort(key=key)  # stable: a file's tests keep their order


torch.set_num_threads(1)

# Hypothesis: a failing example is reported as found, not shrunk, and no example database is kept, so a run costs
# what it costs on a fresh clone (CI): the sabotage tests expect their property to fail, and shrinking each failure
# took 14-38 s a test there (HYPOTHESIS_PROFILE=shrink shrinks, for reading a real failure).
settings.register_profile("suite", database=None, phases=[Phase.explicit, Phase.generate, Phase.target])
settings.register_profile("shrink", database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    return CheckpointCache(str(tmp_path_factory.mktemp("ckpts")))


def _plant_drafts(engine: LLMEngine, want: dict[str, list[int]]) -> None:
    """After every step each running request's MTP drafts become its known continuation, the last one made wrong
    (the tiny heads are random and would never be accepted): drafts are accepted and rejected, and accepted drafts
    are seen by the verify positions after them. Drafts kept on the device (``PREVIOUS_DRAFT``, async scheduling)
    are planted in the verifier's ``draft_slots``. Requests not in ``want`` keep their drafts."""
    update = engine.scheduler.update_from_output
    try:
        verifier = engine.runner.verifier
    except RuntimeError:  # worker processes: every rank's drafts come to the host (no PREVIOUS_DRAFT)
        verifier = None

    def plant(so, ro, sink):  # type: ignore[no-untyped-def]
        ran = update(so, ro, sink)
        for req in engine.scheduler.running:
            drafts = req.draft_token_ids
            if not drafts or req.request_id not in want:
                continue
            cont = want[req.request_id][req.num_output_tokens:][: len(drafts)]
            cont = [*cont[:-1], (cont[-1] + 1) % 50] if len(cont) == len(drafts) and len(cont) > 1 else cont
            if PREVIOUS_DRAFT in drafts:
                assert verifier is not None and verifier.draft_slots is not None
                verifier.draft_slots[req.state_slot, : len(cont)] = torch.tensor(cont)
            elif cont:
                req.draft_token_ids = cont
        return ran

    engine.scheduler.update_from_output = plant  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def plant_drafts() -> Callable[[LLMEngine, dict[str, list[int]]], None]:
    """``plant_drafts(engine, {request id: its known outputs})`` (``_plant_drafts``)."""
    return _plant_drafts
