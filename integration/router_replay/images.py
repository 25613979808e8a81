"""Images in ``inputs``, as the stock router's validation handles them for a VLM config (issue 40).

Stock (``router/src/validation.rs``, ``prepare_input``): for a vision-language config the input is split at
every markdown image ``![](url)``; each image is fetched (an ``http(s)`` URL) or decoded (a ``data:`` URI),
its format detected from the bytes, and sent to the shard as an ``Image{data, mimetype}`` chunk between the
text chunks. ``input_length`` is the token count of *another* string: the text with each image replaced by
the family's placeholder text (``config.rs``). For any other config the markdown stays literal text.

Replayed here for the families this backend serves (LLaVA-NeXT, Idefics3, Idefics2, Qwen2-VL, Qwen2.5-VL;
``docs/vlm.md`` has stock's table for the others, which are refused at start). The placeholder text is stock's
router rule (:mod:`.image_tokens`): exact for LLaVA-NeXT and Idefics2, a budget for Idefics3 and Qwen2-VL.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ValidationError

MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^\)]*)\)")
"""Stock's pattern: an image with an empty alt text; the URL runs to the first ``)``."""

FETCH_TIMEOUT_S = 10.0

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
)


@dataclass(frozen=True)
class ImageChunk:
    """One image of a request: its bytes, the detected media type and its size."""

    data: bytes
    mimetype: str
    height: int
    width: int


Chunk = str | ImageChunk
PlaceholderRule = Callable[[int, int], str]
"""``(height, width) -> placeholder text`` of one image for the router's token count (a
:class:`~.image_tokens.RouterImageRule` also has the ``fixup`` of the whole counted text)."""
ROUTER_VLM_TYPES = frozenset({"llava_next", "idefics3", "idefics2", "qwen2_vl", "qwen2_5_vl", "gemma3", "paligemma"})
"""The ``model_type``s whose images this replay turns into chunks (the served VLMs stock's router knows)."""


def detect_mimetype(data: bytes) -> str:
    """The media type of the bytes (stock guesses the format from the data, not from the label)."""
    for magic, mimetype in _MAGIC:
        if data.startswith(magic):
            return mimetype
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    raise ValidationError("Unsupported image format: expected png, jpeg, gif, webp or tiff")


def load_image_bytes(url: str) -> bytes:
    """A ``data:`` URI's payload, or the body of an ``http(s)`` URL."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValidationError("Invalid image: a data URI must be base64 encoded")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as error:
            raise ValidationError(f"Invalid image: bad base64 data ({error})") from None
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                return response.read()
        except OSError as error:
            raise ValidationError(f"Failed to fetch image {url}: {error}") from None
    raise ValidationError(f"Invalid image URL {url!r}: expected a data URI or an http(s) URL")


def decode_image(url: str) -> ImageChunk:
    data = load_image_bytes(url)
    mimetype = detect_mimetype(data)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError) as error:
        raise ValidationError(f"Invalid image: {error}") from None
    return ImageChunk(data=data, mimetype=mimetype, height=height, width=width)


def split_inputs(inputs: str, rule: PlaceholderRule) -> tuple[list[Chunk], str]:
    """The ordered chunks of ``inputs`` and the text the router tokenizes (images as placeholders)."""
    chunks: list[Chunk] = []
    counted: list[str] = []
    start = 0
    for match in MARKDOWN_IMAGE.finditer(inputs):
        if match.start() > start:
            chunks.append(inputs[start : match.start()])
            counted.append(inputs[start : match.start()])
        image = decode_image(match.group(1))
        chunks.append(image)
        counted.append(rule(image.height, image.width))
        start = match.end()
    if start < len(inputs):
        chunks.append(inputs[start:])
        counted.append(inputs[start:])
    fixup = getattr(rule, "fixup", None)  # stock's image_tokens_fixup (Idefics2: <fake><fake> collapsed)
    return chunks, fixup("".join(counted)) if fixup is not None else "".join(counted)


def chunks_to_string(chunks: list[Chunk]) -> str:
    """Stock's ``chunks_to_string``: the ``inputs`` field of the request, images as markdown data URIs."""
    return "".join(
        c if isinstance(c, str) else f"![](data:{c.mimetype};base64,{base64.b64encode(c.data).decode()})"
        for c in chunks
    )


def placeholder_rule(config: Any, preprocessor: dict[str, Any] | None = None) -> PlaceholderRule | None:
    """The placeholder text rule of a VLM config (a ``transformers`` config) this replay knows (``None``:
    images stay text); ``preprocessor``: the checkpoint's ``preprocessor_config.json`` (:mod:`.image_tokens`)."""
    from .image_tokens import router_image_rule

    return router_image_rule(config, preprocessor)


def placeholder_rule_for(tokenizer: Any) -> PlaceholderRule | None:
    """The rule of the model directory the router was given (its ``config.json``), if it is a VLM's."""
    if not isinstance(tokenizer, str) or not (Path(tokenizer) / "config.json").is_file():
        return None
    if json.loads((Path(tokenizer) / "config.json").read_text()).get("model_type") not in ROUTER_VLM_TYPES:
        return None
    from transformers import AutoConfig

    file = Path(tokenizer) / "preprocessor_config.json"
    preprocessor = json.loads(file.read_text()) if file.is_file() else None
    return placeholder_rule(AutoConfig.from_pretrained(tokenizer), preprocessor)
