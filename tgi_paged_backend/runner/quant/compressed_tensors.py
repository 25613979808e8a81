"""The compressed-tensors checkpoint layouts this backend serves: FP8 weights (W8A16) and packed int4/int8
weights (``pack-quantized``, W4A16/W8A16), both weight-only.

FP8 on disk (llm-compressor's ``FP8``/``FP8_DYNAMIC`` schemes), each quantized linear ``name`` has
``name.weight`` (float8_e4m3fn ``[N, K]``) and ``name.weight_scale`` (float32/bf16/fp16, ``[N, 1]`` for
the ``channel`` strategy, ``[1]`` or ``[]`` for ``tensor``); biases and every ignored module
(``lm_head`` usually) stay in the checkpoint dtype. ``config.json`` declares it as::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "quantization_status": "compressed", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true,
                    "dynamic": false}}}}

Int (``W4A16``/``W8A16``): ``format: pack-quantized``, ``weights: {num_bits: 4 or 8, type: int,
strategy: group (with group_size) or channel, symmetric: true or false, actorder: null, weight or
static}``, no input activations; tensors as :mod:`.pack_quantized` reads them.

Which modules are quantized is read from the files (every ``*.weight_scale``, or ``*.weight_packed``),
so ``targets`` and ``ignore`` need no interpretation. Dynamic fp8 input activations (``FP8_DYNAMIC``)
are served weight-only: activations stay in the model dtype, which is at least as accurate as the
per-token fp8 activations the checkpoint allows. Static input scales, ``int-quantized`` int8 weights,
block/tensor strategies for ints, ``actorder: group`` (a g_idx per layer) and sparsity are refused
naming what is supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tgi_paged_backend.runner.quant.methods import QuantizationError

FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT_FORMAT = "pack-quantized"
STRATEGIES = ("channel", "tensor")
INT_STRATEGIES = ("group", "channel")
INT_ACTORDERS = (None, "weight", "static")
SUPPORTED = (
    "FP8 weights (format float-quantized, weights num_bits 8 type float, strategy channel or tensor, "
    "symmetric), input activations none or dynamic; or int weights (format pack-quantized, weights "
    "num_bits 4 or 8 type int, strategy group or channel, symmetric or not, actorder none/weight), "
    "no input activations"
)


@dataclass(frozen=True, slots=True)
class CompressedFp8Scheme:
    """What :func:`parse_scheme` accepted."""

    strategies: tuple[str, ...]
    """Weight strategies used by the config groups."""
    dynamic_activations: bool
    """The checkpoint asks for dynamic fp8 activations; served weight-only."""


@dataclass(frozen=True, slots=True)
class CompressedIntScheme:
    """A ``pack-quantized`` checkpoint :func:`parse_scheme` accepted (one set of weight args)."""

    bits: int
    group_size: int | None
    """``None``: the channel strategy (one group per output channel)."""
    symmetric: bool


def _as_dict(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return value


def _refuse(what: str) -> QuantizationError:
    return QuantizationError(f"compressed-tensors checkpoint not supported: {what}; supported: {SUPPORTED}")


def _int_args(name: str, group: Mapping[str, Any]) -> CompressedIntScheme:
    w = _as_dict(group.get("weights")) or {}
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
        raise _refuse(f"config_groups.{name}.weights num_bits={w.get('num_bits')!r} type={w.get('type')!r}")
    strategy = w.get("strategy")
    if strategy not in INT_STRATEGIES:
        raise _refuse(f"config_groups.{name}.weights strategy={strategy!r}")
    group_size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise _refuse(f"config_groups.{name}.weights group_size={group_size!r}")
    actorder = w.get("actorder")
    if actorder not in INT_ACTORDERS:
        raise _refuse(f"config_groups.{name}.weights actorder={actorder!r} (a per-layer g_idx)")
    if w.get("dynamic"):
        raise _refuse(f"config_groups.{name}.weights dynamic={w.get('dynamic')!r}")
    if _as_dict(group.get("input_activations")):
        raise _refuse(
            f"config_groups.{name}.input_activations are quantized (int weights are served with "
            "unquantized activations only)"
        )
    if _as_dict(group.get("output_activations")):
        raise _refuse(f"config_groups.{name}.output_activations are quantized")
    return CompressedIntScheme(
        bits=w["num_bits"], group_size=group_size, symmetric=w.get("symmetric", True) is not False
    )


def parse_scheme(quantization_config: Mapping[str, Any] | Any) -> CompressedFp8Scheme | CompressedIntScheme:
    """Validate ``quantization_config``; raise :class:`QuantizationError` naming the first unsupported field."""
    qc = _as_dict(quantization_config) or {}
    fmt = qc.get("format")
    if fmt not in (*FLOAT_FORMATS, INT_FORMAT):
        raise _refuse(f"format={fmt!r}")
    if qc.get("sparsity_config"):
        raise _refuse("sparsity_config is set")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status={status!r} (the weights are not stored quantized)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("no config_groups")
    if fmt == INT_FORMAT:
        schemes = {_int_args(name, _as_dict(group) or {}) for name, group in sorted(groups.items())}
        if len(schemes) != 1:
            raise _refuse(f"config_groups with different int weight args {sorted(map(str, schemes))}")
        return schemes.pop()
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
