"""The shard engine: the eight ``generate.v3`` RPCs over the scheduler, memory manager and runner.

Batches are lists of request ids; requests live in one table, so merging (Prefill with
``cached_batch``, Decode of several batches) is a list concatenation. The physical pool is shared by
all cached batches: a step may preempt requests of another cached batch, which simply resume when
their batch runs next.

Failure rule: validation happens before any state changes (``InvalidRequestError``). An unexpected
error inside a step frees every request of that call and re-raises: the router fails exactly those
requests (it also ``ClearCache``s the batch id), and the shard keeps serving everyone else.

The request table, the pool's parts and the step itself are :class:`~.step_engine.StepEngine`'s; this
module adds the batches, the RPC rules and Warmup.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch
from loguru import logger

from tgi_paged_backend.config import BackendConfig
from tgi_paged_backend.engine.capacity import Capacity, plan_capacity
from tgi_paged_backend.engine.image_prompts import MAX_IMAGES_PER_REQUEST
from tgi_paged_backend.engine.request_state import RequestState
from tgi_paged_backend.engine.sampling import validate_sampling_params
from tgi_paged_backend.engine.step_engine import StepEngine
from tgi_paged_backend.engine.types import (
    U64_MAX,
    BatchNotFoundError,
    BatchSpec,
    CachedBatchInfo,
    InfoResult,
    InvalidRequestError,
    RequestSpec,
    StepResult,
    WarmupResult,
)
from tgi_paged_backend.engine.validation import validate_batch, validate_fits_pool, validate_spans, validate_tokenized
from tgi_paged_backend.policy.admission import reported_batch_tokens, should_brake
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.telemetry.step_record import MemoryBudget
from tgi_paged_backend.vision.activation_peak import warmup_image_count, with_vision_peak

if TYPE_CHECKING:
    from tgi_paged_backend.telemetry.sinks import ShardTelemetry

BOOTSTRAP_BLOCKS = 1024
"""Pool size before Warmup (enough for the router's warmup batch at the default prefill budget)."""


class PagedShardEngine(StepEngine):
    """Implements :class:`~tgi_paged_backend.engine.interface.ShardEngine`."""

    def __init__(self, config: BackendConfig, runner: ModelRunner, telemetry: ShardTelemetry) -> None:
        super().__init__(config, runner, telemetry)
        self.batches: dict[int, list[int]] = {}
        # A small pool so the engine serves (and warms up) before Warmup sizes the real one.
        self._configure(
            self._plan(
                max_input_tokens=None, max_total_tokens=None, max_prefill_tokens=4096, max_blocks=BOOTSTRAP_BLOCKS
            )
        )

    # -- sizing -----------------------------------------------------------------------------

    def _plan(
        self,
        *,
        max_input_tokens: int | None,
        max_total_tokens: int | None,
        max_prefill_tokens: int,
        max_blocks: int | None = None,
    ) -> Capacity:
        cache = self.config.cache
        caps = [c for c in (cache.num_blocks, max_blocks) if c is not None]
        return plan_capacity(
            available_kv_bytes=self.runner.available_kv_bytes(cache.memory_fraction),
            block_bytes=self.runner.block_bytes_for(self.runner.kv_groups),
            block_size=self.block_size,
            num_blocks_cap=min(caps) if caps else None,
            overcommit=cache.overcommit,
            max_position_embeddings=self.runner.spec.max_position_embeddings,
            max_input_tokens=max_input_tokens,
            max_total_tokens=max_total_tokens,
            max_prefill_tokens=max_prefill_tokens,
            groups=self.runner.kv_groups,
        )

    @property
    def num_virtual_blocks(self) -> int:
        return self.capacity.max_supported_total_tokens // self.block_size

    # -- RPCs -------------------------------------------------------------------------------

    def info(self) -> InfoResult:
        return InfoResult(
            requires_padding=False,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device_type=self.runner.device.type,
            window_size=None,
            speculate=self.config.model.num_speculative_tokens,
            support_chunking=True,
            use_prefix_caching=self.config.cache.prefix_caching,
            attention_impl="paged",
            block_size=self.block_size,
        )

    def health(self) -> None:
        torch.zeros((2, 2), device=self.runner.device).sum().item()

    def warmup(
        self, batch: BatchSpec, *, max_input_tokens: int | None, max_prefill_tokens: int, max_total_tokens: int | None
    ) -> WarmupResult:
        self.clear_cache(None)
        self.kv.reset_prefix_cache()
        # Exercise the full prefill path (sampling, top-n, prompt logprobs) on the router's batch,
        # with private ids (the router sends id 0 for every warmup request).
        warm = BatchSpec(id=batch.id, requests=tuple(_replace_id(r, -(i + 1)) for i, r in enumerate(batch.requests)))
        text_peak = self.runner.profile_prefill(max(max_prefill_tokens, 1))
        if self.image_prompts is not None:  # the vision tower's peak and the embeddings a prefill holds
            encoder = self.image_prompts.encoder
            num_images = warmup_image_count(encoder, MAX_IMAGES_PER_REQUEST, max_input_tokens)
            self.runner.activation_peak_bytes = with_vision_peak(text_peak, encoder, num_images, self.runner.device)
        # CUDA_GRAPHS: the decode graphs' memory is measured now and left out of the pool below.
        self.runner.profile_decode_graphs(max_total_tokens or self.runner.spec.max_position_embeddings)
        ids = [r.id for r in warm.requests]
        try:
            self._add_requests(warm, max_input_tokens=None, warmup=True)
            for _ in range(4 * len(ids) + 4):  # bounded: each step completes or advances a prefill
                self._step(ids)
                done = [i for i in ids if i not in self.requests or self.requests[i].output_ids]
                self._free(done)
                ids = [i for i in ids if i not in done]
                if not ids:
                    break
        finally:
            self._free(ids)
        capacity = self._plan(
            max_input_tokens=max_input_tokens, max_total_tokens=max_total_tokens, max_prefill_tokens=max_prefill_tokens
        )
        self._configure(capacity)
        self.runner.prepare_static_decode(capacity.max_total_tokens)  # captures the graphs over the new pool
        self.runner.warm_decode()  # compiles the CPU decode kernel now, not at the first request
        self.observer.on_budget(
            MemoryBudget(
                device_total_bytes=self.runner.device_total_bytes(),
                weights_bytes=self.runner.weights_bytes,
                activation_peak_bytes=self.runner.activation_peak_bytes or 0,
                pool_bytes=capacity.num_blocks * self.runner.block_bytes,
                swap_bytes=self.kv.stats().num_swap_total_blocks * self.runner.block_bytes,
                lora_bytes=self.runner.lora_bytes,
            )
        )
        if self.runner.lora is not None:
            logger.info(
                "warmup: weights {:.1f} MiB, of which LoRA adapters {:.1f} MiB ({} adapters), out of the KV budget",
                self.runner.weights_bytes / 2**20,
                self.runner.lora_bytes / 2**20,
                len(self.runner.lora.adapters),
            )
        logger.info(
            "warmup: {} physical blocks x {} tokens = {} tokens; advertising {} (overcommit {})",
            capacity.num_blocks,
            self.block_size,
            capacity.physical_tokens,
            capacity.max_supported_total_tokens,
            self.config.cache.overcommit,
        )
        groups = self.runner.kv_groups
        if groups.num_groups > 1:
            logger.info(
                "warmup: {} KV layer groups (windows {}), {} layers per block; the budget counts x{:.2f} for "
                "what the sliding groups do not hold at max_total_tokens",
                groups.num_groups,
                ", ".join("full" if w is None else str(w) for w in groups.windows),
                groups.layers_per_block,
                capacity.budget_gain,
            )
        return WarmupResult(
            max_supported_total_tokens=capacity.max_supported_total_tokens,
            max_input_tokens=capacity.max_input_tokens,
            max_total_tokens=capacity.max_total_tokens,
        )

    def prefill(self, batch: BatchSpec, cached_batch_id: int | None) -> StepResult:
        start = time.perf_counter_ns()
        if batch.id == U64_MAX:
            return self._liveness(batch, start)
        if cached_batch_id is not None and cached_batch_id not in self.batches:
            raise BatchNotFoundError(f"cached batch {cached_batch_id} not found")
        try:
            if batch.id in self.batches and batch.id != cached_batch_id:  # would orphan the cached batch's requests
                raise InvalidRequestError(f"batch {batch.id} is already cached: a new batch needs a new id")
            self._add_requests(
                batch, max_input_tokens=self.capacity.max_input_tokens, usable_blocks=self.capacity.num_blocks - 1
            )
        except Exception:
            # The router fails every request of this call, the cached batch's too, but only clears
            # the new batch id: release the cached batch here (stock has popped it already).
            if cached_batch_id is not None:
                self.release_batches([cached_batch_id])
            raise
        new_ids = [r.id for r in batch.requests]
        concat_ns = None
        batch_id = batch.id
        ids = new_ids
        if cached_batch_id is not None:
            t = time.perf_counter_ns()
            ids = self.batches.pop(cached_batch_id) + new_ids
            batch_id = cached_batch_id
            concat_ns = time.perf_counter_ns() - t
        return self._run(batch_id, ids, start, concat_ns)

    def decode(self, batch_ids: list[int]) -> StepResult:
        start = time.perf_counter_ns()
        try:
            if not batch_ids:
                raise InvalidRequestError("Decode needs at least one batch")
            if len(set(batch_ids)) != len(batch_ids):
                raise InvalidRequestError(f"Decode lists a batch twice: {batch_ids}")
            missing = [b for b in batch_ids if b not in self.batches]
            if missing:
                raise BatchNotFoundError(f"Batch ID {missing[0]} not found in cache.")
        except (InvalidRequestError, BatchNotFoundError):
            self.release_batches(batch_ids)  # the router fails every request it sent: none stays here
            raise
        ids = [rid for b in batch_ids for rid in self.batches.pop(b)]
        return self._run(batch_ids[0], ids, start, None if len(batch_ids) == 1 else 0)

    def release_batches(self, batch_ids: list[int]) -> None:
        """Forget these cached batches and free their requests (the router has failed them)."""
        for batch_id in batch_ids:
            self._free(self.batches.pop(batch_id, []))
        self._record_memory()

    def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatchInfo:
        if batch_id not in self.batches:
            raise BatchNotFoundError(f"Batch ID {batch_id} not found in cache.")
        keep = set(request_ids)
        current = self.batches[batch_id]
        self._free([rid for rid in current if rid not in keep])
        self.batches[batch_id] = [rid for rid in current if rid in keep]
        self._record_memory()
        return self._batch_info(batch_id)

    def clear_cache(self, batch_id: int | None) -> None:
        if batch_id is None:
            self.batches.clear()
            self._free(list(self.requests))
        else:
            self._free(self.batches.pop(batch_id, []))
        self._record_memory()

    # -- internals --------------------------------------------------------------------------

    def _add_requests(
        self,
        batch: BatchSpec,
        *,
        max_input_tokens: int | None,
        usable_blocks: int | None = None,
        probe: bool = False,
        warmup: bool = False,
    ) -> None:
        """Validate everything, then register (no state changes before validation passes). With
        ``usable_blocks``, a request whose whole history cannot fit the pool is refused; only the liveness
        ``probe`` may use its reserved id and block; the ``warmup`` batch (its outputs are dropped) runs without
        bidirectional spans (a PaliGemma prompt of the router's warmup length may pass the budget or the window)."""
        validate_batch(batch, live_ids=set(self.requests), num_virtual_blocks=self.num_virtual_blocks, probe=probe)
        prompts, images = self._encode_prompts(batch.requests)
        for spec, prompt_ids, request_images in zip(batch.requests, prompts, images):
            validate_sampling_params(spec.sampling)
            slack = 0 if self.image_prompts is None else self.image_prompts.router_slack(spec)
            validate_tokenized(
                spec, prompt_ids, block_size=self.block_size, max_input_tokens=max_input_tokens, slack=slack
            )
            if request_images is not None and warmup:  # its outputs are dropped: causal, any length, any chunking
                request_images.bidirectional = ()
            elif request_images is not None:
                window = getattr(self.runner.image_encoder, "span_window", None)
                validate_spans(
                    spec,
                    request_images.bidirectional,
                    max_prefill_tokens=self.capacity.max_prefill_tokens,
                    window=window,
                )
            if usable_blocks is not None:
                positions = len(prompt_ids) + spec.stopping.max_new_tokens - 1
                peak = self.runner.kv_groups.request_blocks(
                    positions, self.block_size, self.capacity.max_prefill_tokens
                )
                validate_fits_pool(spec, len(prompt_ids), peak_blocks=peak, usable_blocks=usable_blocks)
        # Compiles start here (cached per regex); a grammar refused at once fails the call before
        # anything is registered.
        grammars = [
            self.grammar_compiler.start(spec.id, spec.sampling.grammar) if spec.sampling.grammar is not None else None
            for spec in batch.requests
        ]
        registered: list[int] = []
        try:
            for spec, prompt_ids, grammar, request_images in zip(batch.requests, prompts, grammars, images):
                registered.append(spec.id)
                self._register(spec, prompt_ids, grammar, request_images)
        except Exception:
            self._free(registered)
            raise

    def _run(self, batch_id: int, ids: list[int], start_ns: int, concat_ns: int | None) -> StepResult:
        try:
            generations, forward_ns, decode_ns = self._step(ids, batch_id)
        except Exception:
            logger.exception("step failed for batch {}; failing its {} requests", batch_id, len(ids))
            self._free(ids)
            raise
        live = [rid for rid in ids if rid in self.requests]
        batch = None
        if live:
            self.batches[batch_id] = live
            batch = self._batch_info(batch_id)
        return StepResult(
            generations=generations,
            batch=batch,
            forward_ns=forward_ns,
            decode_ns=decode_ns,
            total_ns=time.perf_counter_ns() - start_ns,
            concat_ns=concat_ns,
        )

    def _liveness(self, batch: BatchSpec, start_ns: int) -> StepResult:
        """The router's health probe: one token on the scratch block, nothing kept."""
        self._add_requests(batch, max_input_tokens=None, probe=True)
        ids = [r.id for r in batch.requests]
        try:
            generations, forward_ns, decode_ns = self._step(ids)
        finally:
            self._free(ids)
        return StepResult(
            generations=generations,
            batch=None,
            forward_ns=forward_ns,
            decode_ns=decode_ns,
            total_ns=time.perf_counter_ns() - start_ns,
        )

    def _batch_info(self, batch_id: int) -> CachedBatchInfo:
        ids = self.batches[batch_id]
        states = [self.requests[rid] for rid in ids]
        reserved = sum(_reserved_tokens(r, self.block_size) for r in states)
        current = sum(min(r.num_remaining, self.capacity.max_prefill_tokens) for r in states)
        num_waiting_preempted = sum(1 for r in self.requests.values() if r.is_preempted)
        braking = should_brake(
            self.kv.num_available_blocks, self.kv.num_total_blocks, self.config.cache.watermark, num_waiting_preempted
        )
        tokens = reported_batch_tokens(
            braking=braking,
            max_tokens=reserved,
            current_tokens=current,
            max_batch_total_tokens=self.capacity.max_supported_total_tokens,
            max_batch_prefill_tokens=self.capacity.max_prefill_tokens,
        )
        return CachedBatchInfo(
            id=batch_id, request_ids=list(ids), max_tokens=tokens.max_tokens, current_tokens=tokens.current_tokens
        )


def _reserved_tokens(r: RequestState, block_size: int) -> int:
    """Tokens the router reserved for this request (stock TGI's ``max_tokens`` contribution)."""
    if r.spec.blocks:
        return len(r.spec.blocks) * block_size
    return -(-(len(r.prompt_ids) + r.spec.stopping.max_new_tokens - 1) // block_size) * block_size


def _replace_id(spec: RequestSpec, new_id: int) -> RequestSpec:
    return dataclasses.replace(spec, id=new_id)
