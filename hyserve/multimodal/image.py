"""Image inputs: loading untrusted sources, the Qwen2-VL pixel pipeline, and prompt placeholder expansion.

* ``load_image`` turns a request's image (a ``data:`` URL, raw bytes, a PIL image, an allowed ``file://`` path or an
  allowed ``http(s)://`` URL) into an RGB PIL image, refusing anything else with a ``MediaError`` that names why.
  Only PNG, JPEG and WebP are decoded.
* ``process_images`` runs transformers' ``Qwen2VLImageProcessorPil`` (the class ``AutoImageProcessor`` picks for
  ``qwen3_5`` without torchvision) configured from the checkpoint's ``preprocessor_config.json``, so pixel values match
  transformers exactly, and returns per image its (t, h, w) patch grid, its placeholder token count and a content
  hash (for the prefix cache: every image's placeholders are the same token id, so the hash is what tells two
  prompts' images apart).
* ``expand_image_placeholders`` widens each single ``<|image_pad|>`` of a rendered chat prompt to its image's count.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import itertools
import json
import os
import stat
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import torch
from PIL import Image, UnidentifiedImageError

from hyserve.model.vision import vision_token_count

MIB = 1 << 20
DEFAULT_MAX_BYTES = 20 * MIB
# Decoding allocates width * height * channels bytes whatever the file size (a few KiB of PNG can declare a huge
# canvas), so the declared size is checked before any pixel is decoded. 8192 x 8192 is ~200 MiB of RGB.
DEFAULT_MAX_DECODED_PIXELS = 8192 * 8192

# PIL format name -> the media types a data URL may declare for it.
_FORMATS = {"PNG": ("image/png",), "JPEG": ("image/jpeg", "image/jpg"), "WEBP": ("image/webp",)}
_DATA_URL_TYPES = {t for types in _FORMATS.values() for t in types}
_READ_CHUNK = 64 * 1024


class MediaError(ValueError):
    """A request's image could not be used; the message names the problem (safe to return to the client)."""


# ---------------------------------------------------------------------------------------------------------------------
# Loading.


