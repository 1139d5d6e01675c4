"""Multimodal request inputs (images) for ``Qwen3_5ForConditionalGeneration`` checkpoints."""

from __future__ import annotations

from hyserve.multimodal.image import (
    ImageProcessorSettings,
    MediaError,
    ProcessedImages,
    expand_image_placeholders,
    image_hash,
    load_image,
    process_images,
)

__all__ = [
    "ImageProcessorSettings",
    "MediaError",
    "ProcessedImages",
    "expand_image_placeholders",
    "image_hash",
    "load_image",
    "process_images",
]
