"""The one resident form of int4/int8 weights, whatever file format they came from.

Every int loader (:mod:`.gptq_awq`, :mod:`.pack_quantized`) turns its file's packed tensors into an
:class:`IntCodes`: unsigned codes ``[N, K]`` (``0 .. 2^bits - 1``), per-group ``scales`` and
``zeros`` ``[N, G]`` and the group of each input column ``g_idx`` ``[K]``, with
``W[n, k] = (codes[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]``. A signed format (compressed-
tensors) is shifted by ``2^(bits-1)`` on both codes and zeros, which leaves every difference, hence
every weight, unchanged. :class:`~.linear.IntLinear` then packs the codes two per byte (int4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tgi_paged_backend.runner.quant.methods import QuantizationError


@dataclass(frozen=True, slots=True)
class IntCodes:
    """One linear's weight as unsigned codes with per-group scales and zero points."""

    codes: torch.Tensor
    """uint8 ``[N, K]``."""
    scales: torch.Tensor
    """float32 ``[N, G]``."""
    zeros: torch.Tensor
    """uint8 ``[N, G]``: the code of 0.0."""
    g_idx: torch.Tensor
    """int32 ``[K]``: group of each input column."""
    bits: int


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 of ``words`` into ``32 / bits`` unsigned fields along ``dim`` (0 or 1), least
    significant field first: word ``i`` yields elements ``i * 32/bits .. (i+1) * 32/bits - 1``."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise QuantizationError(f"expected a 2-D int32 packed tensor, got {words.dtype} {tuple(words.shape)}")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        fields = words.unsqueeze(1) >> shifts.view(1, per, 1)
        out = fields.reshape(words.shape[0] * per, words.shape[1])
    else:
        fields = words.unsqueeze(2) >> shifts.view(1, 1, per)
        out = fields.reshape(words.shape[0], words.shape[1] * per)
    return (out & ((1 << bits) - 1)).to(torch.uint8)


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    """``k // group_size`` for every input column (one group when ``group_size`` is -1)."""
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.int32)
    return (torch.arange(in_features, dtype=torch.int32) // group_size).to(torch.int32)


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise :class:`QuantizationError` naming the tensor unless it has ``shape`` and one of ``dtypes``."""
    if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
        allowed = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise QuantizationError(
            f"{name} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}: "
            f"expected {allowed} {list(shape)}"
        )


def require(name: str, tensors: Mapping[str, torch.Tensor], suffixes: tuple[str, ...]) -> None:
    """Raise :class:`QuantizationError` naming every ``name.<suffix>`` tensor the files lack."""
    missing = [f"{name}.{suffix}" for suffix in suffixes if suffix not in tensors]
    if missing:
        raise QuantizationError(f"the checkpoint lacks {', '.join(missing)}")


def check_codes(name: str, codes: IntCodes, out_features: int, in_features: int) -> None:
    """The decoded tensors fit an ``out_features x in_features`` linear (and the resident layout)."""
    if tuple(codes.codes.shape) != (out_features, in_features):
        raise QuantizationError(
            f"{name}: the packed weight holds {list(codes.codes.shape)} codes, the model's "
            f"linear is [{out_features}, {in_features}]"
        )
    if codes.bits == 4 and in_features % 2:
        raise QuantizationError(f"{name}: in_features={in_features} is odd; int4 weights need an even count")
    groups = codes.scales.shape[1]
    if codes.g_idx.numel() and (int(codes.g_idx.min()) < 0 or int(codes.g_idx.max()) >= groups):
        raise QuantizationError(f"{name}: g_idx points outside the {groups} groups of its scales")
