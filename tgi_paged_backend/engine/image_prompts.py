"""Requests with images for a served vision-language model: their prompt ids, image spans and embeddings.

At admission (:meth:`ImagePrompts.encode`) the images are decoded and validated
(:mod:`.images`), each becomes its placeholder run (:func:`~tgi_paged_backend.vision.prompt.build_prompt`,
the count from the decoded size), the prompt is tokenized as stock's VLM server does, and the
placeholders are dealt to the images (:func:`~tgi_paged_backend.vision.image_keys.image_positions`:
truncation inside an image, or placeholder text in the input, is ``INVALID_ARGUMENT``). The request keeps
a :class:`RequestImages`: the image chunks, the spans, and the *keyed* prompt ids the memory manager
matches and registers retained blocks by (the forward keeps the real ids).

At a prefill chunk that reaches an image (:meth:`RequestImages.chunk_rows`) the images are encoded once
(vision tower, projector, anyres packing) and the chunk's slice of each goes to the forward as
``ForwardBatch.image_rows``; the embeddings are dropped once the prompt is past its last image
(:meth:`RequestImages.release`) and at a recompute preemption, which re-encodes from the bytes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tgi_paged_backend.engine.images import decode_image, decode_request_images, request_images
from tgi_paged_backend.engine.tokenize import PromptTokenizer
from tgi_paged_backend.engine.types import ImageInput, RequestSpec
from tgi_paged_backend.vision.attend_spans import key_spans
from tgi_paged_backend.vision.image_keys import extent, image_positions, keyed_token_ids
from tgi_paged_backend.vision.prompt import build_prompt

if TYPE_CHECKING:
    import torch

    from tgi_paged_backend.vision.mrope import MRopePositions

MAX_IMAGES_PER_REQUEST = 8
"""Images one request may carry (more is ``INVALID_ARGUMENT``); Warmup sizes the vision tower's peak for it."""


@dataclass(slots=True)
class RequestImages:
    """A request's images: what the forward and the memory manager need of them."""

    images: tuple[ImageInput, ...]
    """The image chunks in prompt order (re-encoded from after a recompute preemption)."""
    spans: tuple[range, ...]
    """Prompt positions from each image's first placeholder to its last (its content id keys them)."""
    positions: tuple[tuple[int, ...], ...]
    """Prompt positions of each image's placeholders (one per embedding; other tokens may sit between)."""
    prompt_keys: list[int]
    """The prompt ids with each image's placeholders replaced by its content id (prefix retention)."""
    features: list[torch.Tensor] | None = None
    """Each image's ``[count, hidden]`` embeddings while the prefill needs them, else ``None``."""
    rope: MRopePositions | None = None
    """The request's 3-D rotary positions and their delta past the prompt (M-RoPE families), else ``None``:
    computed once from the prompt at admission, so prefix hits and recompute re-prefills reuse them."""
    bidirectional: tuple[range, ...] = ()
    """Prompt spans whose tokens attend to each other both ways (:mod:`~tgi_paged_backend.vision.attend_spans`:
    Gemma 3's images, PaliGemma's whole prompt, a text-only one's too); ``()``: causal."""

    @property
    def end(self) -> int:
        """The position after the last image placeholder (0 without images)."""
        return max((span.stop for span in self.spans), default=0)

    def chunk_rows(
        self, request_id: int, start: int, count: int, row: int, encoder: Any
    ) -> list[tuple[int, torch.Tensor]]:
        """``(packed row, embeddings)`` of the image positions in prompt positions ``start .. start + count``,
        which sit at packed rows ``row ..``; encodes the images first when their embeddings are not held."""
        stop = start + count
        inside = [(i, span) for i, span in enumerate(self.spans) if span.start < stop and span.stop > start]
        if not inside:
            return []
        if self.features is None:
            self.features = encoder.encode([decode_image(request_id, i, im) for i, im in enumerate(self.images)])
        rows: list[tuple[int, torch.Tensor]] = []
        for i, _ in inside:
            where = self.positions[i]
            first, last = bisect_left(where, start), bisect_left(where, stop)
            while first < last:  # one row block per run of adjacent placeholders inside the chunk
                end = first + 1
                while end < last and where[end] == where[end - 1] + 1:
                    end += 1
                rows.append((row + where[first] - start, self.features[i][first:end]))
                first = end
        return rows

    def release(self, num_computed: int | None = None) -> None:
        """Drop the embeddings when the prompt is computed past the last image (``None``: now)."""
        if num_computed is None or num_computed >= self.end:
            self.features = None


