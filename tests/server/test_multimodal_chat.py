"""The image front-end: chat content parts -> template messages and images (``hyserve.multimodal.chat``), the image
flags, ``LLM.chat`` / ``LLM.generate`` handing images to the engine, and the server's refusals (400s naming the part).

Everything here is refused or captured before the engine processes an image, so it runs on the tiny text
checkpoints; image requests served end to end are in ``test_multimodal_server_e2e.py``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

import hyserve.llm
from hyserve import LLM
from hyserve.cli import build_parser
from hyserve.config import EngineConfig, MultimodalConfig, normalize_mm_limits
from hyserve.engine.llm_engine import LLMEngine
from hyserve.engine_args import make_llm, mm_limits
from hyserve.multimodal import chat
from hyserve.multimodal.chat import (
    OFFLINE_PART_TYPES,
    SERVER_PART_TYPES,
    ContentPartError,
    ImagePartError,
    chat_inputs,
    check_images,
    image_token_count,
    load_images,
    parse_content,
    parse_messages,
)
from hyserve.multimodal.image import ImageProcessorSettings, MediaError, process_images
from hyserve.server import AsyncEngine, build_app
from hyserve.testing import write_tiny_checkpoint
from hyserve.testing.server import ServerThread

CACHE_BYTES = 64 * 1024 * 1024
MODEL = "tiny-mm"
# Renders every image part as Qwen's placeholder (the tiny text checkpoints' template takes string content only).
IMAGE_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string %}{{ m.content }}{%- else %}{%- for p in m.content %}"
    "{%- if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{%- else %}{{ p.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}{{ '<|im_start|>assistant\\n' }}"
)


def png(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def no_decoding(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Make any image load fail the test (and record it): proves a refusal came before any fetch or decode."""
    calls: list[Any] = []

    def refuse(source: Any, **kw: Any) -> Image.Image:
        calls.append(source)
        raise AssertionError("an image was loaded before the request was refused")

    monkeypatch.setattr(chat, "load_image", refuse)
    return calls


# ---------------------------------------------------------------------------------------------------- parsing


def test_parts_and_images_in_order() -> None:
    a, b, c = data_url(png(color=(1, 2, 3))), data_url(png(color=(4, 5, 6))), data_url(png(color=(7, 8, 9)))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text_part("first"), image_part(a), text_part("then"), {"type": "image_url",
                                                                                           "image_url": b}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"image_url": {"url": c, "detail": "auto"}}, text_part("last")], "name": "u"},
    ]
    parsed = parse_messages(messages, part_types=SERVER_PART_TYPES, join_text=True)
    assert [r.source for r in parsed.images] == [a, b, c]
    assert [r.where for r in parsed.images] == ["messages[1].content[1]", "messages[1].content[3]",
                                                "messages[3].content[0]"]
    assert parsed.messages[0] == {"role": "system", "content": "Be brief."}  # string content unchanged
    assert parsed.messages[1]["content"] == [text_part("first"), {"type": "image"}, text_part("then"),
                                             {"type": "image"}]
    assert parsed.messages[3] == {"role": "user", "content": [{"type": "image"}, text_part("last")], "name": "u"}
    template, images = chat_inputs(messages, limit=3)
    assert template == parsed.messages
    assert [img.getpixel((0, 0)) for img in images] == [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    assert all(img.mode == "RGB" and img.size == (8, 6) for img in images)


def test_text_only_content_renders_as_before() -> None:
    parts = [text_part("a"), text_part("b")]
    assert parse_content(parts, "m", part_types=SERVER_PART_TYPES, join_text=True) == ("a\nb", [])  # the server's
    content, refs = parse_content(parts, "m")  # LLM.chat: the list as given
    assert content is parts and refs == []
    convo = [{"role": "user", "content": "hi", "extra": 1}]
    assert parse_messages(convo).messages == convo


def test_offline_part_kinds() -> None:
    pil = Image.new("RGBA", (5, 4), (9, 8, 7, 6))
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": pil}, {"image_pil": pil}, {"type": "image", "image": png()},
        {"type": "image", "image": data_url(png())}, {"type": "image", "image": pil}, {"image_url": data_url(png())},
        text_part("what?")]}]
    template, images = chat_inputs(messages, limit=10)
    assert len(images) == 6 and all(img.mode == "RGB" for img in images)
    assert images[0].size == (5, 4) and images[0].getpixel((0, 0)) == (9, 8, 7)
    assert template[0]["content"] == [{"type": "image"}] * 6 + [text_part("what?")]
    # The server takes JSON parts only.
    with pytest.raises(ContentPartError) as info:
        parse_messages([{"role": "user", "content": [{"type": "image", "image": "x"}]}], part_types=SERVER_PART_TYPES)
    assert info.value.param == "messages[0].content[0]"
    assert "'image'" in str(info.value) and "text, image_url" in str(info.value)


