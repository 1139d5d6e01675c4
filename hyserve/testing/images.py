"""Test images: random RGB PNGs from a seed, as PIL images, and their data URLs."""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image


def tiny_png(width: int, height: int, seed: int) -> bytes:
    """A ``width`` x ``height`` PNG of uniform random RGB pixels drawn from ``seed``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def tiny_image(width: int, height: int, seed: int) -> Image.Image:
    """``tiny_png``'s image as an RGB PIL image."""
    from PIL import Image

    return Image.open(io.BytesIO(tiny_png(width, height, seed))).convert("RGB")


def png_data_url(data: bytes) -> str:
    """``data:image/png;base64,...`` for PNG bytes."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")

