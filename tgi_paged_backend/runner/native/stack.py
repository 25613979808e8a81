"""A model's native decoder layers as one native call per decode step
(:class:`tgi_paged_kernels.cpu_layer_stack.LayerStack`).

transformers' model loop calls its decoder layers one by one. When every layer of the model's layer list is a
:class:`~.layers.NativeDecoderLayer` that runs whole (no tensor-parallel parts), a decode step's first layer runs
all of them in one call and the others pass the result through: no Python, argument checks, ctypes conversion or
OpenMP fork per layer. Every layer then takes layer 0's RoPE tables and slots; each its own pools, block table and
LoRA deltas (the rows' adapters, when the layers add them natively).

That is right only where the model gives every layer the same tables and does nothing between layers. So the stack
serves only after :func:`prove_stack` (at Warmup, :meth:`ModelRunner.warm_decode`) ran one decode step of the whole
model over scratch pools both ways: every layer was called in order with the same RoPE tables, and the logits and
every layer's K/V came out equal to the bit (the same kernel per layer, in the same order); with adapters loaded,
the proof step has rows with and without them. KV layer groups (Gemma 2's sliding and full layers, paged apart) give
each layer its group's slots and table in the call, proven on a step with a table per group. Gemma 3 (local and
global RoPE tables) and models that add between layers keep a call per layer; so do steps with adapter rows on
layers whose LoRA runs per op. ``stack.kept`` says why a stack does not serve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

from tgi_paged_backend.runner.attention import PagedAttentionMetadata
from tgi_paged_backend.runner.input_batch import ForwardBatch, RequestChunk, build_forward_batch
from tgi_paged_kernels import LayerStack

if TYPE_CHECKING:
    from tgi_paged_backend.runner.native.layers import NativeDecoderLayer

Forward = Callable[[ForwardBatch, list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
"""The runner's forward over given pools (``ModelRunner._forward``): logits of the batch's rows."""


class DecodeStack:
    """The layers of one layer list (model order) and whether their decode steps run as one call."""

    def __init__(self, layers: list[NativeDecoderLayer], kernel: LayerStack) -> None:
        self.layers = layers
        self.kernel = kernel
        self.enabled = False
        """Set by :func:`prove_stack` when the stacked step gave the per-layer step's logits and K/V."""
        self.kept = "not proven (no Warmup decode step yet)"
        """Why the stack does not serve (empty when it does)."""
        self.verify = False
        """Whether speculative verify steps (a few rows per request) run stacked too (proven like decode steps,
        on layers that all run their verify steps natively); :attr:`verify_kept` says why not."""
        self.verify_kept = "not proven"
        self.steps = 0
        """Decode and verify steps served as one call."""
        self._served: PagedAttentionMetadata | None = None
        """The step whose layers the first layer ran: the others pass its output through."""
        self._probe: list[tuple[int, Any]] | None = None

    def passes_through(self, index: int, metadata: PagedAttentionMetadata | None) -> bool:
        """Whether layer ``index`` (> 0) of this step was already run by the first layer's call."""
        if metadata is None or metadata is not self._served:
            return False
        if index == len(self.layers) - 1:
            self._served = None
        return True

    def takes(self, metadata: PagedAttentionMetadata, rows: int) -> bool:
        """Whether a step of ``rows`` packed rows with this metadata may run stacked: proven for its kind (decode, or
        verify), taken by the first layer's native call, and LoRA rows only where every layer adds its deltas
        natively. :meth:`run` may still decline on the tensors themselves."""
        first, batch = self.layers[0], metadata.batch
        if not self.enabled or (not batch.is_decode and not self.verify) or not first.takes_step(metadata, rows):
            return False
        lora_rows = first.lora_step is not None and first.lora_step.token_slots is not None
        return not lora_rows or all(layer.lora is not None for layer in self.layers)

    def observe(self, index: int, position_embeddings: Any) -> None:
        """:func:`prove_stack`'s per-layer step: the layers' order and the RoPE tables each got."""
        if self._probe is not None:
            self._probe.append((index, position_embeddings))

    def run(
        self,
        hidden: torch.Tensor,
        position_embeddings: Any,
        metadata: PagedAttentionMetadata,
        pass_through: bool = True,
    ) -> torch.Tensor | None:
        """The whole stack's output for a decode or verify step's ``hidden`` ``[1, T, H]`` as the first layer got
        it, or ``None`` (not proven, or inputs of another kind: every layer then runs its own call). ``pass_through``:
        the other layers will be called on this step (the model's loop) and return their input."""
        if not self.takes(metadata, int(hidden.shape[1])):
            return None
        return self.call(hidden, position_embeddings, metadata, pass_through)

    def call(
        self, hidden: torch.Tensor, position_embeddings: Any, metadata: PagedAttentionMetadata, pass_through: bool
    ) -> torch.Tensor | None:
        """:meth:`run` for a step :meth:`takes` has taken (the caller asked it), or ``None`` for tensors of another
        kind."""
        first, batch = self.layers[0], metadata.batch
        rope = first.step_tables(position_embeddings, hidden.dtype)
        if rope is None:
            return None
        cos, sin = rope
        per_layer = [metadata.tables(layer.layer_idx) for layer in self.layers]
        slots = [slot_mapping for slot_mapping, _ in per_layer]
        tables = [table for _, table in per_layer]
        shared = all(s is slots[0] for s in slots)  # else KV layer groups: each group its own slots
        k_caches = [metadata.k_caches[layer.layer_idx] for layer in self.layers]
        v_caches = [metadata.v_caches[layer.layer_idx] for layer in self.layers]
        token_slots = None if first.lora_step is None else first.lora_step.token_slots
        # rows with adapters: every layer adds its deltas in the call (takes() saw every layer's LoRA native)
        loras = None if token_slots is None else [layer.lora for layer in self.layers if layer.lora is not None]
        query_start_loc = None if batch.is_decode else batch.query_start_loc  # a verify step's rows per request
        out = self.kernel.decode(
            hidden[0], cos, sin, k_caches, v_caches, slots[0] if shared else slots, tables, batch.seq_lens, loras,
            token_slots, query_start_loc,
        )  # fmt: skip
        if out is None:
            return None
        self._served = metadata if pass_through else None
        self.steps += 1
        for layer in self.layers:
            layer.calls[0] += 1
        return out.unsqueeze(0)


