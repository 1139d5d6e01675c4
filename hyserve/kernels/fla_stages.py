"""What hyserve's calls into fla-core's internal chunk stages share (the GDN and Mamba2 prefill paths that return
the per-chunk states, for prefix-cache snapshots inside prefill rows): the pinned fla-core version whose internal
signatures they call, its chunk length, and the check of the installed version."""

from __future__ import annotations

__all__ = ["FLA_CHUNK", "FLA_PINNED_VERSION", "fla_row_snapshots_unavailable", "require_pinned_fla"]

# fla's chunk length (its per-chunk states ``h`` are those before every FLA_CHUNK tokens of a row), and the fla-core
# version whose internal forward stages hyserve calls.
FLA_CHUNK = 64
FLA_PINNED_VERSION = "0.6.0"


def fla_row_snapshots_unavailable() -> str | None:
    """Why snapshots inside prefill rows cannot run on CUDA's fla path (16-bit models), or None: they call fla-core
    ``FLA_PINNED_VERSION``'s internal chunk stages, so fla-core must be installed at exactly that version."""
    try:
        import fla
    except ImportError:
        return "fla-core is not installed"
    version = getattr(fla, "__version__", None)
    if version != FLA_PINNED_VERSION:
        return f"fla-core {version} is installed; they call fla-core {FLA_PINNED_VERSION}'s internal chunk stages"
    return None


def require_pinned_fla() -> None:
    """Refuse, naming the flag to change, where fla-core is not the pinned version (internal functions whose
    signatures change between releases)."""
    reason = fla_row_snapshots_unavailable()
    if reason is not None:
        raise RuntimeError(f"prefix-cache snapshots inside prefill rows: {reason}. Install "
                           f"fla-core=={FLA_PINNED_VERSION}, or set --no-snapshots-inside-rows (rows then end at "
                           "every snapshot point)")
