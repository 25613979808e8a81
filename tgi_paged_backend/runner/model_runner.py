"""Run the model over a paged KV pool: allocation, forward, block copies, swap and profiling.

The runner owns the model, the per-layer K/V pool tensors and the CPU swap space. It never sees
virtual blocks or requests: the engine hands it a :class:`ForwardBatch` of physical slots and block
tables and gets logits back, and asks it to copy or swap physical blocks by id.

Pool layout, per layer: ``k_caches[i]`` and ``v_caches[i]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. The swap space has the same shape with
``num_cpu_blocks`` rows (pinned when the device is CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loguru import logger

import tgi_paged_kernels
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.lora.checkpoint import LoraAdapter, load_adapters
from tgi_paged_backend.lora.layers import LoraModel, attach_adapters
from tgi_paged_backend.lora.sources import parse_lora_adapters
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.runner import memory_budget
from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata, mask_placeholder
from tgi_paged_backend.runner.cpu.fast_layers import swap_fast_layers
from tgi_paged_backend.runner.cpu.fused_blocks import fuse_blocks
from tgi_paged_backend.runner.cpu.native_layers import wrap_native_layers
from tgi_paged_backend.runner.input_batch import ForwardBatch, RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model.loader import LoadedModel, ModelLoadError, load_model, resident_bytes
from tgi_paged_backend.runner.model.medusa import MedusaHeads, MedusaLoadError, load_medusa_heads, read_medusa_config
from tgi_paged_backend.runner.model.spec import ModelSpec, resolve_kv_dtype
from tgi_paged_backend.runner.static.cuda_graphs import measure_decode_graph_bytes
from tgi_paged_backend.runner.static.decode_step import CPU_COMPILE_BUCKETS, StaticDecodeStep, blocks_per_request

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


class ModelRunner:
    """Model plus paged KV pool on one device.

    Parameters
    ----------
    model_config : ModelConfig
        What to load (a local directory) and in which dtype.
    cache_config : CacheConfig
        Block size and KV dtype of the pool.
    device : torch.device | str
        ``cpu`` or ``cuda[:n]``.
    """

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device | str = "cpu"
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_config = model_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size

        self.adapters: tuple[LoraAdapter, ...] = ()
        """``LORA_ADAPTERS``, read and checked by :meth:`_load_model` against the unsharded model."""
        loaded = self._load_model(model_config)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.generation_config = loaded.generation_config
        self.eos_token_ids: tuple[int, ...] = loaded.eos_token_ids
        self.dtype = loaded.dtype
        self.spec = ModelSpec.from_hf_config(self.model.config, self.dtype)
        groups = self.spec.kv_groups
        self.kv_groups: LayerGroups = (
            LayerGroups.uniform(self.spec.num_layers) if groups.is_hybrid and not cache_config.layer_groups else groups
        )
        """The KV layer groups the engine pages by (one page map per group; one group of every layer, with the
        window when every layer has it, unless full and sliding layers mix): ``allocate_kv_cache(n,
        grouped=True)`` lays the pool out for them, a block holding ``layers_per_block`` layers."""
        self.pool_groups: LayerGroups = LayerGroups.uniform(self.spec.num_layers)
        """The groups the current pool is laid out for (one group of every layer unless allocated grouped)."""
        self.kv_dtype = resolve_kv_dtype(cache_config.kv_cache_dtype, self.dtype)
        # Before the swaps below: the layers it wraps are no longer plain linears, so fusion leaves them.
        self.lora: LoraModel | None = attach_adapters(self.model, self.adapters, self.device)
        self.fusion = fuse_blocks(self.model, self.block_size, self.kv_dtype) if self.device.type == "cpu" else None
        self.native_layers = (
            wrap_native_layers(self.model, self.block_size)
            # Not with TGI_PAGED_COMPILE: its static step traces the per-op path, which would unpack the
            # native layers' weights inside the graph.
            if self.fusion is not None
            and model_config.native_layers
            and self.kv_dtype == torch.float32
            and not model_config.compile_decode
            else None
        )
        self.fast_layers = swap_fast_layers(self.model, self.device, self.dtype)
        self.medusa: MedusaHeads | None = self._load_medusa(model_config)
        if self.medusa is not None:
            self.static_decode_supported = False  # the heads read lm_head's input, which a graph does not hand out
        self.k_scale = 1.0
        self.v_scale = 1.0
        self._layer_group: tuple[int, ...] = (0,) * self.spec.num_layers
        self._k_slots: list[torch.Tensor] = []
        self._v_slots: list[torch.Tensor] = []

        self.weights_bytes = resident_bytes(self.model) + (self.medusa.num_bytes if self.medusa is not None else 0)
        self.activation_peak_bytes: int | None = None
        """Set by :meth:`profile_prefill`; used by :meth:`available_kv_bytes`."""
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.cpu_k_caches: list[torch.Tensor] = []
        self.cpu_v_caches: list[torch.Tensor] = []
        self.graph_bytes = 0
        """Device bytes of the decode CUDA graphs (:meth:`profile_decode_graphs`), kept out of the KV pool."""
        self.static_decode: StaticDecodeStep | None = None
        """The static decode step decode batches run through when it holds them (:meth:`prepare_static_decode`)."""

    def _load_model(self, model_config: ModelConfig) -> LoadedModel:
        """Load the model onto ``self.device`` and read its adapters (the tensor-parallel runner loads its
        shard instead)."""
        loaded = load_model(model_config, self.device)
        self.adapters = self._read_adapters(loaded)
        return loaded

    def _load_medusa(self, model_config: ModelConfig) -> MedusaHeads | None:
        """The Medusa heads proposing drafts (``model_config.medusa_dir``), the first ``speculate`` of them."""
        if model_config.medusa_dir is None or model_config.num_speculative_tokens == 0:
            return None
        path = Path(model_config.medusa_dir)
        config = read_medusa_config(path)
        assert config is not None, f"{path} was resolved as a Medusa checkpoint"
        hf_model: Any = self.model
        text = hf_model.config.get_text_config()
        try:
            heads = load_medusa_heads(
                path,
                config,
                model_config.num_speculative_tokens,
                hf_model.get_output_embeddings(),
                hidden_size=int(text.hidden_size),
                vocab_size=int(text.vocab_size),
                device=self.device,
                dtype=self.dtype,
            )
        except MedusaLoadError as err:
            raise ModelLoadError(str(err)) from None
        logger.info("speculation: {} Medusa heads from {}", heads.num_heads, path)
        return heads

    def propose_medusa(self, rows: Sequence[int], k: int) -> list[list[int]]:
        """The Medusa heads' proposals (up to ``k`` tokens) at logits rows ``rows`` of the last forward."""
        assert self.medusa is not None
        return self.medusa.propose(rows, k)

    def _read_adapters(self, loaded: LoadedModel) -> tuple[LoraAdapter, ...]:
        """The ``LORA_ADAPTERS`` checkpoints, checked against ``loaded`` (unsharded)."""
        sources = parse_lora_adapters(self.model_config.lora_adapters)
        return load_adapters(sources, loaded.model, loaded.dtype) if sources else ()

    @property
    def lora_bytes(self) -> int:
        """Bytes of the LoRA adapters' weights held by this runner (part of :attr:`weights_bytes`)."""
        return 0 if self.lora is None else self.lora.num_bytes

    # ------------------------------------------------------------------ memory
    @property
    def block_bytes(self) -> int:
        """Bytes of one physical block of the current pool layout (K and V, all its layers) in the pool's dtype."""
        return self.block_bytes_for(self.pool_groups)

    def block_bytes_for(self, groups: LayerGroups) -> int:
        """Bytes of one block of a pool laid out for ``groups`` (``layers_per_block`` layers' K and V)."""
        per_layer = self.spec.kv_bytes_per_block(self.block_size, self.kv_dtype) // self.spec.num_layers
        return per_layer * groups.layers_per_block

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool (0 before :meth:`allocate_kv_cache`)."""
        return int(self.k_caches[0].shape[0]) if self.k_caches else 0

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of swap space (0 before :meth:`allocate_swap_space`)."""
        return int(self.cpu_k_caches[0].shape[0]) if self.cpu_k_caches else 0

    def _block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)

    def allocate_kv_cache(self, num_blocks: int, *, grouped: bool = False) -> None:
        """Allocate (or replace) the pool: per layer K and V of ``[num_blocks, block_size, Hkv, D]``.

        ``grouped``: laid out for :attr:`kv_groups` (their ``layers_per_block`` slot tensors, each layer's
        ``k_caches`` entry a view of its slot's): every forward then needs the groups' block tables.
        Zero-filled, so blocks never written hold finite values.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV pool needs at least one block")
        self.static_decode = None  # its graphs hold the old pool's addresses
        self.k_caches, self.v_caches = [], []  # free the old pool before allocating the new one
        self.pool_groups = self.kv_groups if grouped else LayerGroups.uniform(self.spec.num_layers)
        self._layer_group = tuple(self.pool_groups.layer_group(layer) for layer in range(self.spec.num_layers))
        shape = self._block_shape(num_blocks)
        slots = self.pool_groups.layers_per_block
        k_slots = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(slots)]
        v_slots = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(slots)]
        self._k_slots, self._v_slots = k_slots, v_slots
        # Layer l's K/V lives in slot tensor layer_slot(l): a block holds one group's layers (with one
        # group, slot = layer).
        for layer in range(self.spec.num_layers):
            self.k_caches.append(k_slots[self.pool_groups.layer_slot(layer)])
            self.v_caches.append(v_slots[self.pool_groups.layer_slot(layer)])
        logger.info(
            "KV pool: {} blocks x {} tokens, {:.1f} MiB ({})",
            num_blocks,
            self.block_size,
            num_blocks * self.block_bytes / 2**20,
            self.kv_dtype,
        )

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """Allocate (or replace) the CPU swap space; pinned when the device is CUDA. 0 frees it."""
        self.cpu_k_caches, self.cpu_v_caches = [], []
        if num_cpu_blocks <= 0:
            return
        pin = self.device.type == "cuda"
        shape = self._block_shape(num_cpu_blocks)
        for _ in range(self.pool_groups.layers_per_block):  # one per slot tensor of the pool
            self.cpu_k_caches.append(torch.empty(shape, dtype=self.kv_dtype, pin_memory=pin))
            self.cpu_v_caches.append(torch.empty(shape, dtype=self.kv_dtype, pin_memory=pin))

    def device_total_bytes(self) -> int:
        """Total memory of the device (host RAM on CPU)."""
        return memory_budget.device_total_bytes(self.device)

    def available_kv_bytes(self, memory_fraction: float, activation_bytes: int | None = None) -> int:
        """Bytes the KV pool may take.

        CUDA: ``memory_fraction * total - weights - activation peak - decode graphs``, capped by what is
        actually free (``mem_get_info`` plus memory torch holds in its cache or in a current pool).
        CPU: ``memory_fraction * available RAM - activation estimate``, capped at
        :data:`CPU_KV_BUDGET_CAP_BYTES`.

        ``activation_bytes`` defaults to the last :meth:`profile_prefill` result (0 if none).
        """
        memory_budget.check_memory_fraction(memory_fraction)
        activation = self.activation_peak_bytes if activation_bytes is None else activation_bytes
        activation = activation or 0
        pool_bytes = self.num_blocks * self.block_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            held = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            by_fraction = memory_fraction * total - self.weights_bytes - activation - self.graph_bytes
            by_free = free + held + pool_bytes - activation - self.graph_bytes
            budget = min(by_fraction, by_free)
        else:
            return memory_budget.cpu_kv_budget(
                memory_fraction, memory_budget.cpu_available_bytes() + pool_bytes, activation
            )
        return max(0, int(budget))

    # ----------------------------------------------------------------- forward
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step and return logits of the requested rows.

        Parameters
        ----------
        batch : ForwardBatch
            Packed tokens of ``B`` requests (``T`` tokens, ``K`` logits rows), on any device.

        Returns
        -------
        torch.Tensor
            ``[K, vocab]`` float32 logits for ``batch.logits_indices``, on the runner's device.
        """
        if not self.k_caches:
            raise RuntimeError("allocate_kv_cache() must be called before forward()")
        if self.pool_groups.num_groups != 1 + len(batch.group_block_tables):
            raise ValueError(
                f"the pool is laid out for {self.pool_groups.num_groups} KV layer group(s); the batch carries "
                f"block tables for {1 + len(batch.group_block_tables)}"
            )
        if self.static_decode is not None and batch.is_decode and batch.lora_slots is None:
            logits = self.static_decode.run(batch.to(self.device))
            if logits is not None:
                return logits
        return self._forward(batch, self.k_caches, self.v_caches)

    def _forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        batch = batch.to(self.device)
        metadata = PagedAttentionMetadata(
            batch, k_caches, v_caches, self.k_scale, self.v_scale,
            cpu_decode=self.model_config.cpu_decode,
            layer_groups=self._layer_group if batch.group_block_tables else None,
        )  # fmt: skip
        routing = self.lora.step.open(batch.lora_slots) if self.lora is not None else contextlib.nullcontext()
        with torch.inference_mode(), routing:
            out = self.model(
                input_ids=batch.input_ids.unsqueeze(0),
                position_ids=batch.positions.unsqueeze(0),
                attention_mask=mask_placeholder(self.device, self.dtype),
                use_cache=False,
                logits_to_keep=batch.logits_indices,
                return_dict=True,
                **{METADATA_KWARG: metadata},
            )
        return out.logits[0].float()

    def warm_decode(self) -> float:
        """Run one dummy decode step so its one-time costs (the CPU decode kernel's compilation, oneDNN's
        primitive caches) are paid at Warmup, not by the first request. Returns the seconds it took.

        Three requests of ``block_size + 1`` tokens (sizes that differ, so no duck-sized guard of the
        compiled kernel ties them), every block the scratch block 0 (never handed out), so no pool block
        another request could own is written.
        """
        if not self.k_caches:
            raise RuntimeError("allocate_kv_cache() must be called before warm_decode()")
        chunks = [RequestChunk(token_ids=[0], num_computed=self.block_size, block_table=[0, 0]) for _ in range(3)]
        start = time.perf_counter()
        self._forward(build_forward_batch(chunks, self.block_size), self.k_caches, self.v_caches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        logger.info("decode warm-up step: {:.1f} s", seconds)
        return seconds

    # ----------------------------------------------------------- static decode
    static_decode_supported = True
    """Whether decode may run through the static step (not yet the tensor-parallel runner: collectives
    inside a captured graph are untested)."""

    def _compiles_decode(self) -> bool:
        """``TGI_PAGED_COMPILE`` on a CPU runner: decode through the compiled static step."""
        return self.device.type == "cpu" and self.model_config.compile_decode and self.static_decode_supported

    def _graph_buckets(self) -> tuple[int, ...]:
        """The ``CUDA_GRAPHS`` batch sizes this runner captures (none off CUDA)."""
        if self.device.type != "cuda" or not self.static_decode_supported:
            return ()
        return self.model_config.cuda_graphs

    def _static_step(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        *,
        max_seq_len: int,
        buckets: Sequence[int],
        fixed_width: bool = True,
        groups: LayerGroups | None = None,
    ) -> StaticDecodeStep:
        """The static step over ``k_caches``/``v_caches`` laid out for ``groups`` (default: the pool's)."""
        groups = self.pool_groups if groups is None else groups
        layer_groups = tuple(groups.layer_group(layer) for layer in range(self.spec.num_layers))
        max_blocks = blocks_per_request(max_seq_len, self.block_size)
        return StaticDecodeStep(
            self.model, k_caches, v_caches, self.k_scale, self.v_scale, buckets, max_blocks, fixed_width,
            layer_groups=layer_groups if groups.num_groups > 1 else None,
        )  # fmt: skip

    def profile_decode_graphs(self, max_seq_len: int) -> int:
        """Device bytes the decode CUDA graphs will take (0 off CUDA or without ``CUDA_GRAPHS``), measured
        by capturing them against a temporary pool before the real one is sized; stored in
        :attr:`graph_bytes`, which :meth:`available_kv_bytes` leaves out. A failed capture turns graphs off."""
        self.graph_bytes = 0
        buckets = self._graph_buckets()
        if buckets:
            # Before the pool exists: the step the engine's (grouped) pool will get.
            make = partial(self._static_step, max_seq_len=max_seq_len, buckets=buckets, groups=self.kv_groups)
            try:
                self.graph_bytes = measure_decode_graph_bytes(
                    make, self._block_shape(1), self.spec.num_layers, self.kv_dtype, self.device
                )
            except Exception as e:  # a family whose forward syncs or branches on values: serve it eagerly
                logger.warning("decode CUDA graphs off: capture failed ({}: {})", type(e).__name__, e)
                self.model_config = dataclasses.replace(self.model_config, cuda_graphs=())
        return self.graph_bytes

    def prepare_static_decode(
        self,
        max_seq_len: int,
        *,
        mode: str | None = None,
        buckets: Sequence[int] | None = None,
        fixed_width: bool | None = None,
        **compile_options: Any,
    ) -> None:
        """Set up the static decode step over the allocated pool, for requests of up to ``max_seq_len``
        tokens (Warmup, after :meth:`allocate_kv_cache`, which drops it again).

        By default (``mode=None``): on CUDA with ``CUDA_GRAPHS`` buckets, capture one graph per bucket;
        on CPU with ``TGI_PAGED_COMPILE``, compile one graph for :data:`CPU_COMPILE_BUCKETS`; otherwise
        nothing, and decode stays eager. ``mode`` ``"graphs"``, ``"compile"`` (``torch.compile``
        with ``compile_options``, e.g. ``backend``) or ``"eager"`` with ``buckets`` (default: the
        ``CUDA_GRAPHS`` ones) choose explicitly (tests, benchmarks); ``fixed_width`` (default: only for
        graphs) as :class:`~runner.static.decode_step.StaticDecodeStep` takes it. A failed capture or compile is
        logged and leaves decode eager (:meth:`.StaticDecodeStep.prepare`).
        """
        self.static_decode = None
        if not self.k_caches:
            raise RuntimeError("allocate_kv_cache() must be called before prepare_static_decode()")
        chosen = tuple(buckets) if buckets is not None else self.model_config.cuda_graphs
        if mode is None and self._graph_buckets():
            mode, chosen = "graphs", self._graph_buckets()
        elif mode is None and self._compiles_decode():  # one graph, rows dynamic: no per-size compile
            mode, chosen, compile_options = "compile", CPU_COMPILE_BUCKETS, {"dynamic_rows": True, **compile_options}
        if mode is None or not chosen:
            return
        fixed = mode == "graphs" if fixed_width is None else fixed_width
        step = self._static_step(
            self.k_caches, self.v_caches, max_seq_len=max_seq_len, buckets=chosen, fixed_width=fixed
        )
        if step.prepare(mode, **compile_options):
            self.static_decode = step

    # ------------------------------------------------------------ block moves
    @staticmethod
    def _ids(ids: BlockIds, device: torch.device) -> torch.Tensor:
        if torch.is_tensor(ids):
            return ids.to(device=device, dtype=torch.int64)
        return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)

    def copy_blocks(self, src: BlockIds, dst: BlockIds) -> None:
        """Copy pool blocks ``src[i] -> dst[i]`` in every layer (copy-on-write)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks: {len(src)} sources for {len(dst)} destinations")
        if len(src) == 0:
            return
        tgi_paged_kernels.copy_blocks(
            self._k_slots, self._v_slots, self._ids(src, self.device), self._ids(dst, self.device)
        )

    def swap_out(self, device_ids: BlockIds, cpu_ids: BlockIds) -> None:
        """Copy pool blocks ``device_ids[i]`` to swap blocks ``cpu_ids[i]`` (every slot tensor, K and V)."""
        self._swap(self._k_slots + self._v_slots, self.cpu_k_caches + self.cpu_v_caches, device_ids, cpu_ids)

    def swap_in(self, cpu_ids: BlockIds, device_ids: BlockIds) -> None:
        """Copy swap blocks ``cpu_ids[i]`` back to pool blocks ``device_ids[i]``."""
        self._swap(self.cpu_k_caches + self.cpu_v_caches, self._k_slots + self._v_slots, cpu_ids, device_ids)

    def _swap(
        self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src_ids: BlockIds, dst_ids: BlockIds
    ) -> None:
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"swap: {len(src_ids)} sources for {len(dst_ids)} destinations")
        if len(src_ids) == 0:
            return
        if not self.cpu_k_caches:
            raise RuntimeError("allocate_swap_space() must be called before swapping")
        cpu = torch.device("cpu")
        # swap_blocks returns once the CPU side is done: swap-out copies have landed in the swap
        # space, swap-in sources have been read (the device-side scatter is in stream order).
        tgi_paged_kernels.swap_blocks(src_caches, dst_caches, self._ids(src_ids, cpu), self._ids(dst_ids, cpu))

    # --------------------------------------------------------------- profiling
    def _dummy_prefill(self, num_tokens: int, num_logits: int) -> tuple[ForwardBatch, int]:
        """A prefill of ``num_tokens`` tokens split into requests no longer than the model allows."""
        max_len = self.spec.max_position_embeddings or num_tokens
        lengths = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        chunks, next_block = [], 0
        for n in lengths:
            nblocks = -(-n // self.block_size)
            chunks.append(
                RequestChunk(token_ids=[0] * n, num_computed=0, block_table=range(next_block, next_block + nblocks))
            )
            next_block += nblocks
        batch = build_forward_batch(chunks, self.block_size)
        if num_logits > len(lengths):  # prompt logprobs: logits for the last num_logits tokens
            indices = torch.arange(num_tokens - min(num_logits, num_tokens), num_tokens, dtype=torch.int64)
            batch = dataclasses.replace(batch, logits_indices=indices)
        return batch, next_block

    def profile_prefill(self, num_tokens: int, *, num_logits: int = 1) -> int:
        """Activation peak in bytes of a prefill of ``num_tokens`` tokens; also stored on the runner.

        CUDA: measured with ``torch.cuda.max_memory_allocated`` around a dummy forward that writes
        into a temporary pool (the real pool, if any, is untouched). CPU: an estimate (hidden
        states, QKV, MLP, a naive attention-score matrix per request and the logits rows).
        ``num_logits`` sizes the logits part (``num_tokens`` when prompt logprobs are served).
        """
        if num_tokens < 1:
            raise ValueError("profile_prefill needs num_tokens >= 1")
        if self.device.type != "cuda":
            peak = memory_budget.estimate_prefill_bytes(self.spec, self.dtype, num_tokens, num_logits)
        else:
            batch, nblocks = self._dummy_prefill(num_tokens, num_logits)
            shape = self._block_shape(nblocks)
            k_tmp = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.spec.num_layers)]
            v_tmp = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.spec.num_layers)]
            batch = batch.to(self.device)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self._forward(batch, k_tmp, v_tmp)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
            del k_tmp, v_tmp
            torch.cuda.empty_cache()
        self.activation_peak_bytes = int(peak)
        logger.info("prefill of {} tokens: activation peak {:.1f} MiB", num_tokens, peak / 2**20)
        return int(peak)

    def measure_copy_bandwidth(self, num_bytes: int = 64 * 1024**2, repeats: int = 3) -> float:
        """Bytes per second of a device <-> CPU copy (:func:`.memory_budget.measure_copy_bandwidth`)."""
        return memory_budget.measure_copy_bandwidth(self.device, num_bytes, repeats)
