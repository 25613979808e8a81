"""GPTQ and AWQ checkpoints: their ``quantization_config`` and their packed tensors, as TGI loads them.

**GPTQ** (AutoGPTQ / GPTQModel, ``checkpoint_format``/``format`` ``gptq``, the "v1" layout), per
quantized linear ``name`` with ``K`` inputs, ``N`` outputs, ``p = 32 / bits`` codes per int32 and
``G`` groups (``K / group_size``, or 1 for ``group_size: -1``):

- ``name.qweight`` int32 ``[K/p, N]``: packed along the *input* dim, input ``k`` is field ``k % p``
  (least significant first, ``bits`` wide) of row ``k // p``;
- ``name.qzeros`` int32 ``[G, N/p]``: packed along the *output* dim the same way, storing
  ``zero - 1`` (so the zero point is ``(field + 1) mod 2^bits``; symmetric checkpoints store
  ``2^(bits-1) - 1``);
- ``name.scales`` float16 ``[G, N]``; ``name.g_idx`` int32 ``[K]``, the group of each input
  (``k // group_size`` without act-order, a permutation's groups with ``desc_act: true``).

``W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]``. bits 4 and 8 are served (2 and 3
are refused: 3-bit fields straddle words).

**AWQ** (AutoAWQ ``version``/``format`` ``gemm``, ``zero_point: true``, bits 4):

- ``name.qweight`` int32 ``[K, N/8]`` and ``name.qzeros`` int32 ``[G, N/8]``, both packed along the
  *output* dim with AWQ's interleave: field ``j`` of word ``c`` holds output ``8c + [0, 2, 4, 6, 1, 3,
  5, 7][j]``; zeros are stored as they are (no offset);
- ``name.scales`` float16 ``[G, N]``; no ``g_idx`` (groups are ``k // group_size``).

Config keys read (``config.json``'s ``quantization_config``): ``quant_method``, ``bits``,
``group_size``, ``desc_act``, ``sym``, ``checkpoint_format``/``format`` (GPTQ);
``zero_point``, ``version``/``format``, ``backend`` (AWQ). Which linears are quantized is read from the
files (every ``*.qweight``), so ``modules_to_not_convert`` needs no interpretation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tgi_paged_backend.runner.quant.int_codes import IntCodes, expect_shape, group_index, require, unpack_int32
from tgi_paged_backend.runner.quant.methods import QuantizationError

GPTQ_BITS = (4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Output ``8c + AWQ_ORDER[j]`` is field ``j`` of packed word ``c``."""
SUPPORTED = {
    "gptq": "GPTQ checkpoint_format gptq (v1), bits 4 or 8, any group_size dividing in_features or -1, "
    "desc_act true or false, sym true or false",
    "awq": "AWQ version gemm, bits 4, zero_point true, group_size dividing in_features or -1",
}
TENSOR_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True, slots=True)
class GptqAwqScheme:
    """What :func:`parse_config` accepted."""

    method: str
    """``gptq`` or ``awq``: the on-disk layout."""
    bits: int
    group_size: int
    """-1: one group per output channel."""
    desc_act: bool = False
    sym: bool = True


def _as_dict(value: Any) -> dict:
    if isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return dict(vars(value))


def _refuse(method: str, what: str) -> QuantizationError:
    return QuantizationError(f"{method} checkpoint not supported: {what}; supported: {SUPPORTED[method]}")


def _group_size(method: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value > 0):
        raise _refuse(method, f"group_size={value!r}")
    return value


def parse_config(quantization_config: Mapping[str, Any] | Any) -> GptqAwqScheme:
    """Validate a GPTQ or AWQ ``quantization_config``; raise naming the first unsupported field."""
    qc = _as_dict(quantization_config)
    method = str(getattr(qc.get("quant_method"), "value", qc.get("quant_method")))
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt != "gptq":
            raise _refuse(method, f"checkpoint_format={fmt!r}")
        bits = qc.get("bits")
        if bits not in GPTQ_BITS:
            raise _refuse(method, f"bits={bits!r}")
        return GptqAwqScheme(
            method,
            bits,
            _group_size(method, qc.get("group_size", 128)),
            desc_act=bool(qc.get("desc_act", False)),
            sym=bool(qc.get("sym", True)),
        )
    if method == "awq":
        fmt = str(qc.get("version") or qc.get("format") or "gemm").lower()
        if str(qc.get("backend") or "").lower() == "llm-awq":
            fmt = "llm-awq"
        if fmt != "gemm":
            raise _refuse(method, f"version={fmt!r}")
        if qc.get("bits", 4) != 4:
            raise _refuse(method, f"bits={qc.get('bits')!r}")
        if qc.get("zero_point", True) is not True:
            raise _refuse(method, f"zero_point={qc.get('zero_point')!r}")
        return GptqAwqScheme(method, 4, _group_size(method, qc.get("group_size", 128)), sym=False)
    raise QuantizationError(f"quant_method={method!r} is neither gptq nor awq")


