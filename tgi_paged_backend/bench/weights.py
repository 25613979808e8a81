"""Resident weight bytes for the planner, unquantized or under ``--quantize``.

Unquantized: ``num_params x itemsize``. ``fp8`` and ``compressed-tensors`` (FP8) keep every decoder
linear (q/k/v/o, gate/up/down) as 1 byte per weight plus one float32 scale per output channel, and the
rest (embeddings, output head, norms) in the serving dtype, exactly what the shard's ``Fp8Linear``
modules hold (``ModelRunner.weights_bytes``). The linear sizes come from the config of a dense
decoder (``ModelSpec``); for other layouts (MoE) the figure is an estimate.
"""

from __future__ import annotations

from typing import Any

from tgi_paged_backend.runner.quant.methods import SUPPORTED_QUANTIZE, refusal


def decoder_linear_sizes(spec: Any) -> tuple[int, int]:
    """(weights, output channels) of all decoder-layer linears of a dense Llama-style model."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    qkv = (spec.num_q_heads + 2 * spec.num_kv_heads) * d
    weights = h * qkv + spec.num_q_heads * d * h + 3 * h * i
    channels = qkv + h + 2 * i + h
    return spec.num_layers * weights, spec.num_layers * channels


def weight_bytes(spec: Any, num_params: int, itemsize: int, quantize: str | None) -> int:
    """Bytes the weights take on the device."""
    if quantize is None:
        return num_params * itemsize
    if quantize not in SUPPORTED_QUANTIZE:
        raise ValueError(refusal(quantize))
    linear, channels = decoder_linear_sizes(spec)
    linear = min(linear, num_params)
    return (num_params - linear) * itemsize + linear + channels * 4
