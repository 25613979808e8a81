"""Capacity planner: how much KV fits, how many requests run at once, and which overcommit to set.

Inputs: a model config (a local model directory, or a preset of public architecture numbers), a
device (a GPU name from :data:`GPUS`, ``--memory-gb``, or ``cpu``), the memory fraction, block size,
KV dtype, and a trace (a JSONL file or the :mod:`~tgi_paged_backend.planning.workload` generator).

The arithmetic is the shard's own, so the plan agrees with a real shard:

- bytes per token / block: :meth:`ModelSpec.kv_bytes_per_block` (what ``ModelRunner.block_bytes`` is);
  models mixing sliding-window and full-attention layers (Gemma 2/3, gpt-oss, Cohere 2) are paged by KV
  layer group (``ModelSpec.kv_groups``, unless ``TGI_PAGED_LAYER_GROUPS=0``), a block holding one group's
  ``layers_per_block`` layers, as ``ModelRunner.block_bytes_for(kv_groups)``;
- KV budget: ``memory_fraction x device total - weights - activation peak`` on CUDA (what
  ``ModelRunner.available_kv_bytes`` computes before its "actually free" cap), and on CPU
  ``min(memory_fraction x available RAM - activations, 4 GiB)``; weights from the safetensors
  headers (exact) or from the config (estimate); the activation peak from the runner's own CPU
  estimate (on CUDA the shard measures it, usually a little lower);
- pool and advertised budget: :func:`tgi_paged_backend.engine.capacity.plan_capacity` (with the groups,
  so the budget gains what the sliding groups no longer hold).

Expected concurrency and waste come from :func:`~tgi_paged_backend.planning.allocator_sim.compare`
on that pool (so the planner agrees with the simulator by construction), with a roofline step-time
model of the device; the advised overcommit is
:func:`~tgi_paged_backend.planning.allocator_sim.advise_overcommit` over a sweep.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tgi_paged_backend.config import PreemptionMode
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.planning.allocator_sim import (
    DEFAULT_OVERCOMMITS,
    THROUGHPUT_TOLERANCE,
    WASTE_TOLERANCE,
    Comparison,
    SimConfig,
    StepCostModel,
    compare,
)
from tgi_paged_backend.planning.param_counts import param_counts
from tgi_paged_backend.planning.weights import weight_bytes
from tgi_paged_backend.planning.workload import TraceRequest, summarize

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class Device:
    """Memory and rough roofline numbers of one device (vendor figures; dense 16-bit tensor FLOPs)."""

    name: str
    memory_gib: float
    mem_gb_per_s: float
    tflops: float
    swap_gb_per_s: float
    """Host <-> device copy bandwidth for swapping (PCIe)."""


GPUS: dict[str, Device] = {
    "A10G": Device("A10G", 24, 600, 70, 12),
    "L4": Device("L4", 24, 300, 121, 12),
    "A100-40": Device("A100-40", 40, 1555, 312, 25),
    "A100-80": Device("A100-80", 80, 2039, 312, 25),
    "H100": Device("H100", 80, 3350, 989, 50),
    "H200": Device("H200", 141, 4800, 989, 50),
}
"""Nominal memory (torch reports a little less), memory bandwidth, dense 16-bit TFLOPs, PCIe copy rate."""
CPU_DEVICE = Device("cpu", 0, 20, 0.1, 10)
"""CPU: memory is the available RAM (read at plan time); the roofline numbers are rough."""
MEM_EFFICIENCY, FLOP_EFFICIENCY, STEP_OVERHEAD_S = 0.8, 0.5, 0.005

PRESETS: dict[str, dict[str, Any]] = {
    # Public architecture numbers (config.json fields) of a few common models.
    "llama-3-8b": dict(
        model_type="llama",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3-70b": dict(
        model_type="llama",
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=32768,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    "gpt-oss-120b": dict(
        # Sized in the serving dtype: the published checkpoint's MXFP4 experts are not counted as MXFP4.
        model_type="gpt_oss",
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=128,
        experts_per_token=4,
        attention_bias=True,
        vocab_size=201088,
        max_position_embeddings=131072,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18,
        tie_word_embeddings=False,
    ),
    "gemma-2-9b": dict(
        # Its config.json lists no layer_types: transformers alternates sliding (4096) and full layers.
        model_type="gemma2",
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        hidden_size=3584,
        intermediate_size=14336,
        vocab_size=256000,
        max_position_embeddings=8192,
        sliding_window=4096,
        layer_types=["sliding_attention", "full_attention"] * 21,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49152,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the planner knows about the model."""

    name: str
    spec: Any
    """A :class:`~tgi_paged_backend.runner.model.spec.ModelSpec`."""
    num_params: int
    params_exact: bool
    """``True`` when counted from safetensors headers, ``False`` when estimated from the config."""
    tie_word_embeddings: bool
    config: dict[str, Any] = field(default_factory=dict)
    """The ``config.json`` fields (text config merged) the sizes came from."""


