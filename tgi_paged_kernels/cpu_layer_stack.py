"""One decode step of a stack of whole decoder layers as one native call (``csrc/cpu_layer.cpp``'s
``tgi_paged_decode_layers``): the layers of a model one after the other, each as :func:`.cpu_layer.decode_layer`
would run it, with no Python, ctypes conversion or argument checks between them.

Layer 0's inputs are checked by :meth:`.cpu_layer_step.LayerStep.prepare`; every other layer's pools and block
table must be laid out as layer 0's (same shape, strides, dtype), and every layer takes the same hidden state, RoPE
tables and sequence lengths (one token per request, or a verify step's rows); the same slots, or each layer its own
(KV layer groups); each layer its own LoRA rows when adapters are used.
Reference: the same layers through :func:`.cpu_layer.decode_layer` one by one
(``tests/kernels/test_cpu_layer_stack.py``: equal to the bit, K/V included).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .cpu_layer_step import _BAD_SPEC, _SLOT_OUT_OF_RANGE, LayerStep
from .cpu_native import NativeKernels

if TYPE_CHECKING:
    from .cpu_layer import LayerWeights
    from .cpu_layer_lora import LayerLora


class LayerStack:
    """Layers ``weights`` (in model order) as one native call per decode step; built once per model."""

    def __init__(self, native: NativeKernels, weights: Sequence[LayerWeights]) -> None:
        if not weights:
            raise ValueError("LayerStack: no layers")
        first = weights[0]
        shape = (first.num_kv_heads, first.head_dim, first.hidden_size, first.form.rope, first.form.rotary_dim)
        for w in weights:
            if (w.num_kv_heads, w.head_dim, w.hidden_size, w.form.rope, w.form.rotary_dim) != shape:
                raise ValueError("LayerStack: the layers differ in KV heads, head size, hidden size or rotary kind")
        self.native = native
        self.weights = tuple(weights)
        self._specs = (ctypes.c_void_p * len(weights))(*(ctypes.addressof(w.spec) for w in weights))
        self._scratch_per_token = max(w.scratch_floats(1) for w in weights)

    def __len__(self) -> int:
        return len(self.weights)

    def decode(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor | Sequence[torch.Tensor],
        block_tables: Sequence[torch.Tensor],
        seq_lens: torch.Tensor,
        loras: Sequence[LayerLora] | None = None,
        token_slots: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The stack's output for ``hidden`` ``[T, H]`` (a new tensor of its dtype): layer ``i`` on its pools
        ``k_caches[i]``/``v_caches[i]`` and its table ``block_tables[i]``, with ``loras[i]``'s deltas on the rows
        whose ``token_slots`` entry is an adapter (added in fp32), the other arguments as
        :func:`.cpu_layer.decode_layer`'s (one token per request, or with ``query_start_loc`` a verify step's rows).
        ``slot_mapping``: one for every layer, or one per layer (KV layer groups: each group its own slots).
        ``None`` for inputs of another kind (the caller runs a call per layer); ``ValueError`` for a slot or block id
        outside the pool or a table too narrow."""
        n = len(self.weights)
        if len(k_caches) != n or len(v_caches) != n or len(block_tables) != n:
            return None
        per_layer = None
        if isinstance(slot_mapping, torch.Tensor):
            first_slots = slot_mapping
        else:
            per_layer = list(slot_mapping)
            rows = (hidden.shape[0],)
            if len(per_layer) != n or any(
                s.dtype != torch.int64 or s.shape != rows or not s.is_contiguous() for s in per_layer
            ):
                return None
            first_slots = per_layer[0]
        lora_args = None
        if loras is not None:
            if token_slots is None or len(loras) != n:
                return None
            made = [lora.args(token_slots) for lora in loras]
            lora_args = [a for a in made if a is not None]
            if len(lora_args) != n:
                return None
        step = LayerStep.prepare(
            self.native, self.weights[0], hidden, cos, sin, k_caches[0], v_caches[0], first_slots, block_tables[0],
            seq_lens, query_start_loc, None if loras is None else loras[0], token_slots,
        )  # fmt: skip
        if step is None:
            return None
        k0, table0 = k_caches[0], step.block_tables
        for k, v, table in zip(k_caches, v_caches, block_tables):
            if (
                k.shape != k0.shape or k.stride() != k0.stride() or k.dtype != k0.dtype
                or v.shape != k0.shape or v.stride() != k0.stride() or v.dtype != k0.dtype
                or table.shape != table0.shape or table.stride() != table0.stride() or table.dtype != table0.dtype
            ):  # fmt: skip
                return None
        tokens = hidden.shape[0]
        scratch = torch.empty(self._scratch_per_token * tokens, dtype=torch.float32)
        pointers = ctypes.c_void_p * n
        failed = ctypes.c_int64(-1)
        a = step.args  # LayerStep's argument tuple: see LayerStep.prepare
        status = self.native.decode_layers(
            n, self._specs, pointers(*(k.data_ptr() for k in k_caches)), pointers(*(v.data_ptr() for v in v_caches)),
            pointers(*(t.data_ptr() for t in block_tables)),
            None if lora_args is None else pointers(*(ctypes.addressof(a) for a in lora_args)), ctypes.byref(failed),
            a[1], a[2], a[3], a[4], a[7], a[8], a[9], a[10], a[11],
            None if per_layer is None else pointers(*(s.data_ptr() for s in per_layer)),
            a[13], a[14], a[15], a[16], a[17], a[18],
            scratch.data_ptr(), a[20], a[21], a[22], a[24], a[25],
        )  # fmt: skip
        if status == 0:
            return step.out
        where = f"decode_layers (layer {failed.value})"
        if status == _SLOT_OUT_OF_RANGE:
            slots = step.num_blocks * step.block_size
            raise ValueError(f"{where}: slot_mapping holds a slot outside the pool's {slots} slots")
        if status == _BAD_SPEC:
            raise ValueError(f"{where}: status 6: a layer's spec does not fit the step")
        table = block_tables[failed.value] if 0 <= failed.value < n else table0
        raise ValueError(
            f"{where}: {self.native.decode_error(status, table, step.seq_lens, step.block_size, step.num_blocks)}"
        )