class ImagePrompts:
    """Prompt ids (and images) of requests for a served vision-language model."""

    def __init__(self, encoder: Any, tokenizer: PromptTokenizer) -> None:
        self.encoder = encoder
        """The family's VLM adapter: ``image_token_id``, ``token_count(image)``, ``placeholder_text(image, token)``,
        ``finish_prompt(text)``, ``encode(images)`` and ``largest_image()`` (e.g.
        :class:`~tgi_paged_backend.vision.llava_next_encoder.LlavaNextEncoder`); optional: ``rope_positions``
        (M-RoPE), ``bidirectional_spans(num_tokens, image_spans)``, ``wrap_text(text)`` (each text chunk, text-only
        requests' too) and ``adds_special_tokens`` (overrides the request's ``add_special_tokens``)."""
        self.tokenizer = tokenizer
        self.image_token_id = int(encoder.image_token_id)
        self.image_token = tokenizer.tokenizer.convert_ids_to_tokens(self.image_token_id)

    @classmethod
    def for_runner(cls, runner: Any, tokenizer: PromptTokenizer) -> ImagePrompts | None:
        """The runner's (``None`` for a text-only model)."""
        if runner.image_encoder is None:
            return None
        return cls(runner.image_encoder, tokenizer)

    def encode(self, spec: RequestSpec) -> tuple[list[int], RequestImages | None]:
        """The prompt ids of ``spec`` and its images (``None`` without images); ``InvalidRequestError`` for
        a bad image, too many images, or placeholders that do not match the images."""
        chunks = request_images(spec)
        decoded = decode_request_images(spec, MAX_IMAGES_PER_REQUEST)
        counts = [self.encoder.token_count(image) for image in decoded]
        wrap_text = getattr(self.encoder, "wrap_text", None)  # PaliGemma's: text-only prompts are wrapped too
        if chunks or wrap_text is not None:
            parts = spec.chunks if chunks else (spec.text,)
            text = build_prompt(parts, lambda i: self.encoder.placeholder_text(decoded[i], self.image_token), wrap_text)
            text = self.encoder.finish_prompt(text)
        else:
            text = spec.text
        special = getattr(self.encoder, "adds_special_tokens", None)
        ids = self.tokenizer.encode(text, spec.truncate, spec.add_special_tokens if special is None else special)
        positions = image_positions(spec.id, ids, self.image_token_id, counts)
        spans = [extent(run) for run in positions]
        bidirectional_spans = getattr(self.encoder, "bidirectional_spans", None)
        bidirectional = () if bidirectional_spans is None else tuple(bidirectional_spans(len(ids), spans))
        if not chunks and not bidirectional:
            return ids, None
        data = [image.data for image in chunks]
        keys = key_spans(keyed_token_ids(ids, spans, data), ids, bidirectional, spans, data)
        rope_positions = getattr(self.encoder, "rope_positions", None)  # only M-RoPE families' adapters have it
        rope = None if rope_positions is None else rope_positions(len(ids), spans, decoded)
        images = RequestImages(
            tuple(chunks), tuple(spans), tuple(positions), keys, rope=rope, bidirectional=bidirectional
        )
        return ids, images

    def router_slack(self, spec: RequestSpec) -> int:
        """Prompt tokens stock's router does not count for ``spec`` (the adapter's ``router_slack`` per text chunk)."""
        per_chunk = getattr(self.encoder, "router_slack", 0)
        text_chunks = sum(1 for c in spec.chunks if isinstance(c, str)) if request_images(spec) else 1
        return int(per_chunk) * text_chunks

    def encode_requests(self, specs: Sequence[RequestSpec]) -> tuple[list[list[int]], list[RequestImages | None]]:
        """:meth:`encode` of every request, in order."""
        encoded = [self.encode(spec) for spec in specs]
        return [ids for ids, _ in encoded], [images for _, images in encoded]
