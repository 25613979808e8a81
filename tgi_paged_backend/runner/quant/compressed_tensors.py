"""The compressed-tensors checkpoint layout this backend serves: FP8 weights, served weight-only (W8A16).

On disk (llm-compressor's ``FP8``/``FP8_DYNAMIC`` schemes), each quantized linear ``name`` has
``name.weight`` (float8_e4m3fn ``[N, K]``) and ``name.weight_scale`` (float32/bf16/fp16, ``[N, 1]`` for
the ``channel`` strategy, ``[1]`` or ``[]`` for ``tensor``); biases and every ignored module
(``lm_head`` usually) stay in the checkpoint dtype. ``config.json`` declares it as::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "quantization_status": "compressed", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true,
                    "dynamic": false}}}}

Which modules are quantized is read from the files (every ``*.weight_scale``), so ``targets`` and
``ignore`` need no interpretation. Dynamic input activations (``FP8_DYNAMIC``) are served weight-only:
activations stay in the model dtype, which is at least as accurate as the per-token fp8 activations
the checkpoint allows. Static input scales, int weights (``pack-quantized``, ``int-quantized``),
group/block strategies and sparsity are refused naming what is supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tgi_paged_backend.runner.quant.methods import QuantizationError

FLOAT_FORMATS = ("float-quantized", "naive-quantized")
STRATEGIES = ("channel", "tensor")
SUPPORTED = ("FP8 weights (format float-quantized, weights num_bits 8 type float, strategy channel or tensor, "
             "symmetric), input activations none or dynamic")


@dataclass(frozen=True, slots=True)
class CompressedFp8Scheme:
    """What :func:`parse_scheme` accepted."""

    strategies: tuple[str, ...]
    """Weight strategies used by the config groups."""
    dynamic_activations: bool
    """The checkpoint asks for dynamic fp8 activations; served weight-only."""


def _as_dict(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return value


def _refuse(what: str) -> QuantizationError:
    return QuantizationError(f"compressed-tensors checkpoint not supported: {what}; supported: {SUPPORTED}")


def parse_scheme(quantization_config: Mapping[str, Any] | Any) -> CompressedFp8Scheme:
    """Validate ``quantization_config``; raise :class:`QuantizationError` naming the first unsupported field."""
    qc = _as_dict(quantization_config) or {}
    fmt = qc.get("format")
    if fmt not in FLOAT_FORMATS:
        raise _refuse(f"format={fmt!r}" + (" (int4/int8 packed weights)" if fmt == "pack-quantized" else ""))
    if qc.get("sparsity_config"):
        raise _refuse("sparsity_config is set")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status={status!r} (the weights are not stored quantized)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("no config_groups")
    strategies, dynamic = [], False
    for name, group in sorted(groups.items()):
        group = _as_dict(group) or {}
        w = _as_dict(group.get("weights")) or {}
        if (w.get("num_bits"), w.get("type")) != (8, "float"):
            raise _refuse(f"config_groups.{name}.weights num_bits={w.get('num_bits')!r} type={w.get('type')!r}")
        if w.get("strategy") not in STRATEGIES:
            raise _refuse(f"config_groups.{name}.weights strategy={w.get('strategy')!r}")
        if w.get("symmetric") is False or w.get("dynamic"):
            raise _refuse(f"config_groups.{name}.weights symmetric={w.get('symmetric')!r} dynamic={w.get('dynamic')!r}")
        acts = _as_dict(group.get("input_activations"))
        if acts:
            if not acts.get("dynamic"):
                raise _refuse(f"config_groups.{name}.input_activations are static (input_scale)")
            dynamic = True
        if _as_dict(group.get("output_activations")):
            raise _refuse(f"config_groups.{name}.output_activations are quantized")
        strategies.append(w["strategy"])
    return CompressedFp8Scheme(strategies=tuple(sorted(set(strategies))), dynamic_activations=dynamic)
