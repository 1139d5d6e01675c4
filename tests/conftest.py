"""Shared test setup: one CPU thread (tiny matmuls run fastest so, and a 2-core CI machine is not oversubscribed),
and the session's tiny checkpoints, each written once (``hyserve.testing.families.CheckpointCache``)."""

from __future__ import annotations

import pytest
import torch

from hyserve.testing.families import CheckpointCache

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    return CheckpointCache(str(tmp_path_factory.mktemp("ckpts")))
