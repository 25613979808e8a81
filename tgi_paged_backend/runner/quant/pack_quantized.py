"""compressed-tensors ``pack-quantized`` int4/int8 weights (llm-compressor ``W4A16``/``W8A16``).

Per quantized linear ``name`` (``N`` outputs, ``K`` inputs, ``p = 32 / num_bits``):

- ``name.weight_packed`` int32 ``[N, ceil(K / p)]``: packed along the *input* dim, input ``k`` is
  field ``k % p`` (least significant first) of word ``k // p``; each field holds the signed code plus
  ``2^(bits-1)`` (so 0..15 for int4);
- ``name.weight_scale`` ``[N, G]`` (``group`` strategy, ``G = K / group_size``) or ``[N, 1]``
  (``channel``), in the checkpoint's dtype;
- ``name.weight_zero_point`` (asymmetric only) int32 ``[ceil(N / p), G]``: signed zero points packed
  along the *output* dim the same way (same ``2^(bits-1)`` offset); symmetric checkpoints have none
  (zero point 0);
- ``name.weight_shape`` int ``[2]``: ``(N, K)``.

``W = (q - z) * scale``. Stored codes are ``q + 2^(bits-1)``, so the resident unsigned codes are the
stored fields as they are and the resident zero is ``z + 2^(bits-1)`` (``2^(bits-1)`` when symmetric).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tgi_paged_backend.runner.quant.int_codes import IntCodes, expect_shape, group_index, require, unpack_int32
from tgi_paged_backend.runner.quant.methods import QuantizationError

TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_pack_quantized(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    bits: int,
    group_size: int | None,
    symmetric: bool,
    out_features: int,
    in_features: int,
) -> IntCodes:
    """The file's tensors of linear ``name`` as :class:`IntCodes`; ``group_size`` ``None`` is the channel
    strategy."""
    n, k, per = out_features, in_features, 32 // bits
    require(name, tensors, ("weight_packed", "weight_scale"))
    shape = tensors.get("weight_shape")
    if shape is not None and [int(v) for v in shape.reshape(-1).tolist()] != [n, k]:
        raise QuantizationError(f"{name}.weight_shape is {shape.tolist()}: the model's linear is [{n}, {k}]")
    if group_size is not None and k % group_size:
        raise QuantizationError(f"{name}: in_features={k} is not a multiple of group_size={group_size}")
    groups = 1 if group_size is None else k // group_size
    expect_shape(f"{name}.weight_packed", tensors["weight_packed"], (n, _cdiv(k, per)), (torch.int32,))
    expect_shape(f"{name}.weight_scale", tensors["weight_scale"], (n, groups), SCALE_DTYPES)
    codes = unpack_int32(tensors["weight_packed"], bits, dim=1)[:, :k]
    offset = 1 << (bits - 1)
    if symmetric:
        zeros = torch.full((n, groups), offset, dtype=torch.uint8)
    else:
        packed = tensors.get("weight_zero_point")
        if packed is None:
            raise QuantizationError(f"{name}.weight_zero_point is missing but the scheme is asymmetric")
        expect_shape(f"{name}.weight_zero_point", packed, (_cdiv(n, per), groups), (torch.int32,))
        zeros = unpack_int32(packed, bits, dim=0)[:n]  # stored z + offset: the unsigned zero already
    return IntCodes(
        codes=codes.contiguous(),
        scales=tensors["weight_scale"].to(torch.float32).contiguous(),
        zeros=zeros.contiguous(),
        g_idx=group_index(k, -1 if group_size is None else group_size),
        bits=bits,
    )
