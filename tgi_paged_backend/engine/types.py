"""Boundary dataclasses between the gRPC servicer and the engine.

The servicer (``server/``) converts ``generate.v3`` protobuf messages into these and back; the engine
never sees protobuf. Field meanings follow TGI's ``generate.proto`` (v3).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

U64_MAX = 2**64 - 1
"""Request and batch id of the router's liveness probe."""


class FinishReason(enum.IntEnum):
    """``generate.v3.FinishReason`` values; the router panics on any other."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """``NextTokenChooserParameters.grammar``: a regex (``GRAMMAR_TYPE_REGEX``, what the stock router
    sends) or a JSON schema (``GRAMMAR_TYPE_JSON``, older routers)."""

    kind: str
    """``"regex"`` or ``"json"``."""
    value: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """``NextTokenChooserParameters`` (router defaults)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    grammar: GrammarSpec | None = None

    @property
    def is_sampling(self) -> bool:
        """TGI samples when ``do_sample`` or any warper is active; otherwise greedy argmax."""
        return self.do_sample or self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.typical_p < 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StoppingParams:
    """``StoppingCriteriaParameters``."""

    max_new_tokens: int = 20
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One ``generate.v3.Image`` chunk, as the router sent it: the fetched bytes and their mimetype.

    Not decoded here: a text-only model ignores images (as stock's text servers do), and a model that
    accepts images validates them with :func:`tgi_paged_backend.engine.images.decode_image`.
    """

    data: bytes
    mimetype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    """One ``generate.v3.Request`` as the engine sees it (text already extracted from the chunks)."""

    id: int
    text: str
    """The prompt text: the single text chunk, or (with image chunks) the text chunks joined in order."""
    truncate: int
    add_special_tokens: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    blocks: tuple[int, ...] = ()
    """Router-assigned virtual blocks for the whole sequence; empty = the shard allocates itself."""
    slots: tuple[int, ...] = ()
    """Router slots, one per reserved token position (``block * block_size + offset``)."""
    cache_len: int = 0
    """Leading prompt tokens the router believes are cached in ``slots[:cache_len]``."""
    chunk_len: int | None = None
    """Compute only this many prompt tokens (from ``cache_len``) in this forward."""
    adapter_id: str = ""
    """``Request.adapter_id``: the LoRA adapter's name; empty or unknown: the base model, as stock."""
    chunks: tuple[str | ImageInput, ...] = ()
    """``input_chunks`` in order (text and images) when the request carries images; empty otherwise.

    A model that accepts images builds its prompt from these (the per-family placeholders at each
    image, see docs/vlm.md); a text-only model reads :attr:`text` and ignores the images, as stock.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSpec:
    """``generate.v3.Batch``."""

    id: int
    requests: tuple[RequestSpec, ...]
    max_tokens: int = 0
    max_blocks: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens:
    """``generate.v3.Tokens``: four lists of equal length."""

    ids: list[int]
    logprobs: list[float]
    texts: list[str]
    is_special: list[bool]

    def __post_init__(self) -> None:
        n = len(self.ids)
        assert len(self.logprobs) == n and len(self.texts) == n, "Tokens lists must have equal length"
        assert len(self.is_special) in (0, n), "Tokens.is_special must be empty or match ids"


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratedText:
    """``generate.v3.GeneratedText``: present exactly once, on a request's final step."""

    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """``generate.v3.Generation``."""

    request_id: int
    tokens: Tokens
    prefill_tokens: Tokens | None = None
    generated_text: GeneratedText | None = None
    top_tokens: list[Tokens] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedBatchInfo:
    """``generate.v3.CachedBatch``: what the router keeps between steps."""

    id: int
    request_ids: list[int]
    max_tokens: int
    current_tokens: int

    @property
    def size(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """Answer of Prefill and Decode."""

    generations: list[Generation]
    batch: CachedBatchInfo | None
    forward_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0
    concat_ns: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoResult:
    """``InfoResponse``."""

    requires_padding: bool
    dtype: str
    device_type: str
    window_size: int | None
    speculate: int
    support_chunking: bool
    use_prefix_caching: bool
    attention_impl: str
    block_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupResult:
    """``WarmupResponse``."""

    max_supported_total_tokens: int
    max_input_tokens: int
    max_total_tokens: int


class InvalidRequestError(ValueError):
    """Bad input from the router: mapped to gRPC ``INVALID_ARGUMENT`` with this message.

    Raised before any state changes, so other requests keep being served.
    """


class BatchNotFoundError(KeyError):
    """Unknown batch id in Decode/FilterBatch: mapped to gRPC ``NOT_FOUND``."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else "batch not found"
