"""Put quantized linears into a loaded model: load-time ``fp8``, compressed-tensors FP8 checkpoints, and
int4/int8 checkpoints (GPTQ, AWQ, compressed-tensors ``pack-quantized``).

Both run on the CPU copy that ``load_model`` builds before ``model.to(device)``, one module at a time,
so the device only ever holds the quantized weights. Embeddings, norms and the output head stay in
the model dtype (as in TGI, vLLM and llm-compressor's default ``ignore: ["lm_head"]``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open
from torch import nn

from tgi_paged_backend.runner.quant.fp8 import FP8_DTYPE
from tgi_paged_backend.runner.quant.int_codes import IntCodes, check_codes
from tgi_paged_backend.runner.quant.linear import Fp8Linear, IntLinear
from tgi_paged_backend.runner.quant.methods import QuantizationError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SCALE_SUFFIX = ".weight_scale"


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _linear_for(model: nn.Module, name: str, key: str) -> nn.Linear:
    """The ``nn.Linear`` called ``name`` that checkpoint tensor ``key`` belongs to (refused otherwise)."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise QuantizationError(f"{key}: the model has no module {name!r}") from None
    if not isinstance(linear, nn.Linear):
        raise QuantizationError(f"{key}: {name} is a {type(linear).__name__}, not a Linear")
    return linear


AFFINE_LINEAR_SUBCLASSES = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})
"""``nn.Linear`` subclasses (``module.QualName``) whose forward computes ``x @ W^T + b`` like ``nn.Linear``, in
another order of operations (FalconLinear: the matmul, then the bias): ``--quantize fp8`` quantizes them too."""


def _fp8_target(name: str, module: nn.Module, head: nn.Module | None) -> bool:
    """Whether ``--quantize fp8`` replaces ``module``: an ``nn.Linear`` or one of :data:`AFFINE_LINEAR_SUBCLASSES`,
    not the output head. Any other ``nn.Linear`` subclass is refused: its forward may compute something else than
    its weight's affine map, and leaving it in full precision would silently keep its bytes."""
    if module is head or not isinstance(module, nn.Linear):
        return False
    kind = type(module)
    if kind is nn.Linear or f"{kind.__module__}.{kind.__qualname__}" in AFFINE_LINEAR_SUBCLASSES:
        return True
    raise QuantizationError(
        f"--quantize fp8: {name} is a {kind.__module__}.{kind.__qualname__}, an nn.Linear subclass whose forward is "
        "not known to be x @ W^T + b, so it is neither quantized nor left in full precision silently; serve this "
        "model unquantized or from a pre-quantized checkpoint"
    )


def quantize_model_fp8(model: PreTrainedModel) -> int:
    """Replace every ``nn.Linear`` (and affine subclass, :data:`AFFINE_LINEAR_SUBCLASSES`) but the output head by an
    :class:`Fp8Linear`; return how many."""
    head = model.get_output_embeddings()
    names = [name for name, module in model.named_modules() if _fp8_target(name, module, head)]
    for name in names:
        # Picked above (an nn.Linear); looked up again by name so that only this
        # loop holds the full-precision layer (freed below), hence the cast.
        linear = cast(nn.Linear, model.get_submodule(name))
        _set_submodule(model, name, Fp8Linear.from_linear(linear))
        del linear  # the full-precision weight is freed here, one layer at a time
    return len(names)


def _scale_vector(scale: torch.Tensor, out_features: int, name: str) -> torch.Tensor:
    if scale.numel() == 1:  # tensor strategy
        return scale.reshape(1).to(torch.float32).expand(out_features).contiguous()
    if scale.numel() == out_features and scale.shape in ((out_features, 1), (out_features,)):  # channel
        return scale.reshape(out_features).to(torch.float32)
    raise QuantizationError(
        f"{name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}: expected [{out_features}, 1] "
        "(channel strategy) or [1] (tensor strategy)"
    )


