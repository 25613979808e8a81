"""Resident weight bytes for the planner, unquantized or under ``--quantize``.

Unquantized: ``num_params x itemsize``. Quantized formats keep every decoder linear (q/k/v/o,
gate/up/down) in their resident layout and the rest (embeddings, output head, norms) in the serving
dtype, exactly what the shard's modules hold (``ModelRunner.weights_bytes``):

- ``fp8`` and ``compressed-tensors`` FP8 (``Fp8Linear``): 1 byte per weight + a float32 scale per
  output channel;
- ``gptq``, ``awq`` and compressed-tensors ``pack-quantized`` (``IntLinear``), given the code width
  ``bits`` and ``group_size`` (:class:`IntLayout`; default int4, groups of 128, the common GPTQ/AWQ
  export): ``bits / 8`` bytes per weight + 5 bytes (float32 scale, uint8 zero point) per output
  channel and group + 4 bytes (int32 ``g_idx``) per input column of each linear.

The linear sizes come from the config of a dense decoder (``ModelSpec``); for other layouts (MoE) the
figure is an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tgi_paged_backend.runner.quant.methods import SUPPORTED_QUANTIZE, refusal

INT_METHODS = ("gptq", "awq")


@dataclass(frozen=True, slots=True)
class IntLayout:
    """Code width and group size of an int checkpoint (``group_size`` -1: one group per channel)."""

    bits: int = 4
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} is invalid: allowed 4, 8")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size={self.group_size} is invalid: a positive size, or -1 (per channel)")


def decoder_linear_shapes(spec: Any) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one decoder layer's linears (dense Llama-style model)."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_q_heads * d, spec.num_kv_heads * d
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def decoder_linear_sizes(spec: Any) -> tuple[int, int]:
    """(weights, output channels) of all decoder-layer linears of a dense Llama-style model."""
    shapes = decoder_linear_shapes(spec)
    return spec.num_layers * sum(n * k for n, k in shapes), spec.num_layers * sum(n for n, _ in shapes)


def int_linear_bytes(n: int, k: int, layout: IntLayout) -> int:
    """What one ``IntLinear`` of ``n`` outputs and ``k`` inputs holds."""
    groups = 1 if layout.group_size == -1 else -(-k // layout.group_size)
    return n * k * layout.bits // 8 + n * groups * 5 + k * 4


def weight_bytes(
    spec: Any, num_params: int, itemsize: int, quantize: str | None, int_layout: IntLayout | None = None
) -> int:
    """Bytes the weights take on the device. ``int_layout`` applies to ``gptq``/``awq`` (default
    :class:`IntLayout`) and makes ``compressed-tensors`` mean ``pack-quantized`` (FP8 without it)."""
    if quantize is None:
        return num_params * itemsize
    if quantize not in SUPPORTED_QUANTIZE:
        raise ValueError(refusal(quantize))
    linear, channels = decoder_linear_sizes(spec)
    if quantize in INT_METHODS or (quantize == "compressed-tensors" and int_layout is not None):
        layout = int_layout or IntLayout()
        quantized = spec.num_layers * sum(int_linear_bytes(n, k, layout) for n, k in decoder_linear_shapes(spec))
        return (num_params - min(linear, num_params)) * itemsize + quantized
    linear = min(linear, num_params)
    return (num_params - linear) * itemsize + linear + channels * 4