def stack_layers(
    layers: list[NativeDecoderLayer], kernel_stack: Callable[[list[Any]], LayerStack]
) -> DecodeStack | str:
    """The stack of ``layers`` (every entry of one layer list, in order), or why they keep a call each."""
    if any(layer._all_reduce is not None for layer in layers):
        return "tensor-parallel ranks run their layers in parts"
    if any(layer.lora_step is not layers[0].lora_step for layer in layers):
        return "the layers' LoRA wrappers route their rows apart"
    if len({layer.weights.weight_dtype for layer in layers}) != 1:
        return "the layers' weights differ in dtype"
    try:
        kernel = kernel_stack([layer.weights for layer in layers])
    except ValueError as e:
        return str(e)
    stack = DecodeStack(layers, kernel)
    for i, layer in enumerate(layers):
        layer.stack, layer.stack_index = stack, i
    return stack


def proof_batch(
    block_size: int, lora_slots: tuple[int, ...], rows: int = 1, kv_groups: int = 1
) -> tuple[ForwardBatch, int]:
    """A decode step (``rows`` > 1: a verify step of that many rows per request) of three requests of different
    lengths over their own blocks (request ``i`` on adapter slot ``lora_slots[i]``, -1: none), and the blocks it
    needs; with ``kv_groups`` > 1, each further KV layer group's slots and tables on blocks of its own."""
    lengths = (1, block_size + 3, 2 * block_size + 1)

    def step(offset: int) -> tuple[ForwardBatch, int]:
        chunks, first = [], offset
        for i, (n, slot) in enumerate(zip(lengths, lora_slots)):
            blocks = -(-(n + rows) // block_size)
            table = list(range(first, first + blocks))
            tokens = [7 + i + r for r in range(rows)]
            chunks.append(RequestChunk(token_ids=tokens, num_computed=n, block_table=table, lora_slot=slot))
            first += blocks
        return build_forward_batch(chunks, block_size), first - offset

    batch, used = step(0)
    groups = [step(g * used)[0] for g in range(1, kv_groups)]
    batch = replace(
        batch,
        group_slot_mappings=tuple(b.slot_mapping for b in groups),
        group_block_tables=tuple(b.block_tables for b in groups),
    )
    return batch, used * kv_groups


VERIFY_PROOF_ROWS = 3
"""Rows per request of the verify proof step (the last token and two drafts)."""


def prove_stack(
    stack: DecodeStack,
    forward: Forward,
    k_like: list[torch.Tensor],
    v_like: list[torch.Tensor],
    block_size: int,
    lora_slots: tuple[int, ...] = (-1, -1, -1),
    kv_groups: int = 1,
) -> bool:
    """Run one decode step of the whole model over scratch pools shaped as ``k_like``/``v_like`` (random history)
    per layer, then stacked; enable the stack when every layer was called in order with the first layer's RoPE
    tables and the logits and K/V are equal to the bit. Then the same for a verify step, when every layer runs
    its verify steps natively. ``lora_slots``: the three requests' adapter slots (a model with adapters proves its
    rows with and without). A pool of several ``kv_groups``: the proof step has each group's slots and tables.
    Logs the outcome; returns ``stack.enabled``."""
    stack.enabled = stack.verify = False
    kept = _prove(stack, forward, k_like, v_like, proof_batch(block_size, lora_slots, 1, kv_groups))
    stack.kept = kept
    if kept:
        stack.verify_kept = "decode steps are not stacked"
    elif not all(layer.verify_steps for layer in stack.layers):
        stack.verify_kept = "some layers run their verify steps per op"
    else:
        stack.verify = True  # while its proof runs: set back below unless it passes
        stack.verify_kept = _prove(
            stack, forward, k_like, v_like, proof_batch(block_size, lora_slots, VERIFY_PROOF_ROWS, kv_groups)
        )
        stack.verify = not stack.verify_kept
    stack.enabled = not kept  # each proof leaves the stack disabled
    if kept:
        logger.info("native decode stack: kept per layer: {}", kept)
    else:
        verify = " and per verify step" if stack.verify else f"; verify steps per layer: {stack.verify_kept}"
        logger.info("native decode stack: {} layers as one call per decode step{}", len(stack.layers), verify)
    return stack.enabled


def _prove(
    stack: DecodeStack,
    forward: Forward,
    k_like: list[torch.Tensor],
    v_like: list[torch.Tensor],
    proof: tuple[ForwardBatch, int],
) -> str:
    """One step of ``proof`` per layer, then stacked, over the same scratch pools: why the stacked step may not
    serve (empty: it may). Leaves the stack disabled."""
    batch, blocks = proof
    probe: list[tuple[int, Any]] = []
    try:
        stack.enabled, stack._probe, steps = False, probe, stack.steps

        def stacked() -> None:
            stack.enabled, stack._probe = True, None

        ref, got = both_ways(forward, batch, blocks, k_like, v_like, stacked, seed=0)
        return _verdict(len(stack.layers), probe, stack.steps - steps, ref, got)
    except Exception as e:  # noqa: BLE001 - any failure means: a call per layer
        return f"its proof step failed: {type(e).__name__}: {e}"
    finally:
        stack.enabled, stack._probe, stack._served = False, None, None


def both_ways(
    forward: Forward,
    batch: ForwardBatch,
    blocks: int,
    k_like: list[torch.Tensor],
    v_like: list[torch.Tensor],
    switch: Callable[[], None],
    seed: int,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A proof's two runs of ``batch``: over scratch pools of ``blocks`` blocks shaped as ``k_like``/``v_like``
    (random history from ``seed``), once as things are, then after ``switch()``, each on its own copy of the pools:
    ``(logits, every layer's K..., every layer's V...)`` of each."""
    generator = torch.Generator().manual_seed(seed)

    def pools(like: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.randn((blocks, *t.shape[1:]), generator=generator).to(t.dtype) for t in like]

    k0, v0 = pools(k_like), pools(v_like)
    runs = []
    for switched in (False, True):
        if switched:
            switch()
        k, v = [t.clone() for t in k0], [t.clone() for t in v0]
        logits = forward(batch, k, v)
        runs.append((logits, *k, *v))
    return runs[0], runs[1]


def _verdict(
    layers: int, probe: list[tuple[int, Any]], served: int, ref: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]
) -> str:
    """Why the stacked step may not serve (empty: it may)."""
    if [i for i, _ in probe] != list(range(layers)):
        return "the model does not call each of its layers once, in order"
    if any(tables is not probe[0][1] for _, tables in probe):
        return "its layers take different RoPE tables"
    if served != 1:
        return "the stacked step did not run (inputs of another kind)"
    if not all(torch.equal(a, b) for a, b in zip(ref, got)):
        return "the stacked step's logits or K/V differ from a call per layer"
    return ""
