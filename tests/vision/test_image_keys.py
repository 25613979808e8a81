"""Image-keyed token ids for prefix retention, and the prompt with placeholders."""

from __future__ import annotations

import pytest

from tgi_paged_backend.engine.types import ImageInput, InvalidRequestError
from tgi_paged_backend.memory.prefix_cache import chain_hash
from tgi_paged_backend.vision.image_keys import (
    PSEUDO_ID_FLOOR,
    image_pseudo_id,
    keyed_token_ids,
    placeholder_positions,
)
from tgi_paged_backend.vision.prompt import build_prompt

IMG = 99


def test_pseudo_ids_are_negative_stable_and_content_keyed() -> None:
    a, b = image_pseudo_id(b"image-a"), image_pseudo_id(b"image-b")
    assert a == image_pseudo_id(b"image-a") and a != b
    assert a < -PSEUDO_ID_FLOOR and b < -PSEUDO_ID_FLOOR


def test_adjacent_images_are_split_by_their_counts() -> None:
    ids = [1, IMG, IMG, IMG, IMG, IMG, 2]
    assert placeholder_positions(0, ids, IMG, [2, 3]) == [range(1, 3), range(3, 6)]


@pytest.mark.parametrize("counts", [[2, 4], [1]])
def test_placeholder_total_mismatch_is_invalid(counts) -> None:
    with pytest.raises(InvalidRequestError, match="request 5: the prompt holds 5 image placeholder tokens"):
        placeholder_positions(5, [IMG] * 5, IMG, counts)


def test_non_contiguous_placeholders_are_invalid() -> None:
    with pytest.raises(InvalidRequestError, match="not contiguous"):
        placeholder_positions(5, [IMG, 1, IMG], IMG, [2])


def _block_hashes(ids, block=4):
    parent, out = 0, []
    for start in range(0, len(ids) - len(ids) % block, block):
        parent = chain_hash(parent, tuple(ids[start : start + block]))
        out.append(parent)
    return out


def test_same_placeholders_other_image_share_only_the_text_blocks() -> None:
    ids = [1, 2, 3, 4] + [IMG] * 8 + [5, 6, 7, 8]
    spans = placeholder_positions(0, ids, IMG, [8])
    first = _block_hashes(keyed_token_ids(ids, spans, [b"cat"]))
    same = _block_hashes(keyed_token_ids(ids, spans, [b"cat"]))
    other = _block_hashes(keyed_token_ids(ids, spans, [b"dog"]))
    assert first == same  # the same image twice: every block hits
    assert first[0] == other[0] and all(x != y for x, y in zip(first[1:], other[1:]))  # text before it still hits
    assert keyed_token_ids(ids, spans, [b"cat"])[:4] == [1, 2, 3, 4]


def test_build_prompt_replaces_each_image_in_order() -> None:
    chunks = ("A ", ImageInput(b"x", "image/png"), " B ", ImageInput(b"y", "image/png"))
    assert build_prompt(chunks, lambda i: "<image>" * (i + 1)) == "A <image> B <image><image>"
