"""Image validation for models that accept images: each failure is one request's INVALID_ARGUMENT."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from integration.router_replay.client import WARMUP_IMAGE
from tgi_paged_backend.engine.images import SUPPORTED_MIMETYPES, decode_image, decode_request_images
from tgi_paged_backend.engine.types import ImageInput, InvalidRequestError, RequestSpec


def _encoded(fmt: str, size: tuple[int, int] = (5, 3), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color=(10, 20, 30) if mode == "RGB" else 7).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    "fmt, mimetype",
    [
        ("PNG", "image/png"),
        ("JPEG", "image/jpeg"),
        ("JPEG", "image/jpg"),
        ("GIF", "image/gif"),
        ("WEBP", "image/webp"),
        ("TIFF", "image/tiff"),
    ],
)
def test_router_mimetypes_decode_to_rgb(fmt: str, mimetype: str) -> None:
    image = decode_image(1, 0, ImageInput(_encoded(fmt), mimetype))
    assert image.mode == "RGB" and image.size == (5, 3)


def test_grayscale_is_converted_to_rgb() -> None:
    assert decode_image(1, 0, ImageInput(_encoded("PNG", mode="L"), "image/png")).mode == "RGB"


def test_supported_mimetypes_are_the_routers() -> None:
    assert SUPPORTED_MIMETYPES == {"image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp", "image/tiff"}


@pytest.mark.parametrize(
    "image, message",
    [
        (ImageInput(b"\x89PNG\r\n", "image/png"), "cannot be decoded"),
        (ImageInput(b"", "image/png"), "empty image data"),
        (ImageInput(b"BM....", "image/bmp"), "unsupported mimetype 'image/bmp'"),
        (ImageInput(b"x", "application/octet-stream"), "unsupported mimetype"),
    ],
)
def test_bad_images_are_invalid_requests(image: ImageInput, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as err:
        decode_image(9, 2, image)
    assert "request 9: image 2" in str(err.value)


def test_truncated_png_is_invalid() -> None:
    data = _encoded("PNG", size=(64, 64))
    with pytest.raises(InvalidRequestError, match="cannot be decoded"):
        decode_image(1, 0, ImageInput(data[: len(data) // 2], "image/png"))


def test_more_images_than_allowed_is_invalid_and_count_within_limit_decodes() -> None:
    png = ImageInput(_encoded("PNG"), "image/png")
    spec = RequestSpec(id=3, text="a b", truncate=10, chunks=("a", png, "b", png))
    assert len(decode_request_images(spec, max_images=2)) == 2
    with pytest.raises(InvalidRequestError, match="request 3: 2 images, this model accepts at most 1"):
        decode_request_images(spec, max_images=1)


STOCK_WARMUP_IMAGE_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAABQAAAAUCAIAAAAC64paAAABg2lDQ1BJQ0MgcHJvZmlsZQAAKJF9kT1Iw0AcxV/TSotUROxQxCFD"
    "dbKLijjWKhShQqgVWnUwufQLmrQkKS6OgmvBwY/FqoOLs64OroIg+AHi7OCk6CIl/i8ptIjx4Lgf7+497t4BQqvKNDOQADTdMjKp"
    "pJjLr4rBVwQQwhAERGVm1uckKQ3P8XUPH1/v4jzL+9yfY0AtmAzwicQJVjcs4g3imU2rznmfOMLKskp8Tjxh0AWJH7muuPzGueSw"
    "wDMjRjYzTxwhFks9rPQwKxsa8TRxTNV0yhdyLquctzhr1Qbr3JO/MFzQV5a5TnMUKSxiCRJEKGiggiosxGnVSTGRof2kh3/E8Uvk"
    "UshVASPHAmrQIDt+8D/43a1ZnJp0k8JJoO/Ftj/GgOAu0G7a9vexbbdPAP8zcKV3/bUWMPtJerOrxY6AwW3g4rqrKXvA5Q4QfarL"
    "huxIfppCsQi8n9E35YHhW6B/ze2ts4/TByBLXaVvgINDYLxE2ese7w719vbvmU5/PycecohsjayNAAAACXBIWXMAAC4jAAAuIwF4"
    "pT92AAAAB3RJTUUH6AQIEQMnlTSSjwAAABl0RVh0Q29tbWVudABDcmVhdGVkIHdpdGggR0lNUFeBDhcAAAASSURBVDjLY2AYBaNg"
    "FIyCoQsABMQAAeRw1DoAAAAASUVORK5CYII="
)
"""``WARMUP_IMAGE_BASE64`` of stock TGI's ``backends/client/src/lib.rs``: the image of the router's Warmup."""


@pytest.mark.parametrize("data", [base64.b64decode(STOCK_WARMUP_IMAGE_BASE64), WARMUP_IMAGE], ids=["stock", "replay"])
def test_the_routers_warmup_image_decodes(data: bytes) -> None:
    """Stock's v3 client warms up with a 20x20 PNG labelled ``image/jpeg;base64``: it must not fail warmup."""
    image = decode_image(0, 0, ImageInput(data, "image/jpeg;base64"))
    assert image.size == (20, 20) and image.mode == "RGB"


def test_media_type_parameters_and_case_are_ignored() -> None:
    assert decode_image(0, 0, ImageInput(_encoded("PNG"), " Image/PNG; charset=x")).size == (5, 3)
