"""One decode step of a packed decoder layer (``csrc/cpu_layer.cpp``): its inputs checked once, then the native
call, whole (:func:`.cpu_layer.decode_layer`) or, for a tensor-parallel rank, in the parts between the all-reduces
of its row-parallel projections (:func:`decode_layer_parts`).

A rank's layer holds slices: its query and KV heads of q/k/v and its rows of the MLP's up projections (column
parallel: their outputs are the rank's heads and MLP columns), its input columns of o and down (row parallel: their
outputs are partial sums over the rank's heads and columns, summed over the ranks by an all-reduce before the
replicated bias and the residual add). :func:`decode_layer_parts` runs

1. the attention and o's partial sums (a parallel block, Cohere's or Phi's, adds the MLP's partial sums of down to
   them: both blocks then need one all-reduce together),
2. ``all_reduce``; a sequential block adds ``o``'s bias and its output to ``h`` (with its norm and residual scale)
   and computes the MLP's partial sums of down, then ``all_reduce`` again,
3. the last bias(es) and the add onto ``h``.

The all-reduce runs in Python between native calls (``torch.distributed`` through the caller's function): a
callback from inside the OpenMP region would hold every other thread spinning at a barrier while gloo's own
threads need the cores, and would call into Python from a C++ thread. References: the per-op layer of the same
slices with the same all-reduces (the load-time check of ``runner.native.layers`` compares them with the
all-reduce as the identity, each rank on its own slices); ``tests/kernels/test_cpu_layer_parts.py`` sums two
halves of a layer through :func:`decode_layer_parts` against :func:`.cpu_layer_ref.decode_layer_ref` of the whole.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .cpu_native import NativeKernels

if TYPE_CHECKING:
    from .cpu_layer import LayerWeights
    from .cpu_layer_lora import LayerLora

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks in place and returns it."""

_SLOT_OUT_OF_RANGE = 5
_BAD_SPEC = 6


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for a native call, ``None`` (null) for none."""
    return None if t is None else t.data_ptr()


STEP_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The hidden state's (with its RoPE tables') and the pools' dtypes the native step takes, as the C++ codes (a bf16
hidden state is widened at entry and rounded once at exit, a rank's parts included)."""


