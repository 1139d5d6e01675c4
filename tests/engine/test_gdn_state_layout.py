"""The GDN SSM state stored value-major (the default; each head's ``(Dk, Dv)`` state as its transpose in memory;
``HYSERVE_GDN_STATE_LAYOUT=key`` stores it key-major; the kernels and copies take the pool's strides): the scenario
with every feature on (MTP, prefix caching with snapshots, chunked prefill, preemption, an abort, staggered
arrivals, async scheduling, emulated CUDA graphs) gives the key-major engine's outputs and transformers' greedy
tokens. The kernels' own checks on such a pool: ``tests/kernels/test_gdn_decode_fused.py``
(``*_value_major_pool_*``, the sabotage ``split_tile_read_key_major``)."""

from __future__ import annotations

import pytest
import torch

from hyserve.cache.specs import RecurrentStateSpec, StateTensorSpec, entry_rows
from hyserve.cache.state_pool import StatePool
from hyserve.layers.gdn import state_layout_switch
from hyserve.testing.engine import assert_matches_reference
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import assert_same_outputs, reference_run, run_scenario
from hyserve.worker import cuda_graphs


def test_the_layout_switch_takes_key_or_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYSERVE_GDN_STATE_LAYOUT", raising=False)
    assert state_layout_switch() == "value"
    monkeypatch.setenv("HYSERVE_GDN_STATE_LAYOUT", "key")
    assert state_layout_switch() == "key"
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


def test_entry_rows_are_each_entrys_memory_at_unit_stride() -> None:
    """A layer's slot copies (``copy_slots``) go through ``entry_rows``: row i is entry i's memory, unit stride in any
    memory order (the fast row kernels, not the strided element-wise ones a transposed view takes); a tensor whose
    entries are not dense blocks is refused."""
    for order in (None, (0, 2, 1), (2, 0, 1)):
        t = StateTensorSpec("s", (2, 3, 5), torch.float32, order).zeros((4,), torch.device("cpu"))
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
        rows = entry_rows(t)
        assert rows.shape == (4, 30) and rows.stride() == (30, 1)
        for i in range(4):
            assert sorted(rows[i].tolist()) == sorted(t[i].flatten().tolist())
        assert rows.data_ptr() == t.data_ptr()
    t = torch.zeros(4, 3, 6)
    for bad in (t[:, :, :5], t.transpose(0, 1)):
        with pytest.raises(ValueError, match="not dense"):
            entry_rows(bad)
    with pytest.raises(ValueError, match="overlap"):
        entry_rows(torch.zeros(1, 6).expand(4, 6))


@pytest.mark.parametrize("layout", ["key", "value"])
def test_the_pool_copies_and_resets_whole_entries_in_either_layout(monkeypatch: pytest.MonkeyPatch,
                                                                   layout: str) -> None:
    """``StatePool.copy`` / ``reset`` on a value-major and a key-major pool (every layer's tensors views into one
    row of bytes per entry): entry ``d`` takes entry ``s``'s view exactly (read through the ``(H, K, V)`` view, so a
    copy in the wrong order shows), entries not named keep theirs; non-identity and overlapping source / destination
    lists (every source read before a destination is written)."""
    order = None if layout == "key" else (0, 2, 1)
    spec = RecurrentStateSpec((StateTensorSpec("conv_state", (6, 3), torch.float32),
                               StateTensorSpec("ssm_state", (2, 3, 4), torch.float32, order)))
    pool = StatePool([spec, spec], num_slots=5, device=torch.device("cpu"), num_snapshots=3)
    gen = torch.Generator().manual_seed(1)
    for layer in pool.layers:
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    before = [{n: t.clone() for n, t in layer.items()} for layer in pool.layers]
    ssm = pool.layers[1]["ssm_state"]  # float32 rows of the entries' bytes, in the layout's order
    assert ssm.stride() == (pool.bytes_per_entry // 4, *((12, 4, 1) if layout == "key" else (12, 1, 3)))
    assert pool.rows.shape == (9, pool.bytes_per_entry) and pool.bytes_per_entry == 2 * (6 * 3 + 2 * 3 * 4) * 4
    src, dst = [4, 0, 6], [6, 8, 1]  # entry 6 read and written
    pool.copy(src, dst)
    pool.reset([3])
    for was, now in zip(before, pool.layers):
        for n, t in now.items():
            want = was[n].clone()
            want[dst] = was[n][src]
            want[3] = 0
            assert torch.equal(t, want), n


def test_a_pool_without_recurrent_tensors_has_empty_rows() -> None:
    """A pipeline stage or a model without recurrent layers: rows of no bytes, copies and resets do nothing."""
    for specs in ([], [RecurrentStateSpec(())]):
        pool = StatePool(specs, num_slots=3, device=torch.device("cpu"), num_snapshots=2)
        assert pool.rows.shape == (6, 0) and pool.bytes_per_entry == 0
        pool.copy([0], [4])
        pool.reset([1])


def test_value_major_pools_give_the_key_major_outputs(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYSERVE_GDN_STATE_LAYOUT", "key")
    path, arrivals, aborts, prompts, want = reference_run(ckpts, "mtp")  # key-major, synchronous, eager
    monkeypatch.delenv("HYSERVE_GDN_STATE_LAYOUT")  # the default: value-major
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    got, engine = run_scenario(path, "mtp", True, arrivals, aborts)
    pools = engine.runner.state_pool.tensors("ssm_state")
    assert pools and all(t.stride()[-2:] == (1, t.shape[-2]) for t in pools), [t.stride() for t in pools]
    assert_same_outputs(got, want)
    ref = ckpts.reference(path)
    for rid, out in got.items():
        if rid not in ("c", "d"):  # aborted; sampled
            assert_matches_reference(ref, prompts[rid], out)
