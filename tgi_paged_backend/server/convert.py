"""``generate.v3`` protobuf messages <-> the engine's boundary dataclasses.

Inbound functions raise :class:`InvalidRequestError` for shapes the engine cannot serve (no text
chunk, two text chunks, a grammar whose text and type disagree); nothing else here knows about gRPC.
"""

from __future__ import annotations

from tgi_paged_backend.engine.types import (
    BatchSpec,
    CachedBatchInfo,
    Generation,
    GrammarSpec,
    ImageInput,
    InfoResult,
    InvalidRequestError,
    RequestSpec,
    SamplingParams,
    StepResult,
    StoppingParams,
    Tokens,
    WarmupResult,
)
from tgi_paged_backend.server.pb import generate_pb2 as pb

U32_MAX = 2**32 - 1


# ---------------------------------------------------------------------------------------------
# protobuf -> dataclasses


def request_chunks(request: pb.Request) -> tuple[str | ImageInput, ...]:
    """``input_chunks`` in order, text as ``str`` and images as :class:`ImageInput` (bytes not decoded)."""
    out: list[str | ImageInput] = []
    for chunk in request.input_chunks.chunks:
        kind = chunk.WhichOneof("chunk")
        if kind == "text":
            out.append(chunk.text)
        elif kind == "image":
            out.append(ImageInput(data=chunk.image.data, mimetype=chunk.image.mimetype))
    return tuple(out)


def request_text(request: pb.Request) -> str:
    """The prompt text: the single text chunk of ``input_chunks``, or ``inputs`` when there are no chunks.

    Without image chunks exactly one text chunk is required (stock's text servers' rule). With image
    chunks (a VLM prompt: text, image, text, ...) the text chunks are joined in order: a text-only
    model reads that and ignores the images, as stock does; a VLM builds its prompt from
    :func:`request_chunks`. At least one text chunk is still required.
    """
    chunks = request.input_chunks.chunks
    if not chunks:
        if not request.inputs:
            raise InvalidRequestError(f"request {request.id}: no input (input_chunks and inputs are empty)")
        return request.inputs
    texts = [chunk.text for chunk in chunks if chunk.WhichOneof("chunk") == "text"]
    has_images = any(chunk.WhichOneof("chunk") == "image" for chunk in chunks)
    if len(texts) == 1 or (has_images and texts):
        return "".join(texts)
    raise InvalidRequestError(
        f"request {request.id}: expected exactly one text chunk in input_chunks, got {len(texts)}"
    )


def request_from_pb(request: pb.Request) -> RequestSpec:
    params = request.parameters
    # adapter_id: a LORA_ADAPTERS name, or anything else (the router forwards the OpenAI routes' `model`,
    # e.g. huggingface_hub's default "dummy"), which the base model serves, as stock.
    stopping = request.stopping_parameters
    return RequestSpec(
        id=request.id,
        text=request_text(request),
        chunks=_chunks_if_images(request),
        truncate=request.truncate,
        add_special_tokens=request.add_special_tokens,
        sampling=SamplingParams(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            typical_p=params.typical_p,
            do_sample=params.do_sample,
            seed=params.seed,
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty,
            watermark=params.watermark,
            grammar=_grammar_from_pb(request.id, params),
        ),
        stopping=StoppingParams(
            max_new_tokens=stopping.max_new_tokens,
            stop_sequences=tuple(stopping.stop_sequences),
            ignore_eos_token=stopping.ignore_eos_token,
        ),
        prefill_logprobs=request.prefill_logprobs,
        top_n_tokens=request.top_n_tokens,
        blocks=tuple(request.blocks),
        slots=tuple(request.slots),
        cache_len=request.cache_len,
        adapter_id=request.adapter_id,
        chunk_len=request.chunk_len if request.HasField("chunk_len") else None,
    )


def _chunks_if_images(request: pb.Request) -> tuple[str | ImageInput, ...]:
    """The ordered chunks when an image is among them, else ``()`` (a text prompt is :attr:`text`)."""
    chunks = request_chunks(request)
    return chunks if any(isinstance(c, ImageInput) for c in chunks) else ()


_GRAMMAR_KINDS = {pb.GRAMMAR_TYPE_REGEX: "regex", pb.GRAMMAR_TYPE_JSON: "json"}


