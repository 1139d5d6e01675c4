"""The Mamba2 mixer (``hyserve.layers.mamba2``) against transformers' own ``NemotronHMamba2Mixer`` (its torch
path, float32, CPU, one uncached forward over each whole sequence), with the same weights: requests in chunks of
several rows over non-identity slots, decode steps, a verify step whose candidates are committed at a rejected
draft, and the scan's per-row state kept apart. Sabotaged: the conv's bias left out, the SSM state stored one
position short (before the row's last token); both caught.
"""

from __future__ import annotations

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from hyserve.layers.mamba2 import Mamba2Mixer
from hyserve.model.metadata import StepMetadata, VerifyMetadata

H, P, G, N, K, HIDDEN = 4, 8, 2, 16, 4, 32
SLOTS = 6


def hf_config() -> NemotronHConfig:
    return NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=H, mamba_head_dim=P, n_groups=G, ssm_state_size=N,
                           conv_kernel=K, use_conv_bias=True, use_bias=False, layer_norm_epsilon=1e-5,
                           hybrid_override_pattern="M", vocab_size=64, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=16, intermediate_size=64, chunk_size=8)


class Cfg:
    hidden_size = HIDDEN
    mamba_num_heads = H
    mamba_head_dim = P
    n_groups = G
    ssm_state_size = N
    conv_kernel = K
    use_conv_bias = True
    use_bias = False
    layer_norm_epsilon = 1e-5
    quantization = None
    ssm_state_dtype = "float32"

    def __init__(self, hf: NemotronHConfig) -> None:
        self.time_step_limit = (hf.time_step_min, float("inf"))


def pair(seed: int = 0) -> tuple[NemotronHMamba2Mixer, Mamba2Mixer]:
    hf_cfg = hf_config()
    ref = NemotronHMamba2Mixer(hf_cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5 - 0.5)
            elif name in ("dt_bias", "D"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    ours = Mamba2Mixer(Cfg(hf_cfg), "backbone.layers.0.mixer")
    missing = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    spec = ours.cache_spec(torch.float32)
    ours.bind_state({s.name: torch.zeros((SLOTS, *s.shape), dtype=s.dtype) for s in spec.tensors})
    return ref, ours


def reference(ref: NemotronHMamba2Mixer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(x[None])[0]


def step(layer: Mamba2Mixer, rows: list[tuple[int, torch.Tensor]], verify_rows: int = 0) -> list[torch.Tensor]:
    """rows: (slot, inputs (n, hidden)); the first ``verify_rows`` rows are verify rows."""
    lens = [x.shape[0] for _, x in rows]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([s for s, _ in rows])
    verify = None
    if verify_rows:
        nv = int(qsl[verify_rows])
        verify = VerifyMetadata(num_rows=verify_rows, num_tokens=nv, max_query_len=max(lens[:verify_rows]),
                                query_start_loc=qsl[:verify_rows + 1], state_slots=slots[:verify_rows],
                                rest_query_start_loc=qsl[verify_rows:] - nv, rest_state_slots=slots[verify_rows:],
                                rest_max_query_len=max(lens[verify_rows:], default=0))
    meta = StepMetadata(positions=torch.zeros(int(qsl[-1]), dtype=torch.int64), query_start_loc=qsl,
                        seq_lens=torch.tensor(lens, dtype=torch.int32), state_slots=slots,
                        block_tables=torch.zeros(len(rows), 1, dtype=torch.int32),
                        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), max_query_len=max(lens),
                        max_seq_len=max(lens), verify=verify)
    with torch.no_grad():
        y = layer(torch.cat([x for _, x in rows]), meta)
    return list(torch.split(y, lens))


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


def seqs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(40, HIDDEN, generator=gen), torch.randn(23, HIDDEN, generator=gen)


def test_chunks_and_decode_steps_over_slots_equal_one_forward() -> None:
    ref, ours = pair()
    a, b = seqs(1)
    want_a, want_b = reference(ref, a), reference(ref, b)
    got_a, got_b = [], []
    for (a0, a1), (b0, b1) in (((0, 13), (0, 5)), ((13, 30), (5, 20)), ((30, 31), (20, 21))):
        ya, yb = step(ours, [(4, a[a0:a1]), (1, b[b0:b1])])  # slots 4 and 1: not the row order
        got_a.append(ya)
        got_b.append(yb)
    for p in range(31, 40):  # decode; row b ends at 23, then a alone
        rows = [(4, a[p:p + 1])] + ([(1, b[p - 10:p - 9])] if p - 10 < 23 else [])
        ys = step(ours, rows)
        got_a.append(ys[0])
        if len(ys) > 1:
            got_b.append(ys[1])
    close(torch.cat(got_a), want_a)
    close(torch.cat(got_b), want_b[: sum(y.shape[0] for y in got_b)])


def test_a_verify_step_keeps_the_live_state_until_the_commit() -> None:
    """A verify row of 4 tokens: its outputs equal the reference's at those positions, the live state is not
    written, and committing candidate 1 (two tokens accepted) resumes as if only those two had been fed."""
    ref, ours = pair(seed=2)
    a, _ = seqs(3)
    k = 3
    spec = ours.verify_scratch_spec(torch.float32)
    # Scratch for three verify rows (the runner's is sized for the most a step may have); this step has one.
    ours.bind_verify_scratch({s.name: torch.zeros((3, k + 1, *s.shape), dtype=s.dtype) for s in spec.tensors})
    step(ours, [(2, a[:20])])
    live = {n: t.clone() for n, t in ours.state.items()}
    (yv,) = step(ours, [(2, a[20:24])], verify_rows=1)
    close(yv, reference(ref, a[:24])[20:24])
    for name, t in ours.state.items():
        assert torch.equal(t, live[name]), name  # a verify step only reads the live state
    ours.commit_verified(torch.tensor([2]), torch.tensor([1]))  # positions 20, 21 accepted
    rest = torch.cat([step(ours, [(2, a[22:30])])[0]])
    close(rest, reference(ref, a[:30])[22:30])


@pytest.mark.parametrize("sabotage", ["no_conv_bias", "state_one_short"])
def test_sabotages_are_caught(sabotage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = pair(seed=4)
    a, _ = seqs(5)
    if sabotage == "no_conv_bias":
        with torch.no_grad():
            ours.conv1d.bias = None  # type: ignore[assignment]
        got = torch.cat(step(ours, [(0, a[:20])]))
        assert not torch.allclose(got, reference(ref, a[:20]), atol=1e-3)
        return
    import hyserve.layers.mamba2 as m2

    real = m2.mamba2_scan

    def one_short(*args: object, **kwargs: object) -> torch.Tensor:  # the slot keeps the state before the last token
        state, slots, qsl, longest = args[8], args[9], args[10], args[11]
        saved = state.clone()  # type: ignore[union-attr]
        y = real(*args, **kwargs)  # type: ignore[arg-type]
        state.copy_(saved)  # type: ignore[union-attr]
        qs = qsl.clone()  # type: ignore[union-attr]
        qs[1:] -= torch.arange(1, qs.shape[0])
        real(*args[:8], state, slots, qs, longest)  # type: ignore[arg-type]
        return y

    step(ours, [(0, a[:12])])
    monkeypatch.setattr(m2, "mamba2_scan", one_short)
    ours.state["ssm_state"].zero_()
    ours.state["conv_state"].zero_()
    step(ours, [(0, a[:12])])
    monkeypatch.undo()
    got = torch.cat(step(ours, [(0, a[12:20])]))
    assert not torch.allclose(got, reference(ref, a[:20])[12:20], atol=1e-3)
