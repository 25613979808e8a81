"""Prefix-retention identities for prompts with images: placeholder ids replaced by image-content ids.

Two prompts with the same text and the same number of ``<image>`` placeholders but other images have
equal token ids, yet their KV differs from the first placeholder on. The memory manager matches and
registers retained blocks by token ids (chained, so a block's identity includes everything before
it), so it is given *keyed* ids: each placeholder position replaced by a pseudo-id derived from a
hash of that image's bytes. Pseudo-ids are negative (no vocabulary id is), so they never equal a
text token; the same image gives the same pseudo-id, so a repeated image still hits. The model's
forward keeps the real ids and the image embeddings; only matching and registering see keyed ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from tgi_paged_backend.engine.types import InvalidRequestError

PSEUDO_ID_FLOOR = 2**31
"""Pseudo-ids are below ``-PSEUDO_ID_FLOOR``: far from any vocabulary id and from Python's ``hash(-1)`` quirk."""
_PSEUDO_ID_SPAN = 2**62


def image_pseudo_id(data: bytes) -> int:
    """The negative id every placeholder of the image with these bytes is keyed by."""
    digest = int.from_bytes(blake2b(b"tgi-paged-image" + data, digest_size=8).digest(), "little")
    return -(PSEUDO_ID_FLOOR + digest % _PSEUDO_ID_SPAN)


def image_positions(
    request_id: int, token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]
) -> list[tuple[int, ...]]:
    """The positions of each image's placeholders, in prompt order.

    The ``image_token_id`` positions are dealt to the images in order, ``counts[i]`` to image ``i``
    (adjacent images' runs touch, so runs alone cannot tell them apart). A total other than
    ``sum(counts)`` means truncation cut an image or the text itself holds the placeholder token: an
    :class:`InvalidRequestError`, since the embeddings could not be placed. An image's positions may
    have other tokens between them (Idefics3's tile separators).
    """
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) != sum(counts):
        raise InvalidRequestError(
            f"request {request_id}: the prompt holds {len(positions)} image placeholder tokens, its "
            f"{len(counts)} images need {sum(counts)} (truncated inside an image, or placeholder text in the input)"
        )
    out: list[tuple[int, ...]] = []
    start = 0
    for count in counts:
        out.append(tuple(positions[start : start + count]))
        start += count
    return out


def extent(positions: Sequence[int]) -> range:
    """The positions from an image's first placeholder to its last (what its content id keys)."""
    return range(positions[0], positions[-1] + 1) if positions else range(0)


def placeholder_positions(
    request_id: int, token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]
) -> list[range]:
    """:func:`image_positions` of a family whose placeholders are one run per image, as ranges
    (:class:`InvalidRequestError` when a run has other tokens inside)."""
    spans: list[range] = []
    for run in image_positions(request_id, token_ids, image_token_id, counts):
        if run and run[-1] - run[0] + 1 != len(run):
            raise InvalidRequestError(f"request {request_id}: an image's placeholders are not contiguous")
        spans.append(extent(run))
    return spans


def keyed_token_ids(token_ids: Sequence[int], spans: Sequence[range], images: Sequence[bytes]) -> list[int]:
    """``token_ids`` with the positions of ``spans[i]`` replaced by ``image_pseudo_id(images[i])``."""
    if len(spans) != len(images):
        raise ValueError(f"{len(spans)} placeholder spans for {len(images)} images")
    keyed = list(token_ids)
    for span, data in zip(spans, images):
        pseudo = image_pseudo_id(data)
        for position in span:
            keyed[position] = pseudo
    return keyed
