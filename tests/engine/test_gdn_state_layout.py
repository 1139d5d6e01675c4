"""The GDN SSM state stored value-major (``HYSERVE_GDN_STATE_LAYOUT=value``: each head's ``(Dk, Dv)`` state as its
transpose in memory; the kernels and copies take the pool's strides): the scenario with every feature on (MTP,
prefix caching with snapshots, chunked prefill, preemption, an abort, staggered arrivals, async scheduling, emulated
CUDA graphs) gives the key-major engine's outputs and transformers' greedy tokens. The kernels' own checks on such a
pool: ``tests/kernels/test_gdn_decode_fused.py`` (``*_value_major_pool_*``, the sabotage
``split_tile_read_key_major``)."""

from __future__ import annotations

import pytest
import torch

from hyserve.cache.specs import StateTensorSpec
from hyserve.layers.gdn import state_layout_switch
from hyserve.testing.engine import assert_matches_reference
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import assert_same_outputs, reference_run, run_scenario
from hyserve.worker import cuda_graphs


def test_the_layout_switch_takes_key_or_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYSERVE_GDN_STATE_LAYOUT", raising=False)
    assert state_layout_switch() == "key"
    monkeypatch.setenv("HYSERVE_GDN_STATE_LAYOUT", "value")
    assert state_layout_switch() == "value"
    for bad in ("v", "k", "VALUE", ""):
        monkeypatch.setenv("HYSERVE_GDN_STATE_LAYOUT", bad)
        with pytest.raises(ValueError, match="HYSERVE_GDN_STATE_LAYOUT"):
            state_layout_switch()


def test_a_spec_stores_its_view_in_the_order_it_names() -> None:
    spec = StateTensorSpec("s", (2, 3, 5), torch.float32, (0, 2, 1))
    t = spec.zeros((4,), torch.device("cpu"))
    assert t.shape == (4, 2, 3, 5) and t.stride() == (30, 15, 1, 3) and not t.any()
    assert StateTensorSpec("s", (2, 3, 5), torch.float32, (2, 0, 1)).zeros((4,), torch.device("cpu")).stride() == (
        30, 3, 1, 6)
    assert StateTensorSpec("s", (2, 3, 5), torch.float32).zeros((4,), torch.device("cpu")).is_contiguous()
    with pytest.raises(ValueError, match="permutation"):
        StateTensorSpec("s", (2, 3, 5), torch.float32, (0, 1, 1))


def test_value_major_pools_give_the_key_major_outputs(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    path, arrivals, aborts, prompts, want = reference_run(ckpts, "mtp")  # key-major, synchronous, eager
    monkeypatch.setenv("HYSERVE_GDN_STATE_LAYOUT", "value")
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    got, engine = run_scenario(path, "mtp", True, arrivals, aborts)
    pools = engine.runner.state_pool.tensors("ssm_state")
    assert pools and all(t.stride()[-2:] == (1, t.shape[-2]) for t in pools), [t.stride() for t in pools]
    assert_same_outputs(got, want)
    ref = ckpts.reference(path)
    for rid, out in got.items():
        if rid not in ("c", "d"):  # aborted; sampled
            assert_matches_reference(ref, prompts[rid], out)
