"""Which ``--quantize`` values the paged backend serves, and whether the flag fits the checkpoint.

Torch-free: the CLI refuses an unsupported ``--quantize`` before anything heavy is imported.

``fp8``
    An fp16/bf16/fp32 checkpoint quantized at load time to float8 e4m3, one scale per output channel.
``compressed-tensors``
    A checkpoint written by llm-compressor / compressed-tensors with FP8 weights
    (``weight`` float8_e4m3fn + ``weight_scale``, channel or tensor strategy) or packed int4/int8
    weights (``pack-quantized``, group or channel strategy), served weight-only.
``gptq``
    An AutoGPTQ / GPTQModel checkpoint (``checkpoint_format: gptq``), bits 4 or 8, with or without
    act-order; also an AWQ checkpoint (TGI converts AWQ to GPTQ for ``--quantize gptq``; here both
    load into the same int layout).
``awq``
    An AutoAWQ GEMM checkpoint (bits 4, zero points).

Everything else the TGI launcher can send is refused with :func:`refusal`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUPPORTED_QUANTIZE: tuple[str, ...] = ("fp8", "compressed-tensors", "gptq", "awq")
"""``--quantize`` values this backend serves."""


class QuantizationError(ValueError):
    """The checkpoint or the ``--quantize`` value cannot be served; the message says why."""


def refusal(quantize: str) -> str:
    """The one-line refusal for an unsupported ``--quantize`` value."""
    return (
        f"--quantize {quantize} is not supported by tgi-paged-backend: supported "
        f"{', '.join(SUPPORTED_QUANTIZE)} (fp8: an fp16/bf16/fp32 checkpoint quantized at load time; "
        "compressed-tensors: FP8 or pack-quantized int4/int8 weight checkpoints; gptq: GPTQ int4/int8 "
        "checkpoints; awq: AWQ GEMM int4 checkpoints); serve unquantized weights, or set TGI_BACKEND=stock "
        "to use TGI's own server"
    )


def quant_method(hf_config: Mapping[str, Any] | Any) -> str | None:
    """``quantization_config.quant_method`` of a ``config.json`` dict or a transformers config."""
    qc = (
        hf_config.get("quantization_config")
        if isinstance(hf_config, Mapping)
        else getattr(hf_config, "quantization_config", None)
    )
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, Mapping) else getattr(qc, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def check_quantize(quantize: str | None, hf_config: Mapping[str, Any] | Any) -> str | None:
    """The format to load, after checking that ``--quantize`` fits the checkpoint's own declaration.

    The TGI launcher passes ``--quantize`` from ``quant_method`` when the flag is not given, so a
    mismatch means the flag contradicts the checkpoint.
    """
    method = quant_method(hf_config)
    if quantize is not None and quantize not in SUPPORTED_QUANTIZE:
        raise QuantizationError(refusal(quantize))
    if quantize is None:
        if method is not None:
            raise QuantizationError(
                f"the checkpoint is quantized (quantization_config.quant_method={method!r}) but no --quantize was "
                f"given; pass --quantize {method} (the TGI launcher does this from config.json)"
                + ("" if method in SUPPORTED_QUANTIZE else f" -- {refusal(method)}")
            )
        return None
    if quantize == "fp8":
        if method is not None:
            raise QuantizationError(
                f"--quantize fp8 quantizes an fp16/bf16/fp32 checkpoint at load time, but this checkpoint is already "
                f"quantized (quantization_config.quant_method={method!r}); pre-quantized FP8 checkpoints are served "
                "in the compressed-tensors format (--quantize compressed-tensors)"
            )
        return "fp8"
    if quantize == "gptq" and method == "awq":  # as TGI, which converts AWQ to its GPTQ kernels' packing
        return "awq"
    if method != quantize:
        raise QuantizationError(
            f"--quantize {quantize} needs a checkpoint whose config.json has quantization_config.quant_method="
            f"{quantize!r}; this one has {method!r}"
        )
    return quantize
