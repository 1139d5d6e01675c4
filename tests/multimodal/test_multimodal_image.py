"""Image inputs: loading (and every refusal), transformers-identical pixels, hashes, placeholder expansion.

No network: remote URLs are tested for their refusals, and the fetch loop against a fake opener.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hyserve.model.vision import vision_token_count
from hyserve.multimodal import image as image_mod
from hyserve.multimodal.image import (
    ImageProcessorSettings,
    MediaError,
    expand_image_placeholders,
    load_image,
    process_images,
)

PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8, 40 * 40
IMAGE_TOKEN = 248056
SIZES = [(30, 20), (16, 40), (9, 9), (64, 48), (200, 30)]  # (width, height)


def _random_image(size: tuple[int, int], seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = size
    channels = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def _data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory whose preprocessor_config.json transformers itself wrote."""
    path = tmp_path_factory.mktemp("ckpt")
    Qwen2VLImageProcessorPil(
        patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(str(path))
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# Loading.

FORMATS = [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")]


@pytest.mark.parametrize(("fmt", "media_type"), FORMATS)
def test_data_url_round_trip(fmt: str, media_type: str) -> None:
    for i, size in enumerate(SIZES[:3]):
        original = _random_image(size, i)
        data = _encode(original, fmt)
        got = load_image(_data_url(data, media_type))
        assert got.mode == "RGB" and got.size == size
        expected = Image.open(io.BytesIO(data)).convert("RGB")
        assert got.tobytes() == expected.tobytes()
        if fmt != "JPEG":  # lossless
            assert got.tobytes() == original.tobytes()


def test_bytes_and_pil_inputs_become_rgb() -> None:
    rgba = _random_image((12, 10), 3, "RGBA")
    from_pil = load_image(rgba)
    from_bytes = load_image(_encode(rgba, "PNG"))
    assert from_pil.mode == from_bytes.mode == "RGB"
    # As transformers' convert_to_rgb: alpha is dropped, not composited.
    assert from_pil.tobytes() == from_bytes.tobytes() == rgba.convert("RGB").tobytes()
    gray = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), "L")
    assert load_image(_data_url(_encode(gray, "PNG"), "image/png")).mode == "RGB"


def test_data_url_tolerates_line_wrapping_and_jpg_alias() -> None:
    data = _encode(_random_image((8, 8), 0), "JPEG")
    b64 = base64.b64encode(data).decode()
    wrapped = "\n".join(b64[i:i + 60] for i in range(0, len(b64), 60))
    assert load_image(f"data:image/jpg;base64,{wrapped}").size == (8, 8)


