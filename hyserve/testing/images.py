"""Test images: random RGB PNGs from a seed, and their data URLs."""

from __future__ import annotations

import base64
import io


def tiny_png(width: int, height: int, seed: int) -> bytes:
    """A ``width`` x ``height`` PNG of uniform random RGB pixels drawn from ``seed``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(data: bytes) -> str:
    """``data:image/png;base64,...`` for PNG bytes."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")

