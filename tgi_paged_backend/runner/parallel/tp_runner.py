"""The tensor-parallel runner: every rank loads the full checkpoint on the CPU, slices each decoder layer in
place (:mod:`.slicing`: the layouts and how each is cut, ``docs/tensor-parallel.md``), then moves only its
shard to its device (peak device memory: one shard; peak host memory: one full copy per rank).

Embeddings, norms and ``lm_head`` are replicated: every rank computes the full logits, which are
bit-identical across ranks because the all-reduced hidden states are, so sampling with the router's seeds
picks the same tokens everywhere. transformers' attention modules reshape with ``view(..., -1, head_dim)``,
so they run on the local heads; our paged attention sees the local query and KV heads and the KV pool holds
the local KV heads per rank (:class:`TensorParallelRunner` sizes it from a per-rank
:class:`~tgi_paged_backend.runner.model.spec.ModelSpec`).

Quantized models (``--quantize fp8``, compressed-tensors, GPTQ, AWQ) are quantized or decoded on the
full CPU copy first, then sliced the same way: column-parallel ``Fp8Linear``/``IntLinear`` keep their
rows (codes, scales, zero points); row-parallel ones (``RowParallelQuantLinear``) keep their input
columns: fp8 with every row's full scale, int with those columns' ``g_idx`` and the groups they use
(only its own groups when the slice is on group boundaries; with GPTQ act-order, whichever groups its
columns belong to). Each rank thus computes with exactly the unsharded model's quantized weights.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from loguru import logger

from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model.loader import LoadedModel, load_model, resolve_dtype
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.parallel.slicing import ShardLayout, local_spec

if TYPE_CHECKING:
    from tgi_paged_backend.runner.parallel.process_group import TensorParallelGroup

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


class TensorParallelRunner(ModelRunner):
    """A :class:`ModelRunner` over this rank's shard of the model.

    ``spec`` (hence ``block_bytes`` and the KV pool) describes the local heads: each rank stores
    ``1/N`` of the KV bytes of every token, in a pool with the same number of blocks on every rank.
    :meth:`available_kv_bytes` is the minimum over the ranks, so every rank sizes the same pool.
    """

    static_decode_supported = False  # decode graphs with collectives inside: not captured yet

    def warm_decode(self) -> float:
        """Nothing: a dummy step would need every rank in its collectives; the first real decode step,
        which all ranks run, pays the one-time costs instead."""
        return 0.0

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device | str,
        group: TensorParallelGroup,
    ) -> None:
        self.group: TensorParallelGroup = group
        super().__init__(model_config, cache_config, device)
        logger.info(
            "Tensor parallel: rank {}/{} holds {} of {} query heads, {} of {} KV heads, MLP {} of {}; "
            "weights {:.1f} MiB",
            group.rank,
            group.world_size,
            self.spec.num_q_heads,
            self.full_spec.num_q_heads,
            self.spec.num_kv_heads,
            self.full_spec.num_kv_heads,
            self.spec.intermediate_size,
            self.full_spec.intermediate_size,
            self.weights_bytes / 2**20,
        )

    @property
    def layout(self) -> ShardLayout:
        """What this rank holds (the ``tp_slice`` rewrite's report)."""
        layout = self.rewrites.get("tp_slice")
        assert layout is not None, "the tp_slice rewrite runs on every tensor-parallel runner"
        return layout

    def _load_model(self, model_config: ModelConfig) -> LoadedModel:
        """Load the full checkpoint on the CPU in the target dtype; the ``tp_slice`` rewrite keeps this rank's
        shard and moves it to the device."""
        dtype = resolve_dtype(model_config.dtype, self.device)
        # A vision-language model's language model is sliced, its vision tower kept whole (slicing.text_model).
        return load_model(dataclasses.replace(model_config, dtype=_DTYPE_NAMES[dtype]), "cpu")

    def _serving_spec(self, full_spec: ModelSpec) -> ModelSpec:
        """This rank's heads and MLP columns."""
        self.full_spec = full_spec
        return local_spec(full_spec, self.layout)

    def available_kv_bytes(self, memory_fraction: float, activation_bytes: int | None = None) -> int:
        """The KV budget of the tightest rank (a collective: every rank calls it at the same point)."""
        local = super().available_kv_bytes(memory_fraction, activation_bytes)
        return self.group.min_int(local, "agreeing on the KV pool size")