def load_image(source: str | bytes | Image.Image, *, allowed_domains: Sequence[str] = (),
               allowed_local_path: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = 10.0,
               max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> Image.Image:
    """An RGB PIL image from ``source``; raises MediaError naming the problem.

    ``source``: a PIL image; encoded bytes; ``data:image/{png,jpeg,webp};base64,...``; ``file://`` under
    ``allowed_local_path`` (symlinks resolved first, so a link cannot lead out); ``http(s)://`` on a host in
    ``allowed_domains`` (exact names, redirects re-checked). Remote and local reads stop at ``max_bytes``; a remote
    fetch is abandoned after ``timeout_s`` in all.
    """
    if isinstance(source, Image.Image):
        _check_pixels(source.size, max_decoded_pixels)
        return _to_rgb(source)
    if isinstance(source, bytes | bytearray):
        return decode_image(bytes(source), max_bytes=max_bytes, max_decoded_pixels=max_decoded_pixels)
    if not isinstance(source, str):
        raise MediaError(f"unsupported image source of type {type(source).__name__}")
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        data = _data_url_bytes(source, max_bytes)
    elif scheme == "file":
        data = _local_bytes(source, allowed_local_path, max_bytes)
    elif scheme in ("http", "https"):
        data = _remote_bytes(source, allowed_domains, max_bytes, timeout_s)
    else:
        raise MediaError("unsupported image source: expected a data:, file:// or http(s):// URL")
    return decode_image(data, max_bytes=max_bytes, max_decoded_pixels=max_decoded_pixels)


def decode_image(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> Image.Image:
    """Encoded PNG/JPEG/WebP bytes -> a fully decoded RGB image."""
    if len(data) > max_bytes:
        raise MediaError(f"image too large: {len(data)} bytes (limit {max_bytes})")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise MediaError("not an image: the data is not in a recognized image format") from None
    if img.format not in _FORMATS:
        raise MediaError(f"unsupported image format {img.format}: supported are PNG, JPEG and WebP")
    _check_pixels(img.size, max_decoded_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise MediaError(f"not an image: corrupt or truncated {img.format} data ({e})") from None
    return _to_rgb(img)


def _check_pixels(size: tuple[int, int], limit: int) -> None:
    if size[0] * size[1] > limit:
        raise MediaError(f"image too large: {size[0]}x{size[1]} pixels (limit {limit})")


def _to_rgb(img: Image.Image) -> Image.Image:
    # As transformers' convert_to_rgb: a plain convert, so an alpha channel is dropped, not composited.
    return img if img.mode == "RGB" else img.convert("RGB")


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise MediaError("bad data URL: no ',' before the data")
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if media_type not in _DATA_URL_TYPES:
        raise MediaError(f"unsupported image type {media_type or '(none)'!r} in data URL: "
                         "supported are image/png, image/jpeg and image/webp")
    if "base64" not in params:
        raise MediaError("bad data URL: only ';base64' image data is accepted")
    payload = "".join(payload.split())  # clients may line-wrap base64
    # Checked before decoding, so an oversized payload costs no decode.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise MediaError(f"image too large: about {len(payload) // 4 * 3} bytes (limit {max_bytes})")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"bad base64 in data URL ({e})") from None


def _local_bytes(url: str, allowed_local_path: str | None, max_bytes: int) -> bytes:
    if allowed_local_path is None:
        raise MediaError("file:// image URLs are not allowed (no allowed local path is configured)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL names a host ({parts.netloc!r}); only local paths are allowed")
    root = os.path.realpath(allowed_local_path)
    # realpath resolves every symlink, so the containment check sees where the file really is.
    path = os.path.realpath(urllib.request.url2pathname(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise MediaError(f"image path is outside the allowed directory {root}")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is then refused as not a regular file).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise MediaError(f"cannot read image file: {e.strerror or e}") from None
    try:
        # Checked on the opened file, not the path, so the file cannot be swapped between check and read.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError("image path is not a regular file")
        if info.st_size > max_bytes:
            raise MediaError(f"image too large: {info.st_size} bytes (limit {max_bytes})")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes and (chunk := os.read(fd, _READ_CHUNK)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)  # a file that grew past max_bytes is refused by decode_image
    except OSError as e:
        raise MediaError(f"cannot read image file: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _check_remote(url: str, allowed_domains: Sequence[str]) -> None:
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(f"image URL scheme {parts.scheme!r} not allowed (http and https only)")
    host = (parts.hostname or "").rstrip(".")
    if host not in {d.lower().rstrip(".") for d in allowed_domains}:
        raise MediaError(f"image host {host or '(none)'!r} not allowed")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host: otherwise an allowed host could point the fetch anywhere."""

    def __init__(self, allowed_domains: Sequence[str]) -> None:
        self.allowed_domains = tuple(allowed_domains)

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        _check_remote(newurl, self.allowed_domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _build_opener(allowed_domains: Sequence[str]) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(_CheckedRedirects(allowed_domains))


def _remote_bytes(url: str, allowed_domains: Sequence[str], max_bytes: int, timeout_s: float) -> bytes:
    _check_remote(url, allowed_domains)
    # urlopen's timeout bounds each socket operation, not the whole transfer: the deadline bounds a slow drip.
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "hyserve", "Accept": "image/*"})
    try:
        with _build_opener(allowed_domains).open(request, timeout=timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise MediaError(f"image too large: {length} bytes (limit {max_bytes})")
            chunks: list[bytes] = []
            size = 0
            while chunk := response.read(_READ_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise MediaError(f"image too large: over {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise MediaError(f"image fetch timed out after {timeout_s:g} s")
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as e:
        raise MediaError(f"image fetch failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise MediaError(f"image fetch failed: {getattr(e, 'reason', e)}") from None


# ---------------------------------------------------------------------------------------------------------------------
# Pixels.

# Qwen2VLImageProcessorPil's class defaults, restated: transformers 5.17 writes a config's min_pixels/max_pixels into
# that class-level dict, so after one such load it no longer holds the defaults.
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass(frozen=True)
class ImageProcessorSettings:
    """A checkpoint's ``preprocessor_config.json`` as the Qwen2-VL image processor reads it.

    Images are resized (bicubic, aspect kept) so both sides are multiples of ``patch_size * merge_size`` and the area
    is within [min_pixels, max_pixels]; ``min_pixels``/``max_pixels`` keys override ``size``'s
    ``shortest_edge``/``longest_edge`` (which, despite the names, are pixel areas), as in transformers.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = _DEFAULT_MIN_PIXELS
    max_pixels: int = _DEFAULT_MAX_PIXELS
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    resample: int = _BICUBIC
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ImageProcessorSettings:
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            # The vision tower was trained on resized, normalized RGB patches; anything else is a broken config.
            if cfg.get(flag, True) is False:
                raise ValueError(f"preprocessor_config.json: {flag}=false is not supported")
        d = cls()
        size = dict(cfg.get("size") or {})
        return cls(
            patch_size=int(cfg.get("patch_size", d.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", d.merge_size)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
            image_mean=_triple(cfg.get("image_mean", d.image_mean), "image_mean"),
            image_std=_triple(cfg.get("image_std", d.image_std), "image_std"),
            resample=int(cfg.get("resample", d.resample)),
            rescale_factor=float(cfg.get("rescale_factor", d.rescale_factor)),
        )

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | os.PathLike[str]) -> ImageProcessorSettings:
        path = os.path.join(checkpoint_dir, "preprocessor_config.json")
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except FileNotFoundError:
            raise ValueError(f"{checkpoint_dir} has no preprocessor_config.json: cannot process images") from None


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    values = [float(v) for v in value] if isinstance(value, list | tuple) else [float(value)] * 3
    if len(values) != 3:
        raise ValueError(f"preprocessor_config.json: {name} needs 3 values, got {value!r}")
    return values[0], values[1], values[2]


@lru_cache(maxsize=8)
def image_processor(settings: ImageProcessorSettings) -> Any:
    """transformers' PIL Qwen2-VL image processor for ``settings``.

    Built directly rather than through AutoImageProcessor: that picks the torchvision class when torchvision is
    installed (its resize differs slightly from PIL's) and needs the module path to import without it; passing
    ``size`` explicitly also keeps transformers' shared class-level size dict out of the result.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    s = settings
    return Qwen2VLImageProcessorPil(
        patch_size=s.patch_size, temporal_patch_size=s.temporal_patch_size, merge_size=s.merge_size,
        size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels}, image_mean=list(s.image_mean),
        image_std=list(s.image_std), resample=s.resample, rescale_factor=s.rescale_factor,
    )


@dataclass(frozen=True)
class ProcessedImages:
    """``pixel_values``: (sum of t*h*w, 3 * temporal_patch_size * patch_size**2) float32, images in order, each in
    spatial-merge-block order; ``grid_thw``: (n, 3) int64; per image ``token_counts[i] = t*h*w / merge**2`` and
    ``hashes[i]``, the sha256 of its RGB content."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    token_counts: list[int]
    hashes: list[str]


def image_hash(img: Image.Image) -> str:
    """sha256 hex of the RGB pixels and the size: equal exactly when two images' content is equal."""
    rgb = _to_rgb(img)
    h = hashlib.sha256(b"hyserve-rgb-v1:%dx%d:" % rgb.size)
    h.update(rgb.tobytes())
    return h.hexdigest()


def process_images(images: Sequence[Image.Image], checkpoint_dir: str | os.PathLike[str] | None = None, *,
                   settings: ImageProcessorSettings | None = None,
                   hashes: Sequence[str] | None = None) -> ProcessedImages:
    """Pixel values, grids, placeholder counts and content hashes of ``images`` for ``checkpoint_dir``'s model.

    ``settings`` (if given) replaces reading the checkpoint's preprocessor_config.json; ``hashes`` (if given) are
    the images' ``image_hash`` values, computed already.
    """
    if settings is None and checkpoint_dir is None:
        raise TypeError("process_images needs checkpoint_dir or settings")
    if hashes is not None and len(hashes) != len(images):
        raise ValueError(f"{len(hashes)} hashes for {len(images)} images")
    s = settings if settings is not None else ImageProcessorSettings.from_checkpoint(checkpoint_dir)  # type: ignore[arg-type]
    rgb = [_to_rgb(img) for img in images]
    if not rgb:
        patch_dim = 3 * s.temporal_patch_size * s.patch_size**2
        return ProcessedImages(torch.zeros(0, patch_dim), torch.zeros(0, 3, dtype=torch.long), [], [])
    try:
        out = image_processor(s)(images=rgb, return_tensors="pt")
    except ValueError as e:
        # smart_resize refuses aspect ratios over 200: a property of the request's image, not a server fault.
        raise MediaError(f"image cannot be processed: {e}") from None
    grid_thw = out["image_grid_thw"].long()
    return ProcessedImages(
        pixel_values=out["pixel_values"],
        grid_thw=grid_thw,
        token_counts=vision_token_count(grid_thw, s.merge_size),
        hashes=list(hashes) if hashes is not None else [image_hash(img) for img in rgb],
    )


# ---------------------------------------------------------------------------------------------------------------------
# Prompt.


def expand_image_placeholders(token_ids: list[int], token_counts: list[int], image_token_id: int) -> list[int]:
    """``token_ids`` with its i-th ``image_token_id`` repeated ``token_counts[i]`` times.

    The rendered prompt must hold exactly one placeholder per image (Qwen's template emits
    ``<|vision_start|><|image_pad|><|vision_end|>`` for each); two placeholders may not touch, since the expanded
    runs would then read as one image (``mrope_positions``). Raises ValueError naming the mismatch.
    """
    where = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(where) != len(token_counts):
        raise ValueError(f"prompt has {len(where)} image placeholders but {len(token_counts)} images were given")
    for a, b in itertools.pairwise(where):
        if b == a + 1:
            raise ValueError(f"image placeholders at tokens {a} and {b} touch; images need text between them")
    out: list[int] = []
    prev = 0
    for i, count in zip(where, token_counts):
        out += token_ids[prev:i]
        out += [image_token_id] * count
        prev = i + 1
    out += token_ids[prev:]
    return out