def _groups(scheme: GptqAwqScheme, in_features: int, name: str) -> int:
    if scheme.group_size == -1:
        return 1
    if in_features % scheme.group_size:
        raise _refuse(
            scheme.method, f"{name}: in_features={in_features} is not a multiple of group_size={scheme.group_size}"
        )
    return in_features // scheme.group_size


def decode_gptq(
    name: str, tensors: Mapping[str, torch.Tensor], scheme: GptqAwqScheme, out_features: int, in_features: int
) -> IntCodes:
    """The file's GPTQ tensors of linear ``name`` as :class:`IntCodes` (codes exactly as stored)."""
    bits, n, k = scheme.bits, out_features, in_features
    per = 32 // bits
    if k % per or n % per:
        raise _refuse("gptq", f"{name}: [{n}, {k}] is not a multiple of {per} codes per int32 in both dims")
    groups = _groups(scheme, k, name)
    require(name, tensors, ("qweight", "qzeros", "scales"))
    expect_shape(f"{name}.qweight", tensors["qweight"], (k // per, n), (torch.int32,))
    expect_shape(f"{name}.qzeros", tensors["qzeros"], (groups, n // per), (torch.int32,))
    expect_shape(f"{name}.scales", tensors["scales"], (groups, n), (torch.float16, torch.bfloat16, torch.float32))
    codes = unpack_int32(tensors["qweight"], bits, dim=0).t().contiguous()  # [N, K]
    stored = unpack_int32(tensors["qzeros"], bits, dim=1).to(torch.int32)  # [G, N], zero - 1
    zeros = ((stored + 1) & ((1 << bits) - 1)).to(torch.uint8).t().contiguous()
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        if scheme.desc_act:
            raise _refuse("gptq", f"{name}.g_idx is missing but desc_act is true")
        g_idx = group_index(k, scheme.group_size)
    else:
        expect_shape(f"{name}.g_idx", g_idx, (k,), (torch.int32, torch.int64))
        g_idx = g_idx.to(torch.int32)
    return IntCodes(
        codes=codes,
        scales=tensors["scales"].to(torch.float32).t().contiguous(),
        zeros=zeros,
        g_idx=g_idx.contiguous(),
        bits=bits,
    )


def _awq_deinterleave(fields: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` fields in packed order -> outputs in order (field ``j`` of word ``c`` is output
    ``8c + AWQ_ORDER[j]``)."""
    order = torch.empty(8, dtype=torch.long)
    order[list(AWQ_ORDER)] = torch.arange(8)
    rows = fields.shape[0]
    return fields.reshape(rows, -1, 8)[:, :, order].reshape(rows, -1)


def decode_awq(
    name: str, tensors: Mapping[str, torch.Tensor], scheme: GptqAwqScheme, out_features: int, in_features: int
) -> IntCodes:
    """The file's AWQ GEMM tensors of linear ``name`` as :class:`IntCodes`."""
    n, k = out_features, in_features
    if n % 8:
        raise _refuse("awq", f"{name}: out_features={n} is not a multiple of 8")
    groups = _groups(scheme, k, name)
    require(name, tensors, ("qweight", "qzeros", "scales"))
    expect_shape(f"{name}.qweight", tensors["qweight"], (k, n // 8), (torch.int32,))
    expect_shape(f"{name}.qzeros", tensors["qzeros"], (groups, n // 8), (torch.int32,))
    expect_shape(f"{name}.scales", tensors["scales"], (groups, n), (torch.float16, torch.bfloat16, torch.float32))
    codes = _awq_deinterleave(unpack_int32(tensors["qweight"], 4, dim=1))  # [K, N]
    zeros = _awq_deinterleave(unpack_int32(tensors["qzeros"], 4, dim=1))  # [G, N]
    return IntCodes(
        codes=codes.t().contiguous(),
        scales=tensors["scales"].to(torch.float32).t().contiguous(),
        zeros=zeros.t().contiguous(),
        g_idx=group_index(k, scheme.group_size),
        bits=4,
    )


def decode(
    name: str, tensors: Mapping[str, torch.Tensor], scheme: GptqAwqScheme, out_features: int, in_features: int
) -> IntCodes:
    """:func:`decode_gptq` or :func:`decode_awq` by the checkpoint's layout."""
    fn = decode_gptq if scheme.method == "gptq" else decode_awq
    return fn(name, tensors, scheme, out_features, in_features)
