"""LLaVA-NeXT's placeholder count per image, against stock TGI's router table and transformers' processor."""

from __future__ import annotations

import random

import pytest
from transformers import LlavaNextProcessor

from tgi_paged_backend.vision.llava_next_tokens import LlavaNextGeometry, best_resolution, image_token_count

LLAVA_V16 = LlavaNextGeometry(
    image_size=336, patch_size=14, grid_pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
)

ROUTER_TABLE = [
    (20, 20, 1176),
    (640, 640, 2928),
    (480, 640, 2340),
    (899, 1024, 2634),
    (1024, 899, 2640),
    (1067, 1600, 2144),
]
"""``test_llava_next_features`` in stock TGI's ``router/src/config.rs``: (height, width, count)."""


@pytest.mark.parametrize("height, width, count", ROUTER_TABLE)
def test_counts_equal_the_routers(height: int, width: int, count: int) -> None:
    assert image_token_count(height, width, LLAVA_V16) == count


def _hf_count(geometry: LlavaNextGeometry, height: int, width: int) -> int:
    """transformers' processor rule (CLS dropped: vision_feature_select_strategy 'default')."""
    processor = LlavaNextProcessor.__new__(LlavaNextProcessor)
    processor.image_processor = type("IP", (), {"image_grid_pinpoints": [list(p) for p in geometry.grid_pinpoints]})()
    processor.patch_size = geometry.patch_size
    processor.num_additional_image_tokens = 0
    return processor._get_number_of_features(height, width, geometry.image_size, geometry.image_size)


GEOMETRIES = [
    LLAVA_V16,
    LlavaNextGeometry(image_size=32, patch_size=8, grid_pinpoints=((32, 64), (64, 32), (64, 64))),
    LlavaNextGeometry(image_size=28, patch_size=4, grid_pinpoints=((28, 56), (56, 28), (56, 56), (84, 28), (28, 84))),
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"tile{g.image_size}p{g.patch_size}")
def test_counts_equal_transformers_processor_over_a_spread_of_sizes(geometry: LlavaNextGeometry) -> None:
    rng = random.Random(geometry.image_size)
    sizes = [(1, 1), (1, 500), (500, 1), (geometry.image_size, geometry.image_size)]
    sizes += [(rng.randint(1, 2000), rng.randint(1, 2000)) for _ in range(300)]
    for height, width in sizes:
        assert image_token_count(height, width, geometry) == _hf_count(geometry, height, width), (height, width)


def test_best_resolution_prefers_least_waste_on_ties() -> None:
    # A tiny image fits every candidate fully: the smallest canvas wastes least.
    assert best_resolution(10, 10, [(672, 672), (336, 672)]) == (336, 672)
    assert best_resolution(1000, 300, [(336, 672), (1008, 336)]) == (1008, 336)


def test_geometry_from_config() -> None:
    from transformers import LlavaNextConfig

    config = LlavaNextConfig()
    geometry = LlavaNextGeometry.from_config(config)
    assert geometry.image_size == config.vision_config.image_size
    assert geometry.grid_pinpoints[0] == tuple(config.image_grid_pinpoints[0])
