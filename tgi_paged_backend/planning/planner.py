"""Capacity planner: how much KV fits, how many requests run at once, and which overcommit to set.

Inputs: a model config (a local model directory, or a preset of public architecture numbers), a
device (a GPU name from :data:`~tgi_paged_backend.planning.presets.GPUS`, ``--memory-gb``, or ``cpu``), the
memory fraction, block size, KV dtype, and a trace (a JSONL file or the
:mod:`~tgi_paged_backend.planning.workload` generator).

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
:func:`~tgi_paged_backend.planning.sim_results.advise_overcommit` over a sweep.

The pieces: :mod:`~tgi_paged_backend.planning.presets` (GPUs, model presets),
:mod:`~tgi_paged_backend.planning.model_facts` (the model's sizes, per rank), :mod:`~tgi_paged_backend.planning.plan`
(the inputs and the result), :mod:`~tgi_paged_backend.planning.plan_report` (the printed plan); this module
does the arithmetic and runs the simulation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.planning.allocator_sim import compare
from tgi_paged_backend.planning.host_tier import estimate_host_tier
from tgi_paged_backend.planning.model_facts import (
    activation_peak_bytes,
    cpu_available_bytes,
    group_block_bytes,
    kv_groups,
    load_model_facts,
    shard_spec,
)
from tgi_paged_backend.planning.param_counts import param_counts
from tgi_paged_backend.planning.plan import Plan, PlanInputs
from tgi_paged_backend.planning.presets import (
    CPU_DEVICE,
    FLOP_EFFICIENCY,
    MEM_EFFICIENCY,
    STEP_OVERHEAD_S,
    Device,
    find_device,
)
from tgi_paged_backend.planning.sim_config import SimConfig, StepCostModel
from tgi_paged_backend.planning.weights import weight_bytes
from tgi_paged_backend.planning.workload import TraceRequest, summarize

GiB = 1024**3


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
    device = find_device(inputs.device)
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
    plan = Plan(
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
    if inputs.host_cache_gib is not None:
        plan.host_tier = estimate_host_tier(plan, trace, inputs.host_cache_gib)
    return plan


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
    host_cache_gb: float | None = None,
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
        host_cache_gib=host_cache_gb,
    )
    return make_plan(inputs, trace)
