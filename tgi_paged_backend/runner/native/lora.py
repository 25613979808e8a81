"""The LoRA adapters of a native decoder layer (:mod:`.layers`), as the native step adds them.

:func:`tgi_paged_backend.lora.layers.attach_adapters` wraps each adapted linear in a
:class:`~tgi_paged_backend.lora.layers.LoraLinear`; the fusion of q/k/v and gate/up keeps each projection's
wrapper on its own output columns of the fused GEMM. :func:`layer_lora` reads those wrappers off the four
projections the native step runs (q/k/v, o, gate/up or up, down) into a
:class:`~tgi_paged_kernels.cpu_layer_lora.LayerLora`: the same stacks (no copy), the same columns. A layer whose
wrappers sit anywhere else (an MoE MLP's experts, a router), or whose stacks the native kernel cannot read
(another dtype, a rank above 256), gets a reason instead: its steps with adapter rows keep the per-op path.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tgi_paged_backend.lora.layers import LoraLinear
from tgi_paged_backend.runner.cpu.layer_forms import layer_attention, layer_mlp, mlp_parts
from tgi_paged_kernels import LayerLora, LoraTarget


def _chain(module: Any) -> list[LoraLinear]:
    """The wrappers of ``module``, outermost first (``[]`` when it has none)."""
    chain = []
    while isinstance(module, LoraLinear):
        chain.append(module)
        module = module.base
    return chain


def layer_lora(layer: nn.Module) -> LayerLora | str | None:
    """The adapters of ``layer``'s projections for the native step; ``None`` without adapters; a reason when the
    native step cannot add them (see the module docstring)."""
    wrappers = [m for m in layer.modules() if isinstance(m, LoraLinear)]
    if not wrappers:
        return None
    attn, mlp = layer_attention(layer), layer_mlp(layer)
    parts = mlp_parts(mlp)
    owners: list[tuple[str, Any, str]] = [("qkv", attn, "qkv_proj"), ("o", attn, "o_proj")]
    if parts is not None and not hasattr(mlp, "experts"):
        owners += [("gate_up", mlp, parts[0]), ("down", mlp, parts[1])]
    targets: list[LoraTarget] = []
    seen: set[int] = set()
    try:
        for projection, owner, name in owners:
            for wrapper in _chain(getattr(owner, name, None)):
                seen.add(id(wrapper))
                columns = wrapper.columns
                targets.append(
                    LoraTarget(
                        projection,
                        0 if columns is None else int(columns.start),
                        wrapper.a_stack,
                        wrapper.b_stack,
                        wrapper.scales,
                        wrapper.rank_tensor,
                    )
                )
    except ValueError as e:  # stacks of another dtype or layout, or ranks above the kernel's
        return str(e)
    if any(id(w) not in seen for w in wrappers):
        return "LoRA on a module the native step does not run (experts, a router, an unfused projection)"
    return LayerLora(targets)
