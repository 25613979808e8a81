"""Validation of a request's image chunks, for models that accept images.

The stock router fetches each image and sends its bytes with the mimetype it detected
(``format_to_mimetype`` in ``router/src/validation.rs``: png, jpeg, gif, webp, tiff; anything else
becomes ``application/octet-stream``). A model that accepts images decodes each one here before the
request is admitted; every failure is an :class:`InvalidRequestError` naming the request and the
image, so the servicer answers ``INVALID_ARGUMENT`` and no other request is touched. Text-only
models never call this (they ignore images, as stock's text servers do).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from tgi_paged_backend.engine.types import ImageInput, InvalidRequestError, RequestSpec

if TYPE_CHECKING:
    from PIL import Image as PILImage

SUPPORTED_MIMETYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp", "image/tiff"})
"""What the stock router's ``format_from_mimetype`` accepts (``image/jpg`` is its alias of jpeg)."""


def media_type(mimetype: str) -> str:
    """The media type without parameters, lower-case: the stock router's own warmup request sends a PNG
    labelled ``image/jpeg;base64``, so parameters are dropped and the bytes, not the label, pick the decoder
    (as stock's server does: PIL sniffs the format)."""
    return mimetype.split(";", 1)[0].strip().lower()


def request_images(spec: RequestSpec) -> list[ImageInput]:
    """The request's image chunks, in prompt order."""
    return [chunk for chunk in spec.chunks if isinstance(chunk, ImageInput)]


def decode_image(request_id: int, index: int, image: ImageInput) -> PILImage.Image:
    """The image as an RGB PIL image, or :class:`InvalidRequestError` (bad mimetype, undecodable bytes)."""
    from PIL import Image, UnidentifiedImageError

    where = f"request {request_id}: image {index}"
    if media_type(image.mimetype) not in SUPPORTED_MIMETYPES:
        raise InvalidRequestError(
            f"{where}: unsupported mimetype {image.mimetype!r} (expected one of {sorted(SUPPORTED_MIMETYPES)})"
        )
    if not image.data:
        raise InvalidRequestError(f"{where}: empty image data")
    try:
        with Image.open(io.BytesIO(image.data)) as opened:
            opened.load()
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise InvalidRequestError(
            f"{where} ({image.mimetype}, {len(image.data)} bytes) cannot be decoded: {err}"
        ) from err


def decode_request_images(spec: RequestSpec, max_images: int) -> list[PILImage.Image]:
    """Every image of ``spec`` decoded, after checking there are at most ``max_images`` of them."""
    images = request_images(spec)
    if len(images) > max_images:
        raise InvalidRequestError(
            f"request {spec.id}: {len(images)} images, this model accepts at most {max_images} per request"
        )
    return [decode_image(spec.id, index, image) for index, image in enumerate(images)]