@pytest.mark.parametrize(("part", "needle"), [
    ({"type": "input_audio", "input_audio": {}}, "unknown content part type 'input_audio'; supported part types are "
                                                 + ", ".join(OFFLINE_PART_TYPES)),
    ({"type": 3}, "unknown content part type 3"),
    ({"text": "no type"}, "has no 'type'"),
    ("just a string", "must be an object"),
    ({"type": "text"}, "'type': 'text', 'text': str"),
    ({"type": "text", "text": 5}, "'type': 'text', 'text': str"),
    ({"type": "image_url"}, "image_url must be {'url': str} or a URL string"),
    ({"type": "image_url", "image_url": {"url": ""}}, "image_url must be"),
    ({"type": "image_url", "image_url": {"url": "data:,", "detail": "high"}}, "detail 'high' is not supported"),
    ({"type": "image_url", "image_url": {"url": "data:,", "uuid": "u1"}}, "'uuid' is not supported in image_url"),
    ({"type": "image_url", "image_url": "data:,", "uuid": "u1"}, "'uuid' is not supported in an 'image_url' part"),
    ({"type": "image_pil", "image_pil": b"png"}, "image_pil must be a PIL.Image.Image"),
    ({"type": "image", "image": 5}, "image must be a PIL image, encoded bytes or a URL"),
])
def test_malformed_parts_name_the_part(part: Any, needle: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"},
                                      {"role": "user", "content": [text_part("x"), part]}]
    with pytest.raises(ContentPartError) as info:
        parse_messages(messages)
    assert info.value.param == "messages[1].content[1]"
    assert str(info.value).startswith("messages[1].content[1]")
    assert needle in str(info.value)


@pytest.mark.parametrize(("url", "needle"), [
    (data_url(png())[:-8] + "!!!!" + data_url(png())[-4:], "bad base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not a png").decode(), "not an image"),
    (data_url(png()[:40]), "not an image"),  # truncated
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "unsupported image type 'image/gif'"),
    ("ftp://example.com/a.png", "unsupported image source"),
])
def test_bad_image_data_names_the_part(url: str, needle: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"},
                                      {"role": "user", "content": [text_part("a"), text_part("b"), image_part(url)]}]
    with pytest.raises(ImagePartError) as info:
        chat_inputs(messages, limit=5)
    err = info.value
    assert isinstance(err, MediaError) and isinstance(err, ContentPartError)
    assert err.param == "messages[1].content[2]"
    assert str(err).startswith("messages[1].content[2]: ") and needle in str(err), str(err)


def test_too_many_images_refused_before_any_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = no_decoding(monkeypatch)
    url = data_url(png())
    messages = [{"role": "user", "content": [image_part(url), text_part("a")]},
                {"role": "user", "content": [image_part(url), image_part(url), image_part("not even a url")]}]
    with pytest.raises(ContentPartError) as info:
        chat_inputs(messages, limit=2)
    assert info.value.param == "messages[1].content[1]"  # the first image over the limit
    assert str(info.value) == ("messages[1].content[1]: the prompt has 4 images; at most 2 images per prompt are "
                               "allowed (--limit-mm-per-prompt)")
    assert calls == []
    with pytest.raises(ContentPartError, match="at most 0 images"):
        chat_inputs(messages, limit=0)
    # A text-only model refuses the first image, also before reading it.
    with pytest.raises(ContentPartError) as info:
        chat_inputs(messages, limit=10, accepts_images=False)
    assert info.value.param == "messages[0].content[0]" and "takes text only" in str(info.value)
    assert calls == []
    check_images([], limit=0, accepts_images=False)  # no images: nothing to refuse


