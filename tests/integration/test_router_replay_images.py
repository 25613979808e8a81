"""The router replay's images (issue 40): for a VLM config, markdown images become ``Image`` chunks between
the text chunks, ``input_length`` counts each image as its placeholder text (LLaVA-NeXT: stock's
``config.rs`` rule), ``inputs`` carries them as data URIs; bad images are validation errors; for a text
model the markdown stays text."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from integration.router_replay.datatypes import GenerateParameters
from integration.router_replay.errors import ValidationError
from integration.router_replay.fake_shard import CharTokenizer
from integration.router_replay.images import ImageChunk, detect_mimetype, placeholder_rule, split_inputs
from integration.router_replay.queue import input_chunks
from integration.router_replay.validation import ValidationLimits, Validator

LLAVA_V16 = SimpleNamespace(
    model_type="llava_next",
    vision_config=SimpleNamespace(image_size=336, patch_size=14),
    image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
)


def _image(height: int, width: int, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format=fmt)
    return out.getvalue()


def _uri(data: bytes, label: str = "image/png") -> str:
    return f"data:{label};base64,{base64.b64encode(data).decode()}"


def _validate(inputs: str, rule=None, **limits):
    limits = {"max_input_tokens": 80_000, "max_total_tokens": 90_000, **limits}
    validator = Validator(CharTokenizer(), ValidationLimits(**limits), rule)
    return asyncio.run(validator.validate(inputs, GenerateParameters(max_new_tokens=4)))


def test_llava_next_images_become_chunks_counted_as_their_placeholders():
    rule = placeholder_rule(LLAVA_V16)
    png, jpeg = _image(640, 640), _image(480, 640, "JPEG")
    inputs = f"Look ![]({_uri(png)}) and ![]({_uri(jpeg, 'image/jpeg')}) now"
    valid = _validate(inputs, rule)
    texts = [c for c in valid.chunks if isinstance(c, str)]
    images = [c for c in valid.chunks if isinstance(c, ImageChunk)]
    assert texts == ["Look ", " and ", " now"] and [type(c).__name__ for c in valid.chunks][1] == "ImageChunk"
    assert [(i.mimetype, i.height, i.width) for i in images] == [("image/png", 640, 640), ("image/jpeg", 480, 640)]
    # stock's router table: 640x640 -> 2928 placeholders, 480x640 -> 2340; one char token each + BOS
    assert valid.input_length == 1 + len("Look  and  now") + 2928 * len("<image>") + 2340 * len("<image>")
    assert valid.inputs == inputs  # data URIs are already what chunks_to_string writes
    message_chunks = input_chunks(valid)
    assert [c.WhichOneof("chunk") for c in message_chunks] == ["text", "image", "text", "image", "text"]
    assert message_chunks[1].image.data == png and message_chunks[3].image.mimetype == "image/jpeg"


@pytest.mark.parametrize(
    ("model_type", "patch_field"), [("qwen2_vl", "patch_size"), ("qwen2_5_vl", "spatial_patch_size")]
)
def test_qwen2_vl_images_are_budgeted_as_stock_does(model_type, patch_field):
    """Stock's ``config.rs``: ``h*w // patch**2`` pads, no resize or merge, Debug-quoted (``{:?}``)."""
    config = SimpleNamespace(model_type=model_type, vision_config=SimpleNamespace(**{"patch_size": 7, patch_field: 14}))
    text = placeholder_rule(config)(100, 60)
    assert text == '<|vision_start|>"' + "<|image_pad|>" * (100 * 60 // 14**2) + '"<|vision_end|>'
    valid = _validate(f"see ![]({_uri(_image(100, 60))})!", placeholder_rule(config))
    assert valid.input_length == 1 + len("see !") + len(text)  # a budget: the shard counts its own (docs/vlm.md)


def test_the_bytes_decide_the_media_type_not_the_label():
    png = _image(20, 20)
    (_, image), _ = split_inputs(f"x![]({_uri(png, 'image/jpeg')})", lambda h, w: "<image>")
    assert image.mimetype == "image/png"
    assert detect_mimetype(_image(8, 8, "GIF")) == "image/gif" and detect_mimetype(_image(8, 8, "WEBP")) == "image/webp"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,!!!", "bad base64"),
        (_uri(b"not an image at all"), "Unsupported image format"),
        (_uri(b"\x89PNG\r\n\x1a\n" + b"truncated"), "Invalid image"),
        ("ftp://host/a.png", "expected a data URI or an http"),
        ("data:image/png,plain", "must be base64"),
    ],
)
def test_bad_images_are_validation_errors(url: str, message: str):
    with pytest.raises(ValidationError, match=message):
        _validate(f"hi ![]({url})", placeholder_rule(LLAVA_V16))


def test_a_text_model_keeps_the_markdown_as_text():
    inputs = f"hi ![]({_uri(_image(20, 20))})"
    valid = _validate(inputs, None)
    assert valid.chunks == () and valid.input_length == 1 + len(inputs)
    assert [c.WhichOneof("chunk") for c in input_chunks(valid)] == ["text"]
    assert placeholder_rule(SimpleNamespace(model_type="llama")) is None


def test_the_image_tokens_count_against_the_input_limit():
    with pytest.raises(ValidationError, match="must have less than 100 tokens"):
        _validate(f"![]({_uri(_image(20, 20))})", placeholder_rule(LLAVA_V16), max_input_tokens=100)
