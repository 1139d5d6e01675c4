"""OpenAI-style chat content parts -> (messages for the chat template, images), for ``LLM.chat`` and the server.

A message's ``content`` is a string or a list of parts:

* ``{"type": "text", "text": str}``;
* ``{"type": "image_url", "image_url": {"url": str}}`` (or ``"image_url": str``, as vLLM accepts); the url is a
  ``data:image/...;base64,`` URL, an ``http(s)://`` URL on an allowed host or a ``file://`` URL under the allowed
  directory (``load_image``'s rules);
* offline only (``LLM.chat``, as vLLM's): ``{"type": "image_pil", "image_pil": PIL.Image}`` and
  ``{"type": "image", "image": PIL.Image | bytes | url}``. A part without ``type`` but with an ``image_url`` or
  ``image_pil`` key is that kind of part (vLLM's rule).

Parsing (``parse_messages``) checks the parts' shapes and collects the image sources in order without reading any
of them; ``check_images`` then refuses images for a text-only model and more images than ``--limit-mm-per-prompt``
allows; only after that does ``load_images`` fetch and decode them (decoding before the count is checked let one
request make a server decode thousands of images: vLLM's CVE-2025-30202 class of bug). Every refusal is a
``ContentPartError`` whose message starts with, and whose ``param`` is, the part's path (``messages[1].content[2]``).

The template messages: a message with images keeps its parts, each image as ``{"type": "image"}`` (Qwen's template
renders ``<|vision_start|><|image_pad|><|vision_end|>`` for it) and text parts as they are. Messages without images
render as before: the server joins text parts with ``"\\n"`` into one string, ``LLM.chat`` passes them unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from hyserve.multimodal.image import ImageProcessorSettings, MediaError, load_image

ImageSource = str | bytes | Image.Image

SERVER_PART_TYPES = ("text", "image_url")
OFFLINE_PART_TYPES = ("text", "image_url", "image_pil", "image")
_IMAGE_PART_TYPES = frozenset({"image_url", "image_pil", "image"})
# What a part without "type" is, from its keys (vLLM's rule).
_TYPELESS_KEYS = ("image_url", "image_pil")
_TEMPLATE_IMAGE = {"type": "image"}


class ContentPartError(ValueError):
    """A message's content (or one of its parts) is refused; ``param`` is its path, e.g. ``messages[1].content[2]``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ImagePartError(ContentPartError, MediaError):
    """An image part could not be loaded (``load_image``'s ``MediaError``, prefixed with the part's path)."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part not yet loaded: its source and its path in the request."""

    source: ImageSource
    where: str


@dataclass(slots=True)
class ParsedChat:
    """Messages ready for the chat template (images as ``{"type": "image"}`` parts) and their images, in order."""

    messages: list[dict[str, Any]]
    images: list[ImageRef]


# ---------------------------------------------------------------------------------------------------- parsing


def _describe(x: Any, limit: int = 60) -> str:
    r = repr(x) if not isinstance(x, Image.Image) else f"<PIL image {x.size[0]}x{x.size[1]}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _part_type(part: Mapping[str, Any], where: str, part_types: Collection[str]) -> str:
    kind = part.get("type")
    if kind is None:
        for key in _TYPELESS_KEYS:
            if key in part and key in part_types:
                return key
        raise ContentPartError(f"{where} has no 'type'; supported part types are {', '.join(part_types)}", where)
    if not isinstance(kind, str) or kind not in part_types:
        raise ContentPartError(f"{where}: unknown content part type {_describe(kind)}; supported part types are "
                               f"{', '.join(part_types)}", where)
    return kind


def _check_keys(obj: Mapping[str, Any], allowed: Collection[str], where: str, what: str) -> None:
    """Keys other than ``allowed`` are accepted only as null (their no-op value)."""
    for key, value in obj.items():
        if key not in allowed and value is not None:
            raise ContentPartError(f"{where}: {_describe(str(key))} is not supported in {what} (only "
                                   f"{', '.join(allowed)})", where)


def _image_url(part: Mapping[str, Any], where: str) -> str:
    value = part.get("image_url")
    if isinstance(value, Mapping):
        _check_keys(value, ("url", "detail"), where, "image_url")
        detail = value.get("detail")
        if detail not in (None, "auto"):
            raise ContentPartError(f"{where}: image_url.detail {_describe(detail)} is not supported (only 'auto')",
                                   where)
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ContentPartError(f"{where}: image_url must be {{'url': str}} or a URL string (got {_describe(value)})",
                               where)
    return value


def _image_source(part: Mapping[str, Any], kind: str, where: str) -> ImageSource:
    _check_keys(part, ("type", kind), where, f"an {kind!r} part")
    if kind == "image_url":
        return _image_url(part, where)
    value = part.get(kind)
    if isinstance(value, Image.Image):
        return value
    if kind == "image_pil":
        raise ContentPartError(f"{where}: image_pil must be a PIL.Image.Image (got {_describe(value)})", where)
    if not isinstance(value, bytes | bytearray | str) or not value:
        raise ContentPartError(f"{where}: image must be a PIL image, encoded bytes or a URL (got "
                               f"{_describe(value)})", where)
    return bytes(value) if isinstance(value, bytearray) else value


