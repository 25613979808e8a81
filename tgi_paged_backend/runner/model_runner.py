"""Run the model over a paged KV pool: the forward step, the static decode step, block moves by id.

The runner owns the model (loaded, then rewritten by :mod:`.rewrites`), the KV pool and swap space
(:class:`~.kv_pool.KVPool`) and the static decode step. It never sees virtual blocks or requests: the engine
hands it a :class:`ForwardBatch` of physical slots and block tables and gets logits back, and asks it to
copy or swap physical blocks by id. How big the pool may be: :mod:`.memory_budget`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

import tgi_paged_kernels
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.lora.checkpoint import LoraAdapter, load_adapters
from tgi_paged_backend.lora.layers import LoraModel
from tgi_paged_backend.lora.sources import parse_lora_adapters
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.runner import memory_budget
from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata, mask_placeholder
from tgi_paged_backend.runner.cpu.fast_layers import SwapReport
from tgi_paged_backend.runner.cpu.fused_blocks import FusionReport
from tgi_paged_backend.runner.families.alibi import has_alibi_attention
from tgi_paged_backend.runner.image_embeds import model_inputs
from tgi_paged_backend.runner.input_batch import ForwardBatch, RequestChunk, build_forward_batch, dummy_prefill_chunks
from tgi_paged_backend.runner.kv_pool import BlockIds, KVPool
from tgi_paged_backend.runner.model.loader import LoadedModel, load_model, resident_bytes
from tgi_paged_backend.runner.model.medusa import MedusaHeads, load_medusa_for
from tgi_paged_backend.runner.model.spec import ModelSpec, resolve_kv_dtype
from tgi_paged_backend.runner.native.direct import DirectDecode, direct_decode, prove_direct
from tgi_paged_backend.runner.native.layers import NativeLayersReport
from tgi_paged_backend.runner.native.stack import prove_stack
from tgi_paged_backend.runner.rewrites.base import AppliedRewrites, ModelRewrite, RewriteContext
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites, run_rewrites
from tgi_paged_backend.runner.static import setup as static_setup
from tgi_paged_backend.runner.static.decode_step import StaticDecodeStep

if TYPE_CHECKING:
    from tgi_paged_backend.runner.parallel.process_group import TensorParallelGroup


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

    group: TensorParallelGroup | None = None
    """The tensor-parallel process group (set by :class:`~.parallel.tp_runner.TensorParallelRunner`)."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device | str = "cpu",
        *,
        rewrites: Sequence[ModelRewrite] | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_config = model_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size

        loaded = self._load_model(model_config)
        self.adapters: tuple[LoraAdapter, ...] = self._read_adapters(loaded)
        """``LORA_ADAPTERS``, read and checked against the unsharded model."""
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.generation_config = loaded.generation_config
        self.eos_token_ids: tuple[int, ...] = loaded.eos_token_ids
        self.dtype = loaded.dtype
        self.image_encoder = loaded.image_encoder
        """A vision-language model's image encoder (``vision.llava_next_encoder``), else ``None``."""
        full_spec = ModelSpec.from_hf_config(self.model.config, self.dtype)
        self.kv_dtype = resolve_kv_dtype(cache_config.kv_cache_dtype, self.dtype)
        context = RewriteContext(
            model_config=model_config, device=self.device, dtype=self.dtype, kv_dtype=self.kv_dtype,
            block_size=self.block_size, spec=full_spec, adapters=self.adapters, tp_group=self.group,
        )  # fmt: skip
        self.rewrites: AppliedRewrites = run_rewrites(
            self.model, context, model_rewrites() if rewrites is None else rewrites
        )
        self.spec = self._serving_spec(full_spec)
        """The sizes this runner's pool holds (the local heads under tensor parallelism)."""
        groups = self.spec.kv_groups
        self.kv_groups: LayerGroups = (
            LayerGroups.uniform(self.spec.num_layers) if groups.is_hybrid and not cache_config.layer_groups else groups
        )
        """The KV layer groups the engine pages by (one page map per group; one group of every layer, with the
        window when every layer has it, unless full and sliding layers mix): ``allocate_kv_cache(n,
        grouped=True)`` lays the pool out for them, a block holding ``layers_per_block`` layers."""
        self.medusa: MedusaHeads | None = load_medusa_for(self.model, model_config, self.device, self.dtype)
        if self.medusa is not None:
            self.static_decode_supported = False  # the heads read lm_head's input, which a graph does not hand out
        if has_alibi_attention(self.model):
            self.static_decode_supported = False  # ALiBi modules read the step from a hook: not traced or captured yet
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.pool = KVPool(self.spec, self.block_size, self.kv_dtype, self.device)

        self.weights_bytes = resident_bytes(self.model) + (self.medusa.num_bytes if self.medusa is not None else 0)
        self.activation_peak_bytes: int | None = None
        """Set by :meth:`profile_prefill`; used by :meth:`available_kv_bytes`."""
        self.graph_bytes = 0
        """Device bytes of the decode CUDA graphs (:meth:`profile_decode_graphs`), kept out of the KV pool."""
        self.static_decode: StaticDecodeStep | None = None
        """The static decode step decode batches run through when it holds them (:meth:`prepare_static_decode`)."""
        self.direct_decode: DirectDecode | None = None
        """Decode steps of a stacked model without its forward (:mod:`.native.direct`), when its modules are laid out
        for them; they serve once proven at Warmup (``enabled``; ``kept`` says why not)."""

    def _load_model(self, model_config: ModelConfig) -> LoadedModel:
        """Load the model onto ``self.device`` (the tensor-parallel runner loads on the CPU; its ``tp_slice``
        rewrite moves the shard)."""
        return load_model(model_config, self.device)

    def _serving_spec(self, full_spec: ModelSpec) -> ModelSpec:
        """The sizes of what this runner holds (all of the model here; the tensor-parallel runner its shard)."""
        return full_spec

    def _read_adapters(self, loaded: LoadedModel) -> tuple[LoraAdapter, ...]:
        """The ``LORA_ADAPTERS`` checkpoints, checked against ``loaded`` (unsharded)."""
        sources = parse_lora_adapters(self.model_config.lora_adapters)
        if not sources:
            return ()
        keep_bf16 = self.device.type == "cpu"  # bf16 adapter files of an fp32 model stay bf16 (the tiles widen them)
        return load_adapters(sources, loaded.model, loaded.dtype, self.model_config.max_lora_rank, keep_bf16)

    # What the load-time rewrites did (``None`` when one did not run).
    @property
    def lora(self) -> LoraModel | None:
        return self.rewrites.get("lora")

    @property
    def fusion(self) -> FusionReport | None:
        return self.rewrites.get("fuse")

    @property
    def native_layers(self) -> NativeLayersReport | None:
        return self.rewrites.get("native")

    @property
    def fast_layers(self) -> SwapReport | None:
        return self.rewrites.get("pack")

    @staticmethod
    def greedy_pick(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's first maximum and its log-probability in one native pass over CPU fp32 logits, or ``None``
        (other logits, or no native kernels: the sampler runs torch's argmax and ``log_softmax``)."""
        return tgi_paged_kernels.greedy_pick(scores) if scores.is_cpu else None

    def propose_medusa(self, rows: Sequence[int], k: int) -> list[list[int]]:
        """The Medusa heads' proposals (up to ``k`` tokens) at logits rows ``rows`` of the last forward."""
        assert self.medusa is not None
        return self.medusa.propose(rows, k)

    @property
    def lora_bytes(self) -> int:
        """Bytes of the LoRA adapters' weights held by this runner (part of :attr:`weights_bytes`)."""
        return 0 if self.lora is None else self.lora.num_bytes

    # ------------------------------------------------------------------ memory
    # The pool is :class:`KVPool`'s; these are the engine's handles on it.
    @property
    def block_bytes(self) -> int:
        """Bytes of one physical block of the current pool layout (K and V, all its layers) in the pool's dtype."""
        return self.pool.block_bytes

    def block_bytes_for(self, groups: LayerGroups) -> int:
        """Bytes of one block of a pool laid out for ``groups`` (``layers_per_block`` layers' K and V)."""
        return self.pool.block_bytes_for(groups)

    @property
    def pool_groups(self) -> LayerGroups:
        """The groups the current pool is laid out for (one group of every layer unless allocated grouped)."""
        return self.pool.groups

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool (0 before :meth:`allocate_kv_cache`)."""
        return self.pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of swap space (0 before :meth:`allocate_swap_space`)."""
        return self.pool.num_cpu_blocks

    @property
    def k_caches(self) -> list[torch.Tensor]:
        return self.pool.k_caches

    @property
    def v_caches(self) -> list[torch.Tensor]:
        return self.pool.v_caches

    def allocate_kv_cache(self, num_blocks: int, *, grouped: bool = False) -> None:
        """Allocate (or replace) the pool: per layer K and V of ``[num_blocks, block_size, Hkv, D]``.

        ``grouped``: laid out for :attr:`kv_groups` (their ``layers_per_block`` slot tensors, each layer's
        ``k_caches`` entry a view of its slot's): every forward then needs the groups' block tables.
        """
        self.static_decode = None  # its graphs hold the old pool's addresses
        self.pool.allocate(num_blocks, self.kv_groups if grouped else LayerGroups.uniform(self.spec.num_layers))

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """Allocate (or replace) the CPU swap space; pinned when the device is CUDA. 0 frees it."""
        self.pool.allocate_swap(num_cpu_blocks)

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
        static = batch.is_decode and batch.lora_slots is None and not batch.image_rows and batch.rope_positions is None
        if self.static_decode is not None and static:
            logits = self.static_decode.run(batch.to(self.device))
            if logits is not None:
                return logits
        return self._forward(batch, self.k_caches, self.v_caches)

    def _forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        batch = batch.to(self.device)
        metadata = PagedAttentionMetadata(
            batch, k_caches, v_caches, self.k_scale, self.v_scale,
            cpu_decode=self.model_config.cpu_decode,
            layer_groups=self.pool.layer_group if batch.group_block_tables else None,
        )  # fmt: skip
        routing = self.lora.step.open(batch.lora_slots) if self.lora is not None else contextlib.nullcontext()
        with torch.inference_mode(), routing:
            logits = None if self.direct_decode is None else self.direct_decode.run(batch, metadata)
            if logits is not None:
                return logits
            out = self.model(
                **model_inputs(self.model, batch),
                position_ids=batch.positions.unsqueeze(0)
                if batch.rope_positions is None
                else batch.rope_positions.unsqueeze(1),
                attention_mask=mask_placeholder(self.device, self.dtype),
                use_cache=False,
                logits_to_keep=batch.logits_indices,
                return_dict=True,
                **{METADATA_KWARG: metadata},
            )
        return out.logits[0].float()

    def warm_decode(self) -> float:
        """Run one dummy decode step so its one-time costs (the CPU decode kernel's compilation, oneDNN's
        primitive caches) are paid at Warmup, not by the first request; first prove the native layers' stacks
        (:func:`~.native.stack.prove_stack`). Returns the seconds it took.

        Three requests of ``block_size + 1`` tokens (sizes that differ, so no duck-sized guard of the
        compiled kernel ties them), every block the scratch block 0 (never handed out), so no pool block
        another request could own is written.
        """
        if not self.k_caches:
            raise RuntimeError("allocate_kv_cache() must be called before warm_decode()")
        chunks = [RequestChunk(token_ids=[0], num_computed=self.block_size, block_table=[0, 0]) for _ in range(3)]
        start = time.perf_counter()
        slots = (0, -1, 0) if self.lora is not None else (-1, -1, -1)  # adapter rows beside base rows
        stacks = self.native_layers.stacks if self.native_layers is not None else ()
        self.direct_decode = None  # a re-warm proves the stack against the model's loop, not an earlier direct step
        for stack in stacks:  # before any step uses it
            prove_stack(
                stack, self._forward, self.k_caches, self.v_caches, self.block_size, slots, self.pool_groups.num_groups
            )
        direct = direct_decode(self.model, stacks[0]) if len(stacks) == 1 else "not one stack of layers"
        self.direct_decode = direct if isinstance(direct, DirectDecode) else None  # the proof's step runs through it
        if self.direct_decode is not None:
            prove_direct(
                self.direct_decode, self._forward, self.k_caches, self.v_caches, self.block_size, slots,
                self.pool_groups.num_groups,
            )  # fmt: skip
        elif stacks:
            logger.info("native direct decode: the model's forward serves: {}", direct)
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

    def profile_decode_graphs(self, max_seq_len: int) -> int:
        """Device bytes the decode CUDA graphs will take (0 off CUDA or without ``CUDA_GRAPHS``), measured
        by capturing them against a temporary pool before the real one is sized; stored in
        :attr:`graph_bytes`, which :meth:`available_kv_bytes` leaves out. A failed capture turns graphs off."""
        self.graph_bytes, failed = static_setup.decode_graph_bytes(self, max_seq_len)
        if failed:
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
        on CPU with ``TGI_PAGED_COMPILE``, compile one graph for :data:`.decode_step.CPU_COMPILE_BUCKETS`; otherwise
        nothing, and decode stays eager. ``mode`` ``"graphs"``, ``"compile"`` (``torch.compile``
        with ``compile_options``, e.g. ``backend``) or ``"eager"`` with ``buckets`` (default: the
        ``CUDA_GRAPHS`` ones) choose explicitly (tests, benchmarks); ``fixed_width`` (default: only for
        graphs) as :class:`~runner.static.decode_step.StaticDecodeStep` takes it. A failed capture or compile is
        logged and leaves decode eager (:meth:`.StaticDecodeStep.prepare`).
        """
        self.static_decode = None
        if not self.k_caches:
            raise RuntimeError("allocate_kv_cache() must be called before prepare_static_decode()")
        self.static_decode = static_setup.prepared_static_decode(
            self, max_seq_len, mode, buckets, fixed_width, compile_options
        )

    # ------------------------------------------------------------ block moves
    def copy_blocks(self, src: BlockIds, dst: BlockIds) -> None:
        """Copy pool blocks ``src[i] -> dst[i]`` in every layer (copy-on-write)."""
        self.pool.copy_blocks(src, dst)

    def swap_out(self, device_ids: BlockIds, cpu_ids: BlockIds) -> None:
        """Copy pool blocks ``device_ids[i]`` to swap blocks ``cpu_ids[i]``."""
        self.pool.swap_out(device_ids, cpu_ids)

    def swap_in(self, cpu_ids: BlockIds, device_ids: BlockIds) -> None:
        """Copy swap blocks ``cpu_ids[i]`` back to pool blocks ``device_ids[i]``."""
        self.pool.swap_in(cpu_ids, device_ids)

    # --------------------------------------------------------------- profiling
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
            chunks, nblocks = dummy_prefill_chunks(num_tokens, self.block_size, self.spec.max_position_embeddings)
            batch = build_forward_batch(chunks, self.block_size)
            if num_logits > len(chunks):  # prompt logprobs: logits for the last num_logits tokens
                indices = torch.arange(num_tokens - min(num_logits, num_tokens), num_tokens, dtype=torch.int64)
                batch = dataclasses.replace(batch, logits_indices=indices)
            k_tmp, v_tmp = self.pool.new_caches(nblocks, self.spec.num_layers)
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