def test_remote_urls_need_an_allowed_domain(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*a: Any, **kw: Any) -> Any:
        raise AssertionError("a refused URL was fetched")

    monkeypatch.setattr("hyserve.multimodal.image._build_opener", no_network)
    messages = [{"role": "user", "content": [image_part("https://example.com/cat.png")]}]
    for allowed in (None, [], ["example.org", "cdn.example.com"]):
        with pytest.raises(ImagePartError) as info:
            chat_inputs(messages, limit=1, allowed_domains=allowed)
        assert str(info.value) == "messages[0].content[0]: image host 'example.com' not allowed"


def test_local_files_only_under_the_allowed_path(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "red.png").write_bytes(png(color=(255, 0, 0)))
    (tmp_path / "secret.png").write_bytes(png())
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")

    def load(url: str, root: Path | None) -> Image.Image:
        messages = [{"role": "user", "content": [text_part("look"), image_part(url)]}]
        return chat_inputs(messages, limit=1, allowed_local_path=None if root is None else str(root))[1][0]

    img = load((allowed / "red.png").as_uri(), allowed)
    assert img.size == (8, 6) and img.getpixel((3, 3)) == (255, 0, 0)
    for url, root, needle in [
        ((allowed / "red.png").as_uri(), None, "file:// image URLs are not allowed"),
        ((tmp_path / "secret.png").as_uri(), allowed, "outside the allowed directory"),
        ((allowed / ".." / "secret.png").as_uri(), allowed, "outside the allowed directory"),
        ((allowed / "link.png").as_uri(), allowed, "outside the allowed directory"),
        ((allowed / "missing.png").as_uri(), allowed, "cannot read image file"),
    ]:
        with pytest.raises(ImagePartError) as info:
            load(url, root)
        assert info.value.param == "messages[0].content[1]" and needle in str(info.value), str(info.value)


def test_load_images_keeps_order_and_names_the_failing_part() -> None:
    refs = parse_messages([{"role": "user", "content": [image_part(data_url(png(3, 3))),
                                                        image_part("data:image/png;base64,AAAA")]}]).images
    assert [img.size for img in load_images(refs[:1])] == [(3, 3)]
    with pytest.raises(ImagePartError, match=r"^messages\[0\]\.content\[1\]: not an image"):
        load_images(refs)


@pytest.mark.parametrize("size", [(8, 6), (32, 48), (48, 32), (100, 60), (640, 480), (17, 300), (1, 1)])
def test_image_token_count_matches_the_processor(size: tuple[int, int]) -> None:
    for settings in (ImageProcessorSettings(patch_size=4, merge_size=2, min_pixels=16 * 16, max_pixels=48 * 48),
                     ImageProcessorSettings()):
        img = Image.new("RGB", size, (10, 20, 30))
        assert image_token_count(size, settings) == process_images([img], "", settings=settings).token_counts[0]
    with pytest.raises(MediaError, match="cannot be processed"):
        image_token_count((4000, 10), ImageProcessorSettings())  # aspect ratio over 200


# ---------------------------------------------------------------------------------------------------- flags


def test_limit_mm_per_prompt_flag_forms() -> None:
    assert mm_limits('{"image": 2}') == {"image": 2}
    assert mm_limits('{"image": {"count": 3}}') == {"image": 3}
    with pytest.raises(argparse.ArgumentTypeError, match="width and height are not used"):
        mm_limits('{"image": {"count": 1, "width": 512, "height": 512}}')
    assert mm_limits('{"image": 0}') == {"image": 0}
    for bad, needle in [("{image: 2}", "not valid JSON"), ("[2]", "JSON object"), ('{"image": -1}', "non-negative"),
                        ('{"image": "2"}', "non-negative"), ('{"image": true}', "non-negative"),
                        ('{"image": {"n": 2}}', "give a count"), ('{"image": {"count": 2, "fps": 1}}', "give a count")]:
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            mm_limits(bad)
    assert normalize_mm_limits({"image": {"count": 4}}) == {"image": 4}