def parse_content(content: list[Any], where: str, *, part_types: Collection[str] = OFFLINE_PART_TYPES,
                  join_text: bool = False) -> tuple[str | list[Any], list[ImageRef]]:
    """A message's list of parts -> (its template content, its images); no image is read.

    Without images the content is the texts joined with ``"\\n"`` (``join_text``, the server's rendering) or the
    list unchanged; with images, the parts with each image as ``{"type": "image"}``.
    """
    refs: list[ImageRef] = []
    template: list[Any] = []
    texts: list[str] = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise ContentPartError(f"{here} must be an object such as {{'type': 'text', 'text': str}} (got "
                                   f"{_describe(part)})", here)
        kind = _part_type(part, here, part_types)
        if kind in _IMAGE_PART_TYPES:
            refs.append(ImageRef(_image_source(part, kind, here), here))
            template.append(dict(_TEMPLATE_IMAGE))
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise ContentPartError(f"{here} must be {{'type': 'text', 'text': str}} (got text={_describe(text)})",
                                   here)
        texts.append(text)
        template.append({"type": "text", "text": text} if join_text else part)
    if refs:
        return template, refs
    return ("\n".join(texts) if join_text else content), refs


def parse_messages(messages: Sequence[Mapping[str, Any]], *, part_types: Collection[str] = OFFLINE_PART_TYPES,
                   join_text: bool = False, where: str = "messages") -> ParsedChat:
    """Template messages and image references of a conversation (``LLM.chat``'s form: other keys pass as they are).

    A message whose content is not a list is left unchanged; so is a list without images unless ``join_text``.
    """
    out: list[dict[str, Any]] = []
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ContentPartError(f"{where}[{i}] must be a dict with 'role' and 'content' (got "
                                   f"{_describe(message)})", f"{where}[{i}]")
        content = message.get("content")
        if isinstance(content, list):
            content, found = parse_content(content, f"{where}[{i}].content", part_types=part_types,
                                           join_text=join_text)
            refs += found
            out.append({**message, "content": content})
        else:
            out.append(dict(message))
    return ParsedChat(out, refs)


# ---------------------------------------------------------------------------------------------- checks and loading


def check_images(refs: Sequence[ImageRef], *, limit: int, accepts_images: bool = True,
                 refusal: str | None = None) -> None:
    """Refuse images for a model that takes none (``refusal``: why one with a vision tower takes none) and more
    than ``limit`` per prompt, before any is read."""
    if not refs:
        return
    if refusal is not None:
        raise ContentPartError(f"{refs[0].where}: {refusal}", refs[0].where)
    if not accepts_images:
        why = ("image input is off (--limit-mm-per-prompt image=0)" if limit == 0 else
               "this model takes text only (its checkpoint has no vision tower): image parts need a "
               "Qwen3_5ForConditionalGeneration checkpoint")
        raise ContentPartError(f"{refs[0].where}: {why}", refs[0].where)
    if len(refs) > limit:
        first_over = refs[limit].where
        raise ContentPartError(f"{first_over}: the prompt has {len(refs)} images; at most {limit} images per prompt "
                               "are allowed (--limit-mm-per-prompt)", first_over)


def load_images(refs: Sequence[ImageRef], *, allowed_domains: Sequence[str] | None = None,
                allowed_local_path: str | None = None) -> list[Image.Image]:
    """Fetch and decode every image in order (``load_image``); a ``MediaError`` becomes an ``ImagePartError``
    naming the part: ``messages[1].content[2]: not an image: ...``. Blocking: run it off the event loop."""
    images: list[Image.Image] = []
    for ref in refs:
        try:
            images.append(load_image(ref.source, allowed_domains=tuple(allowed_domains or ()),
                                     allowed_local_path=allowed_local_path))
        except MediaError as e:
            raise ImagePartError(f"{ref.where}: {e}", ref.where) from None
    return images


def chat_inputs(messages: Sequence[Mapping[str, Any]], *, limit: int, accepts_images: bool = True,
                refusal: str | None = None, allowed_domains: Sequence[str] | None = None,
                allowed_local_path: str | None = None,
                part_types: Collection[str] = OFFLINE_PART_TYPES, where: str = "messages"
                ) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """``parse_messages``, ``check_images`` and ``load_images`` in that order: the template messages and the loaded
    images of one conversation (``LLM.chat``)."""
    parsed = parse_messages(messages, part_types=part_types, where=where)
    check_images(parsed.images, limit=limit, accepts_images=accepts_images, refusal=refusal)
    images = load_images(parsed.images, allowed_domains=allowed_domains, allowed_local_path=allowed_local_path)
    return parsed.messages, images


# ---------------------------------------------------------------------------------------------------- token counts


def image_token_count(size: tuple[int, int], settings: ImageProcessorSettings) -> int:
    """Placeholder tokens an image of ``size`` (width, height) expands to: its resized patch grid (transformers'
    ``smart_resize``, as ``process_images`` resizes) over ``merge_size**2``. Raises ``MediaError`` for a size the
    processor refuses (an aspect ratio over 200). Reads no pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    width, height = size
    factor = settings.patch_size * settings.merge_size
    try:
        h, w = smart_resize(height, width, factor=factor, min_pixels=settings.min_pixels,
                            max_pixels=settings.max_pixels)
    except ValueError as e:
        raise MediaError(f"image cannot be processed: {e}") from None
    return (h // settings.patch_size) * (w // settings.patch_size) // settings.merge_size**2


def image_token_counts(images: Sequence[Image.Image], refs: Sequence[ImageRef],
                       settings: ImageProcessorSettings) -> list[int]:
    """``image_token_count`` of each image; a refusal names its part (``ImagePartError``)."""
    counts = []
    for img, ref in zip(images, refs, strict=True):
        try:
            counts.append(image_token_count(img.size, settings))
        except MediaError as e:
            raise ImagePartError(f"{ref.where}: {e}", ref.where) from None
    return counts
