"""Image chunks through convert: ordered chunks for VLMs, text unchanged for text-only models."""

from __future__ import annotations

import pytest

from tgi_paged_backend.engine.types import ImageInput, InvalidRequestError
from tgi_paged_backend.server import convert
from tgi_paged_backend.server.pb import generate_pb2 as pb


def _request(*chunks: pb.InputChunk) -> pb.Request:
    return pb.Request(id=7, input_chunks=pb.Input(chunks=list(chunks)), truncate=100)


def _img(data: bytes, mimetype: str = "image/png") -> pb.InputChunk:
    return pb.InputChunk(image=pb.Image(data=data, mimetype=mimetype))


def test_text_image_text_keeps_order_and_bytes() -> None:
    spec = convert.request_from_pb(
        _request(pb.InputChunk(text="Look: "), _img(b"A", "image/jpeg"), pb.InputChunk(text=" what?"), _img(b"B"))
    )
    assert spec.chunks == ("Look: ", ImageInput(b"A", "image/jpeg"), " what?", ImageInput(b"B", "image/png"))
    assert spec.text == "Look:  what?"  # what a text-only model reads (images ignored, as stock)


def test_text_only_request_has_no_chunks() -> None:
    spec = convert.request_from_pb(_request(pb.InputChunk(text="hello")))
    assert spec.text == "hello" and spec.chunks == ()


def test_two_text_chunks_without_images_stay_invalid() -> None:
    with pytest.raises(InvalidRequestError, match="got 2"):
        convert.request_from_pb(_request(pb.InputChunk(text="a"), pb.InputChunk(text="b")))


def test_image_only_request_is_invalid() -> None:
    with pytest.raises(InvalidRequestError, match="got 0"):
        convert.request_from_pb(_request(_img(b"A")))
