"""Put quantized linears into a loaded model: load-time ``fp8``, and compressed-tensors FP8 checkpoints.

Both run on the CPU copy that ``load_model`` builds before ``model.to(device)``, one module at a time,
so the device only ever holds the quantized weights. Embeddings, norms and the output head stay in
the model dtype (as in TGI, vLLM and llm-compressor's default ``ignore: ["lm_head"]``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tgi_paged_backend.runner.quant.fp8 import FP8_DTYPE
from tgi_paged_backend.runner.quant.linear import Fp8Linear
from tgi_paged_backend.runner.quant.methods import QuantizationError

SCALE_SUFFIX = ".weight_scale"


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model_fp8(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` but the output head by an :class:`Fp8Linear`; return how many."""
    head = model.get_output_embeddings()
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and module is not head]  # fmt: skip
    for name in names:
        linear = model.get_submodule(name)
        _set_submodule(model, name, Fp8Linear.from_linear(linear))
        del linear  # the full-precision weight is freed here, one layer at a time
    return len(names)


def _scale_vector(scale: torch.Tensor, out_features: int, name: str) -> torch.Tensor:
    if scale.numel() == 1:  # tensor strategy
        return scale.reshape(1).to(torch.float32).expand(out_features).contiguous()
    if scale.numel() == out_features and scale.shape in ((out_features, 1), (out_features,)):  # channel
        return scale.reshape(out_features).to(torch.float32)
    raise QuantizationError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}: expected [{out_features}, 1] "
                            "(channel strategy) or [1] (tensor strategy)")


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
                try:
                    linear = model.get_submodule(name)
                except AttributeError:
                    raise QuantizationError(f"{key}: the model has no module {name!r}") from None
                if not isinstance(linear, nn.Linear):
                    raise QuantizationError(f"{key}: {name} is a {type(linear).__name__}, not a Linear")
                qweight = f.get_tensor(f"{name}.weight")
                if qweight.dtype != FP8_DTYPE or tuple(qweight.shape) != (linear.out_features, linear.in_features):
                    raise QuantizationError(f"{name}.weight is {qweight.dtype} {tuple(qweight.shape)}: expected "
                                            f"{FP8_DTYPE} [{linear.out_features}, {linear.in_features}]")
                scale = _scale_vector(f.get_tensor(key), linear.out_features, name)
                _set_submodule(model, name, Fp8Linear(qweight, scale, linear.bias))
                count += 1
    if count == 0:
        raise QuantizationError(f"{model_dir}: no *{SCALE_SUFFIX} tensor in the safetensors files: not an FP8 "
                                "compressed-tensors checkpoint")
    return count
