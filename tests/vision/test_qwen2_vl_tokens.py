"""Qwen2-VL's placeholder count and M-RoPE positions against transformers' own processor and rule, for a
spread of image sizes (issue 40: a table test per family)."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from PIL import Image

from tgi_paged_backend.engine.types import InvalidRequestError
from tgi_paged_backend.vision.mrope import mrope_positions
from tgi_paged_backend.vision.qwen2_vl_encoder import VISION_END, VISION_START, Qwen2VlEncoder

SIZES = [(h, w) for h in (1, 7, 28, 29, 100, 333, 1000) for w in (3, 28, 56, 200, 777)] + [(2000, 3000), (28, 28)]


@pytest.fixture(scope="module")
def encoder() -> Qwen2VlEncoder:
    """The released checkpoints' processor (14 px patches, 2x2 merge, 56*56 .. 28*28*1280 pixels) over a
    stand-in model (the count needs no weights)."""
    processor = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil()
    model = type("Model", (), {"config": type("Config", (), {"image_token_id": 151655})()})()
    return Qwen2VlEncoder(model, processor)


def test_the_count_equals_the_processors_grid(encoder) -> None:
    images = [Image.new("RGB", (w, h)) for h, w in SIZES if max(h, w) / min(h, w) <= 200]
    grids = encoder.image_processor(images, return_tensors="pt")["image_grid_thw"].tolist()
    assert [encoder.grid(image) for image in images] == [tuple(g) for g in grids]
    assert [encoder.token_count(image) for image in images] == [t * h * w // 4 for t, h, w in grids]
    assert encoder.token_count(encoder.largest_image()) == 1280  # max_pixels / 28**2: no image gets more
    assert max(encoder.token_count(image) for image in images) <= 1280


def test_placeholder_text_and_extreme_aspect_ratio(encoder) -> None:
    image = Image.new("RGB", (56, 56))
    assert encoder.placeholder_text(image, "<P>") == VISION_START + "<P>" * 4 + VISION_END
    with pytest.raises(InvalidRequestError, match="cannot be resized"):
        encoder.token_count(Image.new("RGB", (1000, 3)))


def test_mrope_positions_by_hand() -> None:
    # 2 text tokens, a 2x3 merged image (grid 4x6 before the 2x2 merge), 1 text token
    rope = mrope_positions(9, [range(2, 8)], [(1, 4, 6)], 2)
    assert rope.prompt.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5],
        [0, 1, 2, 2, 2, 3, 3, 3, 5],
        [0, 1, 2, 3, 4, 2, 3, 4, 5],
    ]
    assert rope.delta == 6 - 9
    assert rope.at(np.array([8, 9, 12])).tolist() == [[5, 6, 9]] * 3