def load_compressed_fp8(model: nn.Module, model_dir: Path) -> int:
    """Replace each linear that has a ``weight_scale`` in the checkpoint by an :class:`Fp8Linear` built
    from the raw fp8 ``weight`` and its scales (read from the files, not from what transformers loaded)."""
    count = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if not key.endswith(SCALE_SUFFIX):
                    continue
                name = key[: -len(SCALE_SUFFIX)]
                linear = _linear_for(model, name, key)
                qweight = f.get_tensor(f"{name}.weight")
                if qweight.dtype != FP8_DTYPE or tuple(qweight.shape) != (linear.out_features, linear.in_features):
                    raise QuantizationError(
                        f"{name}.weight is {qweight.dtype} {tuple(qweight.shape)}: expected "
                        f"{FP8_DTYPE} [{linear.out_features}, {linear.in_features}]"
                    )
                scale = _scale_vector(f.get_tensor(key), linear.out_features, name)
                _set_submodule(model, name, Fp8Linear(qweight, scale, linear.bias))
                count += 1
    if count == 0:
        raise QuantizationError(
            f"{model_dir}: no *{SCALE_SUFFIX} tensor in the safetensors files: not an FP8 compressed-tensors checkpoint"
        )
    return count


IntDecoder = Callable[[str, dict[str, torch.Tensor], int, int], IntCodes]
"""``(module name, its tensors by suffix, out_features, in_features) -> IntCodes``."""


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor (a module's tensors may sit in different shards)."""
    where: dict[str, Path] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            where.update((key, file) for key in f.keys())
    return where


def load_int_linears(
    model: nn.Module, model_dir: Path, marker: str, suffixes: tuple[str, ...], decode: IntDecoder, what: str
) -> int:
    """Replace each linear ``name`` that has a ``name.<marker>`` tensor by an :class:`IntLinear` holding the
    file's codes, decoded from its ``name.<suffix>`` tensors by ``decode``."""
    where = _tensor_files(model_dir)
    names = sorted(key[: -len(marker) - 1] for key in where if key.endswith(f".{marker}"))
    for name in names:
        linear = _linear_for(model, name, f"{name}.{marker}")
        tensors = {}
        for suffix in suffixes:
            file = where.get(f"{name}.{suffix}")
            if file is not None:
                with safe_open(str(file), framework="pt") as f:
                    tensors[suffix] = f.get_tensor(f"{name}.{suffix}")
        codes = decode(name, tensors, linear.out_features, linear.in_features)
        check_codes(name, codes, linear.out_features, linear.in_features)
        _set_submodule(model, name, IntLinear.from_codes(codes, linear.bias))
        del linear
    if not names:
        raise QuantizationError(f"{model_dir}: no *.{marker} tensor in the safetensors files: not a {what} checkpoint")
    return len(names)


def load_quantized(model: PreTrainedModel, method: str, scheme: object, model_dir: Path) -> tuple[int, str]:
    """Swap in the quantized linears of ``method`` (``scheme`` as the config parser returned it);
    return how many and what they hold (for the log)."""
    from tgi_paged_backend.runner.quant import gptq_awq
    from tgi_paged_backend.runner.quant.compressed_tensors import CompressedIntScheme
    from tgi_paged_backend.runner.quant.pack_quantized import TENSOR_SUFFIXES, decode_pack_quantized

    if method == "fp8":
        return quantize_model_fp8(model), "fp8 e4m3 (per-channel scales)"
    if isinstance(scheme, gptq_awq.GptqAwqScheme):

        def decode(name, tensors, n, k):
            return gptq_awq.decode(name, tensors, scheme, n, k)

        groups = "per channel" if scheme.group_size == -1 else f"groups of {scheme.group_size}"
        count = load_int_linears(model, model_dir, "qweight", gptq_awq.TENSOR_SUFFIXES, decode, scheme.method)
        return count, f"int{scheme.bits} ({scheme.method}, {groups}{', act-order' if scheme.desc_act else ''})"
    if isinstance(scheme, CompressedIntScheme):

        def decode(name, tensors, n, k):
            return decode_pack_quantized(name, tensors, scheme.bits, scheme.group_size, scheme.symmetric, n, k)

        count = load_int_linears(
            model, model_dir, "weight_packed", TENSOR_SUFFIXES, decode, "pack-quantized compressed-tensors"
        )
        groups = "per channel" if scheme.group_size is None else f"groups of {scheme.group_size}"
        return count, f"int{scheme.bits} (compressed-tensors pack-quantized, {groups})"
    return load_compressed_fp8(model, model_dir), "fp8 e4m3 (compressed-tensors)"