@pytest.mark.parametrize(("source", "message"), [
    ("data:image/png;base64,@@@not-base64@@@", "bad base64"),
    ("data:image/png;base64,iVBORw0KGgo", "bad base64"),  # wrong padding
    (_data_url(b"plain text, not pixels", "image/png"), "not an image"),
    (_data_url(_encode(_random_image((8, 8), 0), "PNG")[:60], "image/png"), "not an image: corrupt or truncated"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "unsupported image type 'image/gif'"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported image type 'text/plain'"),
    ("data:image/png,rawdata", "only ';base64'"),
    ("data:image/png;base64", "no ','"),
    ("ftp://example.com/x.png", "unsupported image source"),
    ("/etc/passwd", "unsupported image source"),
    ("https://evil.example/x.png", "image host 'evil.example' not allowed"),
    ("http://127.0.0.1/x.png", "image host '127.0.0.1' not allowed"),
    ("file:///etc/hostname", "file:// image URLs are not allowed"),
])
def test_refusals(source: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        load_image(source, allowed_domains=("images.example.com",))


def test_media_error_is_a_value_error() -> None:
    assert issubclass(MediaError, ValueError)


def test_gif_bytes_are_refused_even_when_declared_png() -> None:
    buf = io.BytesIO()
    _random_image((8, 8), 0).save(buf, format="GIF")
    with pytest.raises(MediaError, match="unsupported image format GIF"):
        load_image(_data_url(buf.getvalue(), "image/png"))
    with pytest.raises(MediaError, match="unsupported image format GIF"):
        load_image(buf.getvalue())


def test_oversized_inputs_are_refused(tmp_path: Path) -> None:
    data = _encode(_random_image((64, 64), 0), "PNG")
    limit = len(data) - 1
    with pytest.raises(MediaError, match="image too large"):
        load_image(_data_url(data, "image/png"), max_bytes=limit)
    with pytest.raises(MediaError, match="image too large"):
        load_image(data, max_bytes=limit)
    (tmp_path / "big.png").write_bytes(data)
    with pytest.raises(MediaError, match="image too large"):
        load_image((tmp_path / "big.png").as_uri(), allowed_local_path=str(tmp_path), max_bytes=limit)
    # A small file declaring a huge canvas is refused before its pixels are decoded.
    canvas = _encode(Image.new("RGB", (3000, 3000)), "PNG")
    assert len(canvas) < 100_000
    with pytest.raises(MediaError, match="3000x3000 pixels"):
        load_image(canvas, max_decoded_pixels=2000 * 2000)
    with pytest.raises(MediaError, match="pixels"):
        load_image(Image.new("RGB", (300, 300)), max_decoded_pixels=100 * 100)


def test_file_url_inside_allowed_dir_loads(tmp_path: Path) -> None:
    img = _random_image((10, 6), 5)
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "pic one.png"  # a space: the URI percent-encodes it
    path.write_bytes(_encode(img, "PNG"))
    got = load_image(path.as_uri(), allowed_local_path=str(tmp_path))
    assert got.tobytes() == img.tobytes()
    # A symlink that stays inside the directory is fine.
    (tmp_path / "link.png").symlink_to(path)
    assert load_image((tmp_path / "link.png").as_uri(), allowed_local_path=str(tmp_path)).size == (10, 6)


def test_file_url_escapes_are_refused(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "outside.png"
    outside.write_bytes(_encode(_random_image((4, 4), 0), "PNG"))
    (allowed / "escape.png").symlink_to(outside)
    (tmp_path / "allowed-sibling").mkdir()  # a name sharing the prefix is not inside
    sibling = tmp_path / "allowed-sibling" / "x.png"
    sibling.write_bytes(outside.read_bytes())
    for url in [
        outside.as_uri(),
        (allowed / "escape.png").as_uri(),  # symlink out
        f"file://{allowed}/../outside.png",  # dot-dot
        sibling.as_uri(),
    ]:
        with pytest.raises(MediaError, match="outside the allowed directory"):
            load_image(url, allowed_local_path=str(allowed))
    with pytest.raises(MediaError, match="names a host"):
        load_image(f"file://otherhost{outside}", allowed_local_path=str(allowed))
    os.mkfifo(allowed / "fifo.png")  # would block a plain open()
    for special in [allowed, allowed / "fifo.png"]:
        with pytest.raises(MediaError, match="not a regular file"):
            load_image(special.as_uri(), allowed_local_path=str(allowed))
    with pytest.raises(MediaError, match="cannot read image file"):
        load_image((allowed / "missing.png").as_uri(), allowed_local_path=str(allowed))


def test_redirects_are_rechecked() -> None:
    handler = image_mod._CheckedRedirects(["images.example.com"])
    request = image_mod.urllib.request.Request("https://images.example.com/a.png")
    with pytest.raises(MediaError, match=r"image host 'evil\.example' not allowed"):
        handler.redirect_request(request, None, 302, "Found", {}, "https://evil.example/a.png")
    with pytest.raises(MediaError, match="scheme 'file' not allowed"):
        handler.redirect_request(request, None, 302, "Found", {}, "file:///etc/passwd")
    ok = handler.redirect_request(request, None, 302, "Found", {}, "https://IMAGES.example.com/b.png")
    assert ok is not None and ok.full_url == "https://IMAGES.example.com/b.png"


class _FakeResponse(io.BytesIO):
    def __init__(self, body: bytes, length: str | None) -> None:
        super().__init__(body)
        self.headers = {} if length is None else {"Content-Length": length}


class _FakeOpener:
    def __init__(self, body: bytes, length: str | None) -> None:
        self.body, self.length = body, length
        self.calls: list[tuple[str, float]] = []

    def open(self, request: Any, timeout: float) -> _FakeResponse:
        self.calls.append((request.full_url, timeout))
        return _FakeResponse(self.body, self.length)


Install = Callable[[bytes, "str | None"], _FakeOpener]


@pytest.fixture
def install_opener(monkeypatch: pytest.MonkeyPatch) -> Install:
    """Replaces the urllib opener with one that serves ``body`` (and a Content-Length, if given)."""

    def install(body: bytes, length: str | None) -> _FakeOpener:
        opener = _FakeOpener(body, length)
        monkeypatch.setattr(image_mod, "_build_opener", lambda allowed: opener)
        return opener

    return install


def test_remote_fetch_limits(install_opener: Install) -> None:
    data = _encode(_random_image((8, 8), 0), "PNG")
    url = "https://images.example.com/a.png"
    allowed = ["images.example.com"]
    opener = install_opener(data, str(len(data)))
    assert load_image(url, allowed_domains=allowed, timeout_s=3).size == (8, 8)
    assert opener.calls == [(url, 3)]
    install_opener(data, str(len(data)))  # declared too large
    with pytest.raises(MediaError, match=f"image too large: {len(data)} bytes"):
        load_image(url, allowed_domains=allowed, max_bytes=len(data) - 1)
    install_opener(data, None)  # no Content-Length: counted while reading
    with pytest.raises(MediaError, match="image too large: over"):
        load_image(url, allowed_domains=allowed, max_bytes=len(data) - 1)
    install_opener(data, None)
    with pytest.raises(MediaError, match="timed out"):
        load_image(url, allowed_domains=allowed, timeout_s=-1)


# ---------------------------------------------------------------------------------------------------------------------
# Pixels.


def test_settings_read_the_checkpoint(checkpoint: str) -> None:
    s = ImageProcessorSettings.from_checkpoint(checkpoint)
    assert (s.patch_size, s.temporal_patch_size, s.merge_size) == (PATCH, TEMPORAL, MERGE)
    assert (s.min_pixels, s.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    assert s.image_mean == s.image_std == (0.5, 0.5, 0.5)
    # Top-level min_pixels / max_pixels override size, as in transformers.
    legacy = ImageProcessorSettings.from_dict({"size": {"shortest_edge": 1, "longest_edge": 2}, "max_pixels": 999})
    assert (legacy.min_pixels, legacy.max_pixels) == (1, 999)
    assert ImageProcessorSettings.from_dict({}) == ImageProcessorSettings()
    with pytest.raises(ValueError, match="do_normalize=false"):
        ImageProcessorSettings.from_dict({"do_normalize": False})
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        ImageProcessorSettings.from_checkpoint(os.path.dirname(checkpoint))


def test_pixels_match_transformers(checkpoint: str) -> None:
    # With torchvision installed AutoImageProcessor would pick the torchvision class (another resize); hyserve always
    # uses the PIL one, which is also what it picks without torchvision.
    reference = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    assert type(reference) is Qwen2VLImageProcessorPil
    images = [load_image(_data_url(_encode(_random_image(size, i), fmt), mt))
              for i, (size, (fmt, mt)) in enumerate(zip(SIZES, FORMATS * 2))]
    got = process_images(images, checkpoint)
    expected = reference(images=images, return_tensors="pt")
    assert torch.equal(got.pixel_values, expected["pixel_values"])
    assert torch.equal(got.grid_thw, expected["image_grid_thw"])
    assert got.pixel_values.dtype == torch.float32 and got.grid_thw.dtype == torch.int64
    assert got.pixel_values.shape == (int(got.grid_thw.prod(-1).sum()), 3 * TEMPORAL * PATCH**2)
    assert got.token_counts == vision_token_count(got.grid_thw, MERGE)
    assert len({tuple(g) for g in got.grid_thw.tolist()}) > 3  # sizes really differ
    # Every grid respects the pixel bounds after resizing.
    for _, h, w in got.grid_thw.tolist():
        assert MIN_PIXELS <= h * w * PATCH**2 <= MAX_PIXELS and h % MERGE == 0 and w % MERGE == 0


def test_process_one_and_no_images(checkpoint: str) -> None:
    one = process_images([_random_image((30, 20), 0)], checkpoint)
    assert one.grid_thw.shape == (1, 3) and len(one.hashes) == len(one.token_counts) == 1
    none = process_images([], checkpoint)
    assert none.pixel_values.shape == (0, 3 * TEMPORAL * PATCH**2) and none.grid_thw.shape == (0, 3)
    assert none.token_counts == [] and none.hashes == []


def test_extreme_aspect_ratio_is_a_media_error(checkpoint: str) -> None:
    with pytest.raises(MediaError, match="aspect ratio"):
        process_images([_random_image((402, 2), 0)], checkpoint)


def test_hashes_identify_content(checkpoint: str) -> None:
    a = _random_image((20, 20), 1)
    a_again = load_image(_encode(a, "PNG"))  # same pixels, different object and source
    b = a.copy()
    b.putpixel((3, 4), (0, 0, 0) if a.getpixel((3, 4)) != (0, 0, 0) else (1, 1, 1))
    flat = Image.frombytes("RGB", (10, 40), a.tobytes())  # same bytes, other size
    hashes = process_images([a, a_again, b, flat, a.convert("RGBA")], checkpoint).hashes
    assert hashes[0] == hashes[1] == hashes[4]
    assert len({hashes[0], hashes[2], hashes[3]}) == 3
    assert all(len(h) == 64 for h in hashes)


# ---------------------------------------------------------------------------------------------------------------------
# Placeholders.


def test_expand_image_placeholders() -> None:
    vs, ve = 248053, 248054
    ids = [1, vs, IMAGE_TOKEN, ve, 2, vs, IMAGE_TOKEN, ve, 3]
    assert expand_image_placeholders(ids, [3, 2], IMAGE_TOKEN) == (
        [1, vs] + [IMAGE_TOKEN] * 3 + [ve, 2, vs] + [IMAGE_TOKEN] * 2 + [ve, 3]
    )
    assert expand_image_placeholders([IMAGE_TOKEN], [4], IMAGE_TOKEN) == [IMAGE_TOKEN] * 4
    assert expand_image_placeholders([5, 6], [], IMAGE_TOKEN) == [5, 6]


def test_expand_image_placeholders_mismatch() -> None:
    ids = [1, IMAGE_TOKEN, 2, IMAGE_TOKEN]
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_image_placeholders(ids, [3], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="2 image placeholders but 3 images"):
        expand_image_placeholders(ids, [3, 3, 3], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="0 image placeholders but 1 images"):
        expand_image_placeholders([1, 2], [3], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="tokens 1 and 2 touch"):
        expand_image_placeholders([1, IMAGE_TOKEN, IMAGE_TOKEN], [1, 1], IMAGE_TOKEN)
