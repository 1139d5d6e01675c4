"""hyserve's compute kernels, in the flat varlen layout, with plain-torch references for CPU and for tests.

Layout: a step's tokens from ``R`` rows are concatenated (``T`` tokens); ``query_start_loc`` ``(R + 1,)`` int32 holds
the cumulative offsets (row ``r`` owns tokens ``[qsl[r], qsl[r + 1])``; rows may be empty). Recurrent state pools are
indexed by slot (``state_slots[r]``), never by row; slots of non-empty rows are distinct, and empty rows and unnamed
slots are never written. Host ints (``max_query_len``, ``max_seq_len``) size launches without device->host syncs
(:mod:`hyserve.kernels.varlen` spells the layout out and holds the row helpers the references share).

One package per op (``attention`` (with Qwen4-Exp's QSA launchers, ``attention/qsa.py``), ``conv``, ``gdn``,
``mamba2``, ``commit``, ``gating``, ``norm``, ``rope``, ``fp8``, ``bitmask``, ``moe``, ``hyper_connection``,
``ple``), each with the same rooms: ``__init__.py`` (the entry points and their dispatch), ``_triton.py`` (the
Triton kernels, private to the op's package), ``reference.py`` (the plain-torch references, which define the
semantics; for ``hyper_connection`` and ``ple`` the layer's own torch formulation, in ``hyserve.layers``) and, for
the ops with recurrent state, ``verify.py`` (the speculative-decoding variant that reads live state and records
candidates in scratch; :mod:`hyserve.kernels.commit` copies the accepted ones into the slots).

Each entry point dispatches on the device: CUDA tensors go to Triton kernels (and fla-core for GDN prefill and for
bf16 / fp16 Mamba2 prefill), all others to the op's references. Triton and fla are imported lazily, only when
needed.
"""

from __future__ import annotations

from hyserve.kernels.attention import paged_attention, store_kv
from hyserve.kernels.conv import causal_conv1d_varlen
from hyserve.kernels.gdn import gdn_forward

__all__ = ["causal_conv1d_varlen", "gdn_forward", "paged_attention", "store_kv"]