def _rope_tables_fit(cos: torch.Tensor, sin: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> bool:
    return (
        cos.shape == shape and sin.shape == shape and cos.is_contiguous() and sin.is_contiguous()
        and cos.dtype == dtype and sin.dtype == dtype
    )  # fmt: skip


@dataclass(slots=True)
class LayerStep:
    """One decode step's checked inputs: :meth:`run` makes a native call of it (a stage, or the whole layer)."""

    native: NativeKernels
    out: torch.Tensor
    """The layer's output ``[T, H]`` (its input's dtype): a copy of its input that stages 0, 2 and 3 update."""
    args: tuple
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    num_blocks: int
    keep: tuple
    """What ``args`` points into beyond the above (scratch, slots, RoPE tables): alive as long as the step."""

    @classmethod
    def prepare(
        cls,
        native: NativeKernels,
        w: LayerWeights,
        hidden: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        lora: LayerLora | None = None,
        token_slots: torch.Tensor | None = None,
    ) -> LayerStep | None:
        """The step of :func:`.cpu_layer.decode_layer`'s arguments, ``None`` for inputs of another kind."""
        tokens = hidden.shape[0]
        requests = tokens if query_start_loc is None else query_start_loc.numel() - 1
        d = w.head_dim
        if w.form.rope == "none":
            cos = sin = None
        elif (
            cos is None or sin is None or not _rope_tables_fit(cos, sin, (tokens, w.form.rotary_dim or d), hidden.dtype)
        ):
            return None
        if (
            hidden.dtype not in STEP_DTYPES
            or hidden.shape != (tokens, w.hidden_size)
            or k_cache.dtype not in STEP_DTYPES
            or v_cache.dtype != k_cache.dtype
            or k_cache.shape != v_cache.shape
            or k_cache.stride() != v_cache.stride()
            or k_cache.shape[2:] != (w.num_kv_heads, d)
            or k_cache.stride(-1) != 1
            or slot_mapping.dtype != torch.int64
            or slot_mapping.numel() != tokens
            or block_tables.dim() != 2
            or block_tables.shape[0] < requests
            or seq_lens.numel() < requests
            or (query_start_loc is not None and (query_start_loc.dtype != torch.int32 or requests < 1))
            or (lora is not None and (token_slots is None or token_slots.shape != (tokens,)))
            or block_tables.dtype not in (torch.int32, torch.int64)
            or seq_lens.dtype not in (torch.int32, torch.int64)
        ):
            return None
        out = hidden.contiguous().clone()
        slot_mapping, seq_lens = slot_mapping.contiguous(), seq_lens.contiguous()
        if block_tables.stride(-1) != 1:
            block_tables = block_tables.contiguous()
        qsl = None if query_start_loc is None else query_start_loc.contiguous()
        lora_args = None if lora is None or token_slots is None else lora.args(token_slots)
        if lora is not None and lora_args is None:
            return None
        scratch = torch.empty(w.scratch_floats(tokens), dtype=torch.float32)
        block_size = k_cache.shape[1]
        args = (
            ctypes.addressof(w.spec), out.data_ptr(), tokens, address(cos), address(sin),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2),
            slot_mapping.data_ptr(), block_tables.data_ptr(), int(block_tables.dtype == torch.int64),
            block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(), int(seq_lens.dtype == torch.int64),
            block_size, scratch.data_ptr(), torch.get_num_threads(),
            address(qsl), requests, None if lora_args is None else ctypes.addressof(lora_args),
            STEP_DTYPES[hidden.dtype], STEP_DTYPES[k_cache.dtype],
        )  # fmt: skip
        keep = (scratch, slot_mapping, cos, sin, qsl, lora_args, token_slots)
        return cls(native, out, args, block_tables, seq_lens, block_size, int(k_cache.shape[0]), keep)

    def run(self, stage: int = 0, partial: torch.Tensor | None = None) -> None:
        """Stage ``stage`` of the step (0: the whole layer; 1-3: ``csrc/cpu_layer.cpp``'s
        ``tgi_paged_decode_layer_stage``, on the fp32 ``[T, H]`` ``partial``); ``ValueError`` for a slot or block
        id outside the pool or a table too narrow."""
        status = self.native.decode_layer_stage(stage, address(partial), *self.args)
        if status == _SLOT_OUT_OF_RANGE:
            slots = self.num_blocks * self.block_size
            raise ValueError(f"decode_layer: slot_mapping holds a slot outside the pool's {slots} slots")
        if status == _BAD_SPEC:
            raise ValueError(
                "decode_layer: status 6: the stage, query_start_loc or the LoRA slots / targets do not fit this layer"
            )
        if status != 0:
            raise ValueError(
                self.native.decode_error(status, self.block_tables, self.seq_lens, self.block_size, self.num_blocks)
            )


def decode_layer_parts(
    native: NativeKernels,
    w: LayerWeights,
    hidden: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    all_reduce: AllReduce,
) -> torch.Tensor | None:
    """A tensor-parallel rank's decode step of its layer ``w`` (its slices, packed): :func:`.cpu_layer.decode_layer`
    with ``all_reduce`` summing the row-parallel projections' partial sums over the ranks (see the module
    docstring; one call for a parallel block, two for a sequential one), fp32 partial sums whatever ``hidden``'s
    dtype (a bf16 one is widened once and rounded once, as the whole layer's). ``None`` for inputs of another kind,
    and for a form the parts do not run (an MoE MLP in a parallel block), before any all-reduce; every rank must get
    the same answer. An MoE MLP: each rank's slice of every expert's intermediate (the router replicated)."""
    if w.form.experts and w.form.parallel:
        return None
    step = LayerStep.prepare(native, w, hidden, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens)
    if step is None:
        return None
    partial = torch.empty(step.out.shape, dtype=torch.float32)
    step.run(1, partial)
    all_reduce(partial)
    if not w.form.parallel:
        step.run(2, partial)
        all_reduce(partial)
    step.run(3, partial)
    return step.out