def test_image_flags_parse_and_reach_the_llm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    media = tmp_path / "media"
    media.mkdir()
    args = build_parser().parse_args(["serve", "model-dir", "--limit-mm-per-prompt", '{"image": {"count": 2}}',
                                      "--allowed-media-domains", "a.example", "b.example",
                                      "--allowed-local-media-path", str(media)])
    assert args.limit_mm_per_prompt == {"image": 2}
    assert args.allowed_media_domains == ["a.example", "b.example"]
    assert args.allowed_local_media_path == str(media)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(hyserve.llm, "LLM", lambda **kw: seen.update(kw))
    make_llm(args, "model-dir")
    assert seen["limit_mm_per_prompt"] == {"image": 2}
    assert seen["allowed_media_domains"] == ["a.example", "b.example"]
    assert seen["allowed_local_media_path"] == str(media)
    for sub in ("generate", "demo", "bench", "soak"):  # every subcommand takes the engine flags
        ns = build_parser().parse_args([sub, "--limit-mm-per-prompt", '{"image": 1}'])
        assert ns.limit_mm_per_prompt == {"image": 1}
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.limit_mm_per_prompt, defaults.allowed_media_domains, defaults.allowed_local_media_path) == (
        None, None, None)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--allowed-local-media-path", "/no/such/dir"], "'/no/such/dir' does not exist"),
    (["--limit-mm-per-prompt", "image=2"], "not valid JSON"),
    (["--limit-mm-per-prompt", '{"image": -2}'], "non-negative"),
])
def test_bad_image_flags_are_clear_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and argv[0] in err, err


def test_local_media_path_must_be_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file.png"
    f.write_bytes(png())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-local-media-path", str(f)])
    assert "is not a directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- LLM


@pytest.fixture(scope="module")
def text_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("mm") / "tiny-text"))