def _read_config(model: str) -> tuple[str, dict[str, Any]]:
    if model in PRESETS:
        return model, dict(PRESETS[model])
    path = Path(model)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(
            f"--model {model!r}: not a preset ({', '.join(PRESETS)}) nor a model directory with config.json"
        )
    raw = json.loads(config_file.read_text())
    text = raw.pop("text_config", None)  # a multimodal config: its text model's fields win (ModelSpec reads them)
    return str(path), _with_layer_types({**raw, **text} if isinstance(text, dict) else raw)


def _with_layer_types(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the per-layer ``layer_types`` transformers derives when a windowed config lists none.

    Gemma 2 and 3 and Cohere 2 checkpoints often predate ``layer_types`` (Gemma 3: ``sliding_window_pattern``);
    the shard reads the list transformers' config class fills in (``ModelSpec.layer_windows``), so the
    planner asks the same class. Left as is when the list is there, no window is set, or transformers does
    not know the model type.
    """
    if cfg.get("layer_types") is not None or not cfg.get("sliding_window") or "model_type" not in cfg:
        return cfg
    import transformers

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "text_config", "vision_config")}
    try:
        layer_types = getattr(transformers.AutoConfig.for_model(str(cfg["model_type"]), **fields), "layer_types", None)
    except (ValueError, TypeError, KeyError):  # an unknown model type, or fields its class refuses
        return cfg
    return cfg if layer_types is None else {**cfg, "layer_types": list(layer_types)}


def count_safetensors_params(model_dir: str | Path) -> int | None:
    """Parameters listed in the safetensors headers of ``model_dir`` (``None`` without files)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in entry["shape"]:
                n *= int(dim)
            total += n
    return total


def estimate_params(cfg: dict[str, Any]) -> int:
    """Parameters from config fields (attention, dense or MoE MLP, norms, embeddings):
    :func:`~tgi_paged_backend.planning.param_counts.param_counts` on one shard."""
    return param_counts(cfg).held


def load_model_facts(model: str, dtype: Any) -> ModelFacts:
    """Model sizes from a preset name or a local directory (``dtype``: the serving torch dtype)."""
    from tgi_paged_backend.runner.model.spec import ModelSpec

    name, cfg = _read_config(model)
    spec = ModelSpec.from_hf_config(SimpleNamespace(**cfg), dtype)
    counted = None if model in PRESETS else count_safetensors_params(model)
    num_params = counted if counted is not None else estimate_params(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    return ModelFacts(name, spec, int(num_params), counted is not None, tied, cfg)


def activation_peak_bytes(spec: Any, dtype: Any, num_tokens: int) -> int:
    """The runner's CPU activation estimate for a prefill of ``num_tokens`` (one logits row).

    The runner's own formula (:func:`~tgi_paged_backend.runner.memory_budget.estimate_prefill_bytes`), so
    the planner cannot drift from the shard.
    """
    from tgi_paged_backend.runner.memory_budget import estimate_prefill_bytes

    return estimate_prefill_bytes(spec, dtype, num_tokens, 1)


def cpu_available_bytes() -> int:
    """Available RAM now, as the runner reads it."""
    from tgi_paged_backend.runner.memory_budget import cpu_available_bytes as runner_available_bytes

    return runner_available_bytes()


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    model: str
    device: str = "A10G"
    """A name of :data:`GPUS`, or ``cpu``."""
    memory_gib: float | None = None
    """Overrides the device's memory (GiB)."""
    memory_fraction: float = 0.90
    block_size: int = 16
    dtype: str | None = None
    """``float16``, ``bfloat16`` or ``float32``; default float16 on a GPU, float32 on CPU (as the shard)."""
    kv_cache_dtype: str = "auto"
    max_prefill_tokens: int = 4096
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    num_blocks_cap: int | None = None
    swap_space_gib: float = 4.0
    preemption: PreemptionMode = "auto"
    overcommits: Sequence[float] = DEFAULT_OVERCOMMITS
    quantize: str | None = None
    """``--quantize`` (``fp8``, ``compressed-tensors``, ``gptq``, ``awq``): weights as
    :mod:`~tgi_paged_backend.planning.weights` sizes them."""
    int_layout: Any = None
    """:class:`~tgi_paged_backend.planning.weights.IntLayout` (bits, group size) of an int checkpoint."""
    kv_budget_bytes: int | None = None
    """Skip the memory arithmetic and use this KV budget (what the shard's runner would report)."""
    num_shard: int = 1
    """``--num-shard``: the plan is one rank's (its weights, its KV heads, its pool; every rank alike)."""
    layer_groups: bool = True
    """``TGI_PAGED_LAYER_GROUPS``: page models mixing sliding and full layers by KV layer group (off: one
    page map for all layers, as the shard with ``0``)."""


@dataclass(slots=True)
class Plan:
    inputs: PlanInputs
    device: Device
    facts: ModelFacts
    rank_spec: Any
    """The sizes one rank serves (:func:`shard_spec`; ``facts.spec`` at ``--num-shard 1``)."""
    dtype_name: str
    kv_dtype_name: str
    device_bytes: int
    weights_bytes: int
    """What one rank holds (the whole model at ``--num-shard 1``)."""
    weights_bytes_total: int
    activation_bytes: int
    kv_budget_bytes: int
    bytes_per_token: int
    block_bytes: int
    """Bytes of one pool block: all layers' K/V, or one KV layer group's ``layers_per_block`` layers'."""
    capacity: Any
    """:class:`~tgi_paged_backend.engine.capacity.Capacity` at the advised overcommit."""
    trace_summary: dict[str, float]
    comparison: Comparison
    sim_config: SimConfig
    kv_groups: LayerGroups | None = None
    """The KV layer groups the shard pages by (``ModelRunner.kv_groups``); ``None`` when the planner was
    built without them."""
    notes: list[str] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return self.capacity.num_blocks

    @property
    def physical_tokens(self) -> int:
        return self.capacity.physical_tokens

    @property
    def advised_overcommit(self) -> float:
        return self.comparison.chosen_overcommit

    @property
    def groups(self) -> LayerGroups:
        """The KV layer groups of the pool (one group of every layer for a uniform model)."""
        return self.kv_groups or LayerGroups.uniform(self.rank_spec.num_layers, self.rank_spec.reclaim_window)

    def group_request_blocks(self) -> list[int]:
        """Per group, the blocks one ``max_total_tokens`` request holds at most (prefilled in chunks of
        ``max_prefill_tokens``): :meth:`LayerGroups.request_blocks` split by group."""
        from tgi_paged_backend.memory.window_reclaim import max_request_blocks

        c, bs = self.capacity, self.inputs.block_size
        return [max_request_blocks(c.max_total_tokens, bs, w, c.max_prefill_tokens) for w in self.groups.windows]

    def group_final_blocks(self) -> list[int]:
        """Per group, the blocks one ``max_total_tokens`` request holds at its end
        (:meth:`LayerGroups.final_blocks`; what the budget gain counts)."""
        return list(self.groups.final_blocks(self.capacity.max_total_tokens, self.inputs.block_size))

    def groups_dict(self) -> dict[str, Any]:
        """The groups in the JSON: windows (``None``: full), layers, per-group request blocks vs one page map."""
        g, c = self.groups, self.capacity
        return {
            "num_groups": g.num_groups,
            "layers_per_block": g.layers_per_block,
            "num_padding": g.num_padding,
            "windows": list(g.windows),
            "layers": [list(layers) for layers in g.layers],
            "budget_gain": c.budget_gain,
            "max_total_tokens": c.max_total_tokens,
            "request_blocks": self.group_request_blocks(),
            "final_blocks": self.group_final_blocks(),
            "request_blocks_one_page_map": -(-c.max_total_tokens // self.inputs.block_size),
        }

    def to_dict(self) -> dict[str, Any]:
        s = self.rank_spec
        return {
            "model": self.facts.name,
            "device": self.device.name,
            "num_shard": self.inputs.num_shard,
            "dtype": self.dtype_name,
            "kv_dtype": self.kv_dtype_name,
            "memory_fraction": self.inputs.memory_fraction,
            "device_bytes": self.device_bytes,
            "weights_bytes": self.weights_bytes,
            "weights_bytes_total": self.weights_bytes_total,
            "params": self.facts.num_params,
            "params_exact": self.facts.params_exact,
            "activation_bytes": self.activation_bytes,
            "kv_budget_bytes": self.kv_budget_bytes,
            "layers": s.num_layers,
            "kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "bytes_per_token": self.bytes_per_token,
            "block_size": self.inputs.block_size,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "physical_tokens": self.physical_tokens,
            "max_total_tokens": self.capacity.max_total_tokens,
            "max_supported_total_tokens": self.capacity.max_supported_total_tokens,
            "budget_gain": self.capacity.budget_gain,
            "kv_groups": self.groups_dict(),
            "trace": self.trace_summary,
            "simulation": self.comparison.to_dict(),
            "advised_overcommit": self.advised_overcommit,
            "notes": self.notes,
        }


def _device(inputs: PlanInputs) -> Device:
    if inputs.device.lower() == "cpu":
        return CPU_DEVICE
    key = {k.lower(): k for k in GPUS}.get(inputs.device.lower())
    if key is None:
        raise ValueError(f"--gpu {inputs.device!r} is unknown: allowed {', '.join(GPUS)}, cpu (or give --memory-gb)")
    return GPUS[key]


def cost_model(
    device: Device, weights_bytes: int, bytes_per_token: int, num_params: int, groups: LayerGroups | None = None
) -> StepCostModel:
    """Roofline step time on ``device``: weights + attended KV over bandwidth vs 2 FLOPs per multiplied
    parameter per token (``num_params``: those one token's forward multiplies on this rank; MoE: routed experts
    only). The attended KV of a sliding-window layer (``groups``' windows) is at most its window. The weights
    term reads every held weight each step (an upper bound for MoE at small batches); the all-reduces of
    tensor parallelism are not modelled."""
    windows: dict[int | None, int] = {}
    for window, layers in zip(groups.windows, groups.layers, strict=True) if groups is not None else ():
        windows[window] = windows.get(window, 0) + len(layers)
    num_layers = sum(windows.values())
    return StepCostModel(
        kv_windows=tuple((w, n / num_layers) for w, n in windows.items()) if any(windows) else (),
        fixed_s=STEP_OVERHEAD_S,
        weights_bytes=weights_bytes,
        kv_bytes_per_token=bytes_per_token,
        flops_per_token=2.0 * num_params,
        mem_bytes_per_s=device.mem_gb_per_s * 1e9 * MEM_EFFICIENCY,
        flops_per_s=device.tflops * 1e12 * FLOP_EFFICIENCY,
        swap_bytes_per_s=device.swap_gb_per_s * 1e9,
    )


def make_plan(inputs: PlanInputs, trace: Sequence[TraceRequest]) -> Plan:
    """Size the pool, simulate the trace on it, advise an overcommit."""
    import torch

    from tgi_paged_backend.config import CacheConfig
    from tgi_paged_backend.engine.capacity import plan_capacity
    from tgi_paged_backend.runner.model.loader import resolve_dtype
    from tgi_paged_backend.runner.model.spec import resolve_kv_dtype

    CacheConfig(
        block_size=inputs.block_size, memory_fraction=inputs.memory_fraction, kv_cache_dtype=inputs.kv_cache_dtype
    )  # validates the knobs with the shard's messages
    device = _device(inputs)
    on_cpu = device is CPU_DEVICE
    dtype = resolve_dtype(inputs.dtype, torch.device("cpu" if on_cpu else "cuda"))
    kv_dtype = resolve_kv_dtype(inputs.kv_cache_dtype, dtype)
    facts = load_model_facts(inputs.model, dtype)
    spec = shard_spec(facts.spec, inputs.num_shard)
    groups = kv_groups(facts.spec, inputs.layer_groups)  # the unsharded config's: every rank alike
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights_total = weight_bytes(facts.spec, facts.num_params, itemsize, inputs.quantize, inputs.int_layout)
    whole, rank = param_counts(facts.config), param_counts(facts.config, inputs.num_shard)
    weights = weights_total * rank.held // whole.held  # exact unquantized; quantized: scaled by held parameters
    bytes_per_token = spec.kv_bytes_per_token(kv_dtype)
    block_bytes = group_block_bytes(spec, groups, inputs.block_size, kv_dtype)
    activation = activation_peak_bytes(spec, dtype, max(inputs.max_prefill_tokens, 1))
    notes: list[str] = []
    if not facts.params_exact:
        notes.append("weights estimated from the config (no safetensors files read)")
    if inputs.num_shard > 1:
        notes.append(
            f"--num-shard {inputs.num_shard}: one rank's weights, KV heads and pool (every rank alike); heads, MLP "
            "and experts split, embeddings/lm_head/norms/routers whole on every rank (docs/tensor-parallel.md)"
        )
    if inputs.kv_budget_bytes is not None:
        device_bytes, budget = 0, int(inputs.kv_budget_bytes)
        notes.append("KV budget given explicitly")
    elif on_cpu:
        from tgi_paged_backend.runner.memory_budget import cpu_kv_budget

        device_bytes = int(inputs.memory_gib * GiB) if inputs.memory_gib else cpu_available_bytes()
        budget = cpu_kv_budget(inputs.memory_fraction, device_bytes, activation)
        notes.append("CPU: budget = min(fraction x available RAM - activations, 4 GiB), as the CPU runner")
    else:
        device_bytes = int((inputs.memory_gib or device.memory_gib) * GiB)
        budget = max(0, int(inputs.memory_fraction * device_bytes - weights - activation))
        if budget == 0:
            raise ValueError(
                f"weights {weights / GiB:.1f} GiB{' per rank' if inputs.num_shard > 1 else ''} + activations "
                f"{activation / GiB:.1f} GiB leave no KV memory on {device.name} ({device_bytes / GiB:.0f} GiB x "
                f"{inputs.memory_fraction:g}): use more shards (--num-shard), a larger device or --quantize"
            )
        notes.append("CUDA: the shard measures activations at Warmup and caps the budget by free memory")
    if facts.spec.kv_groups.is_hybrid and not inputs.layer_groups:
        notes.append("TGI_PAGED_LAYER_GROUPS=0: one page map for all layers, the sliding layers keep every block")

    def capacity(overcommit: float) -> Any:
        return plan_capacity(
            available_kv_bytes=budget,
            block_bytes=block_bytes,
            block_size=inputs.block_size,
            num_blocks_cap=inputs.num_blocks_cap,
            overcommit=overcommit,
            max_position_embeddings=spec.max_position_embeddings,
            max_input_tokens=inputs.max_input_tokens,
            max_total_tokens=inputs.max_total_tokens,
            max_prefill_tokens=inputs.max_prefill_tokens,
            groups=groups,
        )

    base = capacity(1.0)  # raises ConfigError with the shard's message when nothing fits
    sim_cfg = SimConfig(
        num_blocks=base.num_blocks,
        block_size=inputs.block_size,
        max_prefill_tokens=base.max_prefill_tokens,
        preemption=inputs.preemption,
        num_swap_blocks=int(inputs.swap_space_gib * GiB) // block_bytes if block_bytes else 0,
        block_bytes=block_bytes,
        reclaim_window=groups.windows[0] if groups.num_groups == 1 else None,
        groups=groups.windows if groups.num_groups > 1 else None,
        budget_gain=base.budget_gain,
        cost=cost_model(device, weights, bytes_per_token, rank.active, facts.spec.kv_groups),  # what attention reads
    )
    comparison = compare(trace, sim_cfg, inputs.overcommits)
    return Plan(
        inputs=inputs,
        device=device,
        facts=facts,
        rank_spec=spec,
        dtype_name=str(dtype).removeprefix("torch."),
        kv_dtype_name=str(kv_dtype).removeprefix("torch."),
        device_bytes=device_bytes,
        weights_bytes=weights,
        weights_bytes_total=weights_total,
        activation_bytes=activation,
        kv_budget_bytes=budget,
        bytes_per_token=bytes_per_token,
        block_bytes=block_bytes,
        capacity=capacity(comparison.chosen_overcommit),
        trace_summary=summarize(trace),
        comparison=comparison,
        sim_config=sim_cfg,
        kv_groups=groups,
        notes=notes,
    )


def kv_groups(spec: Any, layer_groups: bool = True) -> LayerGroups:
    """The KV layer groups the shard pages ``spec``'s model by (``ModelRunner.kv_groups``): the model's
    groups, or one group of every layer when full and sliding layers mix and ``layer_groups`` is off."""
    groups: LayerGroups = spec.kv_groups
    return LayerGroups.uniform(spec.num_layers) if groups.is_hybrid and not layer_groups else groups


def group_block_bytes(spec: Any, groups: LayerGroups, block_size: int, kv_dtype: Any) -> int:
    """Bytes of one block of a pool laid out for ``groups`` (``ModelRunner.block_bytes_for``): the K/V of
    ``layers_per_block`` layers."""
    return int(spec.kv_bytes_per_block(block_size, kv_dtype)) // spec.num_layers * groups.layers_per_block


def shard_spec(spec: Any, num_shard: int) -> Any:
    """The sizes one rank of ``--num-shard`` serves (raises the shard's divisibility error)."""
    from tgi_paged_backend.runner.parallel.slicing import ShardLayout, check_divisible, local_spec

    if num_shard < 1:
        raise ValueError(f"--num-shard {num_shard} is invalid: at least 1")
    if num_shard == 1:
        return spec
    try:
        check_divisible(spec, num_shard)
    except RuntimeError as err:  # ModelLoadError: the shard's own message
        raise ValueError(str(err)) from None
    layout = ShardLayout(
        rank=0,
        world_size=num_shard,
        num_q_heads=spec.num_q_heads // num_shard,
        num_kv_heads=max(spec.num_kv_heads // num_shard, 1),
        intermediate_size=spec.intermediate_size // num_shard,
        num_layers=spec.num_layers,
    )
    return local_spec(spec, layout)


def format_plan(plan: Plan) -> str:
    """The planner's printed report."""
    from tgi_paged_backend.planning.report import comparison_table, fmt_bytes, overcommit_table

    s, t = plan.facts.spec, plan.trace_summary
    lines = [
        f"model        {plan.facts.name}: {s.model_type}, {s.num_layers} layers, {s.num_kv_heads} KV heads x "
        f"{s.head_dim}, {plan.facts.num_params / 1e9:.3f} B params "
        f"({'counted' if plan.facts.params_exact else 'estimated'}), weights {fmt_bytes(plan.weights_bytes)} "
        + (
            f"per rank of {plan.inputs.num_shard} ({fmt_bytes(plan.weights_bytes_total)} in all) "
            if plan.inputs.num_shard > 1
            else ""
        )
        + f"({plan.dtype_name}{f', --quantize {plan.inputs.quantize}' if plan.inputs.quantize else ''})",
        f"device       {plan.device.name}"
        + (f", {fmt_bytes(plan.device_bytes)} x {plan.inputs.memory_fraction:g}" if plan.device_bytes else "")
        + f"; activation peak (prefill {plan.capacity.max_prefill_tokens} tokens) {fmt_bytes(plan.activation_bytes)}",
        f"KV           {plan.bytes_per_token:,} bytes per token"
        + (f" per rank ({plan.rank_spec.num_kv_heads} KV heads each)" if plan.inputs.num_shard > 1 else "")
        + f" ({plan.kv_dtype_name}); block of {plan.inputs.block_size} tokens"
        + (f" of one group's {plan.groups.layers_per_block} layers" if plan.groups.num_groups > 1 else "")
        + f" = {fmt_bytes(plan.block_bytes)}; budget {fmt_bytes(plan.kv_budget_bytes)}",
        f"pool         {plan.num_blocks:,} physical blocks (incl. scratch) = {plan.physical_tokens:,} tokens "
        f"that fit{' (every group keeping every block)' if plan.groups.num_groups > 1 else ''}; max_total_tokens "
        f"{plan.capacity.max_total_tokens:,}",
        *group_lines(plan),
        f"trace        {t['requests']} requests, prompt mean {t['prompt_mean']:.0f} (max {t['prompt_max']}), "
        f"output mean {t['output_mean']:.0f} (max {t['output_max']}), max_new_tokens mean "
        f"{t['max_new_tokens_mean']:.0f}, arrivals over {t['duration_s']:.1f} s",
        f"bounds       stock TGI admits at most {plan.physical_tokens / t['reserved_mean']:.1f} mean reservations; "
        f"finished requests average {t['prompt_mean'] + t['output_mean']:.0f} tokens",
        "",
        comparison_table(plan.comparison, time_unit="s"),
        "",
        overcommit_table(plan.comparison),
        "",
        f"advice       TGI_PAGED_OVERCOMMIT={plan.advised_overcommit:g}  (advertises "
        f"{plan.capacity.max_supported_total_tokens:,} tokens to the router): " + advice_reason(plan.comparison),
    ]
    lines += [f"note         {n}" for n in plan.notes]
    return "\n".join(lines)


def group_lines(plan: Plan) -> list[str]:
    """The KV layer groups' lines of :func:`format_plan` (none for one group)."""
    g, c = plan.groups, plan.capacity
    if g.num_groups == 1:
        return []
    held, final = plan.group_request_blocks(), plan.group_final_blocks()
    one_map = -(-c.max_total_tokens // plan.inputs.block_size)
    lines = [
        f"groups       {g.num_groups} KV layer groups, a block holds {g.layers_per_block} layers' K/V"
        + (f" ({g.num_padding} padding slots)" if g.num_padding else "")
        + f"; budget gain x{c.budget_gain:.2f}: a max_total_tokens ({c.max_total_tokens:,}) request holds "
        f"{sum(final):,} blocks at its end, {g.num_groups * one_map:,} with one page map for all layers"
    ]
    for i, (window, layers, peak, end) in enumerate(zip(g.windows, g.layers, held, final, strict=True)):
        kind = "full" if window is None else f"window {window}"
        at_peak = "" if peak == end else f", at most {peak:,} while a prefill chunk reads its window"
        lines.append(
            f"{f'group {i}':<13}{kind}, {len(layers)} layers: {end:,} blocks a request at its end{at_peak} "
            f"(one page map for all layers: {one_map:,})"
        )
    return lines


def advice_reason(c: Comparison) -> str:
    best = c.best
    top = max(c.paged.values(), key=lambda r: r.tokens_per_s)
    least = min(c.paged.values(), key=lambda r: r.waste_total)
    fallback = best.tokens_per_s < (1 - THROUGHPUT_TOLERANCE) * top.tokens_per_s
    return (
        f"{'no run met both tolerances, so the fastest within the waste one; rule: ' if fallback else ''}"
        f"the smallest overcommit within {100 * THROUGHPUT_TOLERANCE:g} % of the best simulated throughput "
        f"({best.tokens_per_s:,.0f} vs {top.tokens_per_s:,.0f} tok/s at {top.overcommit:g}) and "
        f"{100 * WASTE_TOLERANCE:g} point(s) of the lowest KV waste "
        f"({100 * best.waste_total:.1f} % vs {100 * least.waste_total:.1f} % at {least.overcommit:g}), recompute "
        f"tax {100 * best.recompute_tax:.1f} % ({best.preemptions_recompute} recompute / "
        f"{best.preemptions_swap} swap preemptions)"
    )


def plan_from_args(
    *,
    model: str,
    gpu: str,
    memory_gb: float | None,
    memory_fraction: float,
    block_size: int,
    dtype: str | None,
    kv_dtype: str,
    trace_path: str | None,
    workload: str,
    requests: int,
    arrival: str,
    rate: float | None,
    max_new_tokens: int | None,
    seed: int,
    max_prefill_tokens: int,
    num_blocks: int | None,
    kv_budget_bytes: int | None,
    overcommits: Sequence[float],
    quantize: str | None = None,
    bits: int | None = None,
    group_size: int | None = None,
    num_shard: int = 1,
    layer_groups: bool | None = None,
) -> Plan:
    """What ``tgi-paged-backend plan`` calls (``layer_groups``: ``None`` reads ``TGI_PAGED_LAYER_GROUPS`` as
    the shard does)."""
    from tgi_paged_backend.planning.weights import IntLayout
    from tgi_paged_backend.planning.workload import generate_trace, load_trace

    if layer_groups is None:
        import os

        from tgi_paged_backend.envs import read_env

        name = "TGI_PAGED_LAYER_GROUPS"  # parsed (and refused) with the shard's own rule
        layer_groups = read_env({name: os.environ[name]} if name in os.environ else {}).layer_groups
    int_layout = None
    if bits is not None or group_size is not None:
        int_layout = IntLayout(bits=bits or 4, group_size=group_size or 128)

    if trace_path:
        trace = load_trace(trace_path, default_max_new_tokens=max_new_tokens or 1024)
    else:
        trace = generate_trace(workload, requests, arrival=arrival, rate=rate, max_new_tokens=max_new_tokens, seed=seed)
    inputs = PlanInputs(
        model=model,
        device=gpu,
        memory_gib=memory_gb,
        memory_fraction=memory_fraction,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        max_prefill_tokens=max_prefill_tokens,
        num_blocks_cap=num_blocks,
        kv_budget_bytes=kv_budget_bytes,
        overcommits=tuple(overcommits),
        quantize=quantize,
        int_layout=int_layout,
        num_shard=num_shard,
        layer_groups=layer_groups,
    )
    return make_plan(inputs, trace)