def _grammar_from_pb(request_id: int, params: pb.NextTokenChooserParameters) -> GrammarSpec | None:
    """``None`` without a grammar; a grammar whose text and type disagree is refused, never guessed."""
    if params.grammar_type == pb.GRAMMAR_TYPE_NONE and not params.grammar:
        return None
    kind = _GRAMMAR_KINDS.get(params.grammar_type)
    if kind is None or not params.grammar:
        raise InvalidRequestError(
            f"request {request_id}: grammar {params.grammar[:80]!r} with grammar_type "
            f"{params.grammar_type} (expected REGEX or JSON with a non-empty grammar)"
        )
    return GrammarSpec(kind=kind, value=params.grammar)


def batch_from_pb(batch: pb.Batch) -> BatchSpec:
    if not batch.requests:
        raise InvalidRequestError(f"batch {batch.id}: no requests")
    return BatchSpec(
        id=batch.id,
        requests=tuple(request_from_pb(r) for r in batch.requests),
        max_tokens=batch.max_tokens,
        max_blocks=batch.max_blocks,
    )


# ---------------------------------------------------------------------------------------------
# dataclasses -> protobuf


def _u32(value: int) -> int:
    """Clamp a count the router reads as u32 (an admission brake may report a huge value)."""
    return min(int(value), U32_MAX)


def tokens_to_pb(tokens: Tokens) -> pb.Tokens:
    return pb.Tokens(ids=tokens.ids, logprobs=tokens.logprobs, texts=tokens.texts, is_special=tokens.is_special)


def generation_to_pb(generation: Generation) -> pb.Generation:
    # The router zips ids/logprobs/texts/is_special and drops a request whose final token is lost,
    # so a malformed Generation fails the RPC here instead of hanging or panicking the router.
    for tokens in (generation.tokens, *generation.top_tokens):
        if len(tokens.is_special) != len(tokens.ids):
            raise ValueError(
                f"request {generation.request_id}: Tokens.is_special length "
                f"{len(tokens.is_special)} != ids length {len(tokens.ids)}"
            )
    if not generation.tokens.ids:
        raise ValueError(f"request {generation.request_id}: Generation without tokens")
    message = pb.Generation(
        request_id=generation.request_id,
        tokens=tokens_to_pb(generation.tokens),
        top_tokens=[tokens_to_pb(t) for t in generation.top_tokens],
    )
    if generation.prefill_tokens is not None:
        message.prefill_tokens.CopyFrom(tokens_to_pb(generation.prefill_tokens))
    done = generation.generated_text
    if done is not None:
        # protoc's stub types an enum field as its enum class or name only; protobuf takes the number too,
        # and FinishReason's numbers are generate.v3's.
        generated = pb.GeneratedText(
            text=done.text,
            generated_tokens=done.generated_tokens,
            finish_reason=int(done.finish_reason),  # type: ignore[arg-type]
        )
        if done.seed is not None:
            generated.seed = done.seed
        message.generated_text.CopyFrom(generated)
    return message


def cached_batch_to_pb(batch: CachedBatchInfo) -> pb.CachedBatch:
    return pb.CachedBatch(
        id=batch.id,
        request_ids=batch.request_ids,
        size=len(batch.request_ids),
        max_tokens=_u32(batch.max_tokens),
        current_tokens=_u32(batch.current_tokens),
    )


def step_result_to_pb(
    result: StepResult, response_type: type[pb.PrefillResponse] | type[pb.DecodeResponse], total_ns: int
) -> pb.PrefillResponse | pb.DecodeResponse:
    """``PrefillResponse``/``DecodeResponse``; ``total_ns`` is used when the engine reports 0."""
    message = response_type(
        generations=[generation_to_pb(g) for g in result.generations],
        forward_ns=result.forward_ns,
        decode_ns=result.decode_ns,
        total_ns=result.total_ns or total_ns,
    )
    if result.batch is not None:
        message.batch.CopyFrom(cached_batch_to_pb(result.batch))
    if result.concat_ns is not None:
        message.concat_ns = result.concat_ns
    return message


def info_to_pb(info: InfoResult) -> pb.InfoResponse:
    message = pb.InfoResponse(
        requires_padding=info.requires_padding,
        dtype=info.dtype,
        device_type=info.device_type,
        speculate=info.speculate,
        support_chunking=info.support_chunking,
        use_prefix_caching=info.use_prefix_caching,
        attention_impl=info.attention_impl,
        block_size=info.block_size,
    )
    if info.window_size is not None:
        message.window_size = info.window_size
    return message


def warmup_to_pb(result: WarmupResult) -> pb.WarmupResponse:
    return pb.WarmupResponse(
        max_supported_total_tokens=_u32(result.max_supported_total_tokens),
        max_input_tokens=result.max_input_tokens,
        max_total_tokens=result.max_total_tokens,
    )
