"""A capacity plan: what the planner is asked (:class:`PlanInputs`, the ``plan`` options) and what it
found (:class:`Plan`, printed by :mod:`~tgi_paged_backend.planning.plan_report` and written as JSON)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tgi_paged_backend.config import PreemptionMode
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.planning.model_facts import ModelFacts
from tgi_paged_backend.planning.presets import Device
from tgi_paged_backend.planning.sim_config import SimConfig
from tgi_paged_backend.planning.sim_results import DEFAULT_OVERCOMMITS, Comparison


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    model: str
    device: str = "A10G"
    """A name of :data:`~tgi_paged_backend.planning.presets.GPUS`, or ``cpu``."""
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
    host_cache_gib: float | None = None
    """``--host-cache-gb``: estimate what a host KV tier of this size buys
    (:mod:`~tgi_paged_backend.planning.host_tier`); ``None``: no estimate."""


@dataclass(slots=True)
class Plan:
    inputs: PlanInputs
    device: Device
    facts: ModelFacts
    rank_spec: Any
    """The sizes one rank serves (:func:`~tgi_paged_backend.planning.model_facts.shard_spec`; ``facts.spec``
    at ``--num-shard 1``)."""
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
    host_tier: Any = None
    """:class:`~tgi_paged_backend.planning.host_tier.HostTierEstimate` with ``--host-cache-gb``."""

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
        } | ({"host_tier": self.host_tier.to_dict()} if self.host_tier is not None else {})