@pytest.fixture(scope="module")
def vlm_config_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint whose config says it takes images, with ``IMAGE_TEMPLATE`` as its chat template; its tokenizer
    has no ``<|image_pad|>`` token, so no image request gets past the server's checks (only refusals here)."""
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("mm") / MODEL), form="conditional")
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = IMAGE_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llm(text_path: str, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    media = tmp_path_factory.mktemp("media")
    return LLM(model=text_path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES,
               limit_mm_per_prompt={"image": {"count": 2}}, allowed_media_domains=["img.example"],
               allowed_local_media_path=str(media))


class Captured(Exception):
    """Raised by the captured ``add_request``: the prompt reached the engine."""


def capture_requests(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[Any]:
    """Record every prompt ``add_request`` gets (and stop there)."""
    seen: list[Any] = []

    def add_request(request_id: str, prompt: Any, params: Any = None) -> None:
        seen.append(prompt)
        raise Captured

    monkeypatch.setattr(llm.llm_engine, "add_request", add_request)
    monkeypatch.setattr(llm.llm_engine, "abort_request", lambda ids: None)
    return seen


def test_llm_keyword_arguments_reach_the_engine_config(llm: LLM) -> None:
    config = llm.llm_engine.config
    assert config.limit_mm_per_prompt == {"image": 2} and config.image_limit == 2
    assert config.allowed_media_domains == ["img.example"]
    assert config.allowed_local_media_path is not None


def test_llm_generate_passes_multi_modal_data_through(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = capture_requests(monkeypatch, llm)
    img = Image.new("RGB", (4, 4))
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>hi", "multi_modal_data": {"image": img}}
    with pytest.raises(Captured):
        llm.generate(prompt, use_tqdm=False)
    with pytest.raises(Captured):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": [img, img]}}], use_tqdm=False)
    assert seen[0] is prompt
    assert seen[1]["multi_modal_data"]["image"] == [img, img]


def test_llm_chat_sends_images_to_the_engine(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = capture_requests(monkeypatch, llm)
    monkeypatch.setattr(llm.llm_engine.model_config, "multimodal", MultimodalConfig())
    red = Image.new("RGB", (6, 6), (255, 0, 0))
    messages = [{"role": "user", "content": [text_part("look:"), {"type": "image_pil", "image_pil": red},
                                             image_part(data_url(png())), text_part("what?")]}]
    with pytest.raises(Captured):
        llm.chat(messages, use_tqdm=False, chat_template_kwargs={"chat_template": IMAGE_TEMPLATE})
    prompt = seen[0]
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert prompt["prompt"] == f"<|im_start|>user\nlook:{placeholder}{placeholder}what?<|im_end|>\n" \
                               "<|im_start|>assistant\n"
    assert prompt["prompt_token_ids"] == llm.get_tokenizer().encode(prompt["prompt"], add_special_tokens=False)
    images = prompt["multi_modal_data"]["image"]
    assert len(images) == 2 and images[0].getpixel((0, 0)) == (255, 0, 0) and images[1].size == (8, 6)
    # Text-only conversations go as before: no multi_modal_data.
    with pytest.raises(Captured):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert set(seen[1]) == {"prompt", "prompt_token_ids"}
    # Refusals name the part; in a batch of conversations, the conversation too.
    too_many: list[dict[str, Any]] = [{"role": "user", "content": [image_part(data_url(png()))] * 3}]
    with pytest.raises(ContentPartError, match=r"^messages\[0\]\.content\[2\]: .*--limit-mm-per-prompt"):
        llm.chat(too_many, use_tqdm=False)
    with pytest.raises(ContentPartError, match=r"^messages\[1\]\[0\]\.content\[2\]: .*--limit-mm-per-prompt"):
        llm.chat([[{"role": "user", "content": "hi"}], too_many], use_tqdm=False)
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[0\]: image host 'other.example' not allowed"):
        llm.chat([{"role": "user", "content": [image_part("https://other.example/a.png")]}], use_tqdm=False)
    assert len(seen) == 2


def test_llm_chat_refuses_images_for_a_text_only_model(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    no_decoding(monkeypatch)
    with pytest.raises(ContentPartError, match=r"^messages\[0\]\.content\[1\]: this model takes text only"):
        llm.chat([{"role": "user", "content": [text_part("hi"), image_part(data_url(png()))]}], use_tqdm=False)


# ---------------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("served-media")
    (d / "ok.png").write_bytes(png())
    return d


@pytest.fixture(scope="module")
def server(vlm_config_path: str, media_dir: Path) -> Iterator[ServerThread]:
    engine = LLMEngine(EngineConfig(model=vlm_config_path, device="cpu", dtype="float32",
                                    cpu_cache_memory_bytes=CACHE_BYTES, limit_mm_per_prompt={"image": 2},
                                    allowed_local_media_path=str(media_dir)))
    assert engine.model_config.multimodal is not None
    async_engine = AsyncEngine(engine, start=False)
    app = build_app(async_engine, MODEL, trust_request_chat_template=True)
    with ServerThread(async_engine, app=app) as srv:
        yield srv


def post_chat(srv: ServerThread, content: Any, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": "s"},
                                                          {"role": "user", "content": content}], **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)


def check_400(r: httpx.Response, param: str, needle: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"].startswith(param + ": ") and needle in err["message"], err
    return str(err["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_server_bad_image_is_a_400_naming_the_part(server: ServerThread, stream: bool) -> None:
    garbage = "data:image/png;base64," + base64.b64encode(b"\x89PNG but not really").decode()
    for url, needle in [(garbage, "not an image"), ("data:image/png;base64,@@@@", "bad base64"),
                        ("data:image/png,raw", "only ';base64'"), ("x", "unsupported image source")]:
        r = post_chat(server, [text_part("look"), image_part(url)], stream=stream)
        check_400(r, "messages[1].content[1]", needle)
    server.settle()


def test_server_malformed_parts_are_400s(server: ServerThread) -> None:
    check_400(post_chat(server, [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]),
              "messages[1].content[0]", "unknown content part type 'input_audio'; supported part types are text, "
                                        "image_url")
    check_400(post_chat(server, [{"type": "image_pil", "image_pil": "x"}]), "messages[1].content[0]",
              "'image_pil'")
    check_400(post_chat(server, [{"type": "image_url", "image_url": {"url": data_url(png()), "detail": "low"}}]),
              "messages[1].content[0]", "detail 'low'")
    check_400(post_chat(server, [text_part("a"), {"type": "image_url", "image_url": 5}]), "messages[1].content[1]",
              "image_url must be")


def test_server_too_many_images_is_a_400_before_any_decode(server: ServerThread,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    calls = no_decoding(monkeypatch)  # the server thread runs in this process: a load would be a 500
    url = data_url(png())
    r = post_chat(server, [image_part(url), text_part("and"), image_part(url), image_part(url)])
    message = check_400(r, "messages[1].content[3]", "--limit-mm-per-prompt")
    assert "3 images" in message and "at most 2 images per prompt" in message
    assert calls == []
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL, max_tokens=2, stream=True,
            messages=[{"role": "user", "content": [image_part(url)] * 5}])  # type: ignore[misc,list-item]
    assert info.value.status_code == 400 and "--limit-mm-per-prompt" in str(info.value)
    assert calls == []
    server.settle()


def test_server_refuses_remote_and_outside_urls(server: ServerThread, media_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*a: Any, **kw: Any) -> Any:
        raise AssertionError("a refused URL was fetched")

    monkeypatch.setattr("hyserve.multimodal.image._build_opener", no_network)
    check_400(post_chat(server, [text_part("see"), image_part("https://example.com/cat.png")]),
              "messages[1].content[1]", "image host 'example.com' not allowed")
    check_400(post_chat(server, [image_part("http://127.0.0.1:1/x.png")]), "messages[1].content[0]",
              "image host '127.0.0.1' not allowed")
    check_400(post_chat(server, [image_part((media_dir.parent / "elsewhere.png").as_uri())]),
              "messages[1].content[0]", "outside the allowed directory")
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL, max_tokens=2, messages=[  # type: ignore[list-item]
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert "messages[0].content[1]: image host 'example.com' not allowed" in str(info.value)
    server.settle()


def test_server_allowed_file_reaches_the_placeholder_check(server: ServerThread, media_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The image loads; this checkpoint's tokenizer has no <|image_pad|> token, so the rendered prompt holds no
    # placeholder for it: a 400 naming the messages, before the engine sees the request.
    loaded: list[Any] = []
    real = chat.load_image

    def spy(source: Any, **kw: Any) -> Image.Image:
        loaded.append(source)
        return real(source, **kw)

    monkeypatch.setattr(chat, "load_image", spy)
    url = (media_dir / "ok.png").as_uri()
    r = post_chat(server, [text_part("see"), image_part(url)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "rendered 0 image placeholders for 1 images" in err["message"]
    assert loaded == [url]
    # A template that cannot render the parts is refused before any image is read.
    r = post_chat(server, [text_part("see"), image_part(url)], chat_template="{{ messages[1].content + 'x' }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "cannot render" in r.json()["error"]["message"] and loaded == [url]
    server.settle()


def test_server_text_parts_still_render_as_one_string(server: ServerThread) -> None:
    r = post_chat(server, [text_part("Hello"), text_part("there")], chat_template="{{ messages[1].content }}",
                  max_tokens=1, return_token_ids=True)
    assert r.status_code == 200, r.text
    tok = server.async_engine.engine.tokenizer
    assert tok is not None
    assert r.json()["prompt_token_ids"] == tok.encode("Hello\nthere", add_special_tokens=False)
    server.settle()


def test_text_only_server_refuses_images(text_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = no_decoding(monkeypatch)
    engine = LLMEngine(EngineConfig(model=text_path, device="cpu", dtype="float32",
                                    cpu_cache_memory_bytes=CACHE_BYTES))
    with ServerThread(AsyncEngine(engine, start=False), MODEL) as srv:
        check_400(post_chat(srv, [text_part("hi"), image_part(data_url(png()))]), "messages[1].content[1]",
                  "this model takes text only")
        r = post_chat(srv, "plain text still works")
        assert r.status_code == 200, r.text
        srv.settle()
    assert calls == []


def test_request_schema_lists_image_parts(server: ServerThread) -> None:
    schema = httpx.get(server.url + "/openapi.json").json()
    assert "image_url" in json.dumps(schema)
