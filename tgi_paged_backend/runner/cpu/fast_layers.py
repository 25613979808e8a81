"""Load-time swap of transformers' layers for faster ones that compute the same thing.

transformers' modules stay the model definition of every served family; after loading,
:func:`swap_fast_layers` walks the module tree once and replaces

- every plain ``nn.Linear`` of at least :data:`PACK_MIN_ELEMENTS` weights (the tensor-parallel slices
  hold one, see :mod:`tgi_paged_backend.runner.parallel.tp_runner`) by a
  :class:`PackedLinear`: on CPU its weight is reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, what inductor does on CPU) and every call is one
  ``_linear_pointwise`` primitive, for any batch size. A decode step streams every weight from memory
  (cold in cache: 30 layers of distinct weights plus the LM head), and the packed layout reads it about
  twice as fast as ``F.linear`` on the same box (``docs/performance-cpu.md``, "CPU forward"). On CUDA linears stay
  as they are (cuBLAS). Quantized linears (:mod:`.quant`) are not plain ``nn.Linear`` and are left alone;
- a plain fp32 ``nn.Linear`` of at least :data:`NATIVE_MIN_OUT_FEATURES` outputs (the LM head) by a
  :class:`NativeLinear` where the native kernels are built (the native packed GEMM reads a cold weight faster);
  in a bf16 model where oneDNN has no bf16 GEMM (AVX2-only CPUs), every plain ``nn.Linear`` (bf16 packed);
- every RMSNorm of the Llama form (``weight * x / sqrt(mean(x^2) + eps)``, computed in fp32) by
  :class:`FusedRMSNorm`, one ``torch.rms_norm`` call instead of six elementwise kernels. A norm is
  swapped only after it reproduces the original on a random input (Gemma's ``1 + weight`` form and
  other variants keep their module).

A tied LM head (its weight is the embedding table) keeps the table for the embedding lookup and gets
its own packed copy: that copy counts in the resident weight bytes (:func:`runner.model.loader.resident_bytes`,
read after the swap), so it comes out of the KV budget like any weight.

The native decoder layer's projections (:class:`NativeLinear`: fp32 or bf16 packed, :class:`NativeInt8Linear`: int8
codes) are here too: the native GEMM on the packed weights the layer's decode step reads, so that the layer holds one
copy of its weights (:meth:`.native_layers.NativeDecoderLayer.own_projections`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from tgi_paged_kernels import (
    NativeKernels,
    PackedInt8,
    dequantized_int8,
    gemm_packed,
    gemm_packed_int8,
    native_kernels,
    pack_weight,
    pack_weight_bf16,
    unpack_weight,
)

_PACK_BATCH_HINT = 32
"""Batch size oneDNN tunes the reordered layout for; the packed weight serves any batch size."""

PACK_MIN_ELEMENTS = 1 << 17
"""Weights smaller than this keep ``F.linear`` for decode-sized inputs: a oneDNN call costs ~10-20 us more
than ``F.linear`` before any math (hot in cache, 20 rows, one thread: 128x128 plain 13 us vs packed 32 us;
576x576 186 vs 170 us; ``examples/bench_packed_linears.py``), so packing pays only once the weight itself
takes longer than that to stream. They are packed too, for inputs of at least :data:`PACKED_MIN_ROWS`
rows (prefill), where oneDNN's blocked GEMM wins."""

NATIVE_MIN_OUT_FEATURES = 8192
"""An fp32 linear this wide (the LM head) runs the native packed GEMM (:class:`NativeLinear`) instead of oneDNN where
the native kernels are built: it streams the weight once across threads and prefetches the next panel, so it reads
a cold weight faster (``examples/bench_packed_linears.py --native``; figures in ``docs/performance-cpu.md``)."""

PACKED_MIN_ROWS = 128
"""Rows from which a small weight runs packed. 2 threads, 30 layers of the host-bound model's four weights
(128-512 wide), distinct weights (``examples/bench_packed_linears.py --small``): 128 rows ``F.linear``
12.7-13.8 ms vs packed 8.2-8.5, 256 rows 17.4 vs 13.5-14.0, 1118 rows 59-65 vs 57. In isolation packed
also wins at 20 rows, but not inside the decode step: the host-bound forward at 20 rows is 1.11x slower
with every linear packed (``examples/bench_forward.py --model hostbound --variants default all-packed``),
so decode-sized inputs keep ``F.linear``."""


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can run a packed linear of ``dtype`` on ``device`` (CPU only; bf16/fp16 need ISA support)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


_PACKED_WEIGHTS: dict[int, torch.Tensor] = {}
"""Packed weights by handle, for :func:`packed_linear`: a compiled graph (``TGI_PAGED_COMPILE``) cannot take
a oneDNN tensor as an input, so it calls the op with the weight's handle, an int it holds as a constant.
Each :class:`PackedLinear` owns its entry and drops it when it is collected."""


@torch.library.custom_op("tgi_paged::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` with the packed ``W`` registered under ``handle`` (opaque to ``torch.compile``)."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED_WEIGHTS[handle], bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held only in oneDNN's reordered layout (CPU).

    The reordered weight lives in :data:`_PACKED_WEIGHTS` under :attr:`handle` (not a buffer: see there);
    :attr:`resident_bytes` reports its size for the weight accounting. The original parameter is dropped
    (a tied weight lives on in the module that shares it).
    """

    bias: nn.Parameter | None

    def __init__(self, linear: nn.Linear, *, plain_below_rows: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.plain_below_rows = plain_below_rows
        """Inputs of fewer rows run ``F.linear`` on the plain weight (kept for them); 0: always packed."""
        self.plain_weight = weight if plain_below_rows else None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        self.handle = id(packed)
        _PACKED_WEIGHTS[self.handle] = packed
        weakref.finalize(self, _PACKED_WEIGHTS.pop, self.handle, None)
        self.resident_bytes = weight.numel() * weight.element_size() * (2 if plain_below_rows else 1)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def packed_weight(self) -> torch.Tensor:
        return _PACKED_WEIGHTS[self.handle]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # an opaque op the compiled step calls with the handle
            return packed_linear(x, self.handle, self.out_features, self.bias)
        if self.plain_weight is not None and x.numel() < self.plain_below_rows * self.in_features:
            return F.linear(x, self.plain_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, _PACKED_WEIGHTS[self.handle], self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` as one call: the native kernel on CPU
    (:mod:`tgi_paged_kernels.cpu_native`), else ``torch.rms_norm`` (fp32 math for fp32 inputs)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = float(eps)
        self.shape = (int(weight.shape[0]),)
        self.native = native_kernels() if weight.device.type == "cpu" else None
        """The C++ kernel on CPU (one call, ~30x less host time than torch's composite ``rms_norm`` there)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and not torch.compiler.is_compiling():
            out = self.native.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        return F.rms_norm(x, self.shape, self.weight, self.eps)


def rms_norm_eps(module: nn.Module) -> float | None:
    """The epsilon of an RMSNorm-looking module (a 1-D ``weight`` and an epsilon attribute), else ``None``."""
    if not type(module).__name__.endswith("RMSNorm"):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        return None
    for name in ("variance_epsilon", "eps", "epsilon"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def is_silu(act_fn: nn.Module) -> bool:
    """Whether ``act_fn`` is SiLU (torch's or transformers' ``SiLUActivation``): its gated MLPs may run the native
    ``silu_and_mul``."""
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def outputs_close(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """Whether a replacement's output ``got`` reproduces the original's: the largest difference within
    1e-5 (fp32; 2e-2 otherwise) of the output's scale (its root mean square, at least 1). Scale-relative,
    not element-wise: a fused GEMM sums in another order, so a near-zero element of a large output differs
    by a rounding of the large ones (SmolLM2's MLPs: 3e-5 on outputs of 500-3000, 1e-7 relative), while a
    replacement that computes something else is off by the output's own order. The RMS, not the largest
    magnitude: one huge channel must not hide a wrong form elsewhere (a Gemma norm's ``1 + w`` as ``w``)."""
    if expected.shape != got.shape:
        return False
    if expected.numel() == 0:
        return True
    tolerance = 1e-5 if got.dtype == torch.float32 else 2e-2
    expected, got = expected.float(), got.float()
    scale = max(1.0, float(expected.pow(2).mean().sqrt()))
    return bool(torch.isfinite(got).all()) and float((expected - got).abs().max()) <= tolerance * scale


def same_output(
    original: nn.Module, replacement: nn.Module, width: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``replacement`` reproduces ``original`` on a seeded random ``[3, width]`` input."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, width, generator=generator).to(dtype=dtype, device=device)
    with torch.inference_mode():
        expected, got = original(x), replacement(x)
    return outputs_close(expected, got)


@dataclass(frozen=True, slots=True)
class SwapReport:
    """What :func:`swap_fast_layers` replaced (logged at start-up, asserted by the tests)."""

    packed_linears: int
    fused_norms: int
    native_heads: int
    """Wide fp32 linears (the LM head) on the native packed GEMM (:data:`NATIVE_MIN_OUT_FEATURES`)."""
    native_bf16: int
    """bf16 linears on the native packed GEMM where oneDNN has no bf16 (AVX2-only CPUs): every plain one."""
    kept_norms: tuple[str, ...]
    """Class names of RMSNorm-looking modules that did not reproduce the fused form (left as they are)."""


def swap_fast_layers(
    model: nn.Module, device: torch.device, dtype: torch.dtype, native_heads: bool = True
) -> SwapReport:
    """Replace plain linears and Llama-form RMSNorms of ``model`` in place (see the module docstring);
    ``native_heads=False`` keeps wide fp32 linears on oneDNN too (a compiled step traces oneDNN's op).

    A bf16 model where oneDNN has no bf16 GEMM (AVX2-only CPUs: torch's bf16 ``F.linear`` there converts and runs
    several times slower than fp32) gets every plain linear on the native bf16 GEMM
    (:class:`NativeLinear`: fp32 sums of the exact products, rounded to bf16 once, as torch's bf16 linear). With
    ``native_heads=False`` (native layers off, compiled decode) they keep torch's bf16 linear."""
    pack = can_pack(dtype, device)
    native_dtype = (
        native_heads and device.type == "cpu" and (dtype == torch.float32 or (dtype == torch.bfloat16 and not pack))
    )
    native = native_kernels() if native_dtype else None
    every_width = dtype == torch.bfloat16
    packed = fused = heads = 0
    kept: set[str] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                native is not None
                and isinstance(child, nn.Linear)
                and type(child) is nn.Linear
                and child.weight.dtype == dtype
                and (every_width or child.out_features >= NATIVE_MIN_OUT_FEATURES)
            ):
                bias = None if child.bias is None else child.bias.detach().float()
                packed_weight = (pack_weight_bf16 if every_width else pack_weight)(child.weight.detach())
                setattr(parent, name, NativeLinear(packed_weight, child.out_features, bias, native, child.in_features))
                heads += 1
                continue
            if pack and type(child) is nn.Linear and child.weight.dtype == dtype:
                small = child.weight.numel() < PACK_MIN_ELEMENTS
                setattr(parent, name, PackedLinear(child, plain_below_rows=PACKED_MIN_ROWS if small else 0))
                packed += 1
                continue
            eps = rms_norm_eps(child)
            if eps is None:
                continue
            # rms_norm_eps returns an eps only for a module whose ``weight`` is a 1-D tensor.
            weight = cast(torch.Tensor, child.weight)
            candidate = FusedRMSNorm(weight, eps)
            if same_output(child, candidate, int(weight.shape[0]), weight.dtype, weight.device):
                setattr(parent, name, candidate)
                fused += 1
            else:
                kept.add(type(child).__name__)
    report = SwapReport(
        packed_linears=packed,
        fused_norms=fused,
        native_heads=0 if every_width else heads,
        native_bf16=heads if every_width else 0,
        kept_norms=tuple(sorted(kept)),
    )
    logger.info(
        "fast layers: {} linears packed for oneDNN{}{}, {} RMSNorms fused{}",
        packed,
        "" if pack or native else f" (none: {dtype} on {device.type} runs plain linears)",
        f", {heads} {'bf16 (no oneDNN bf16 here)' if every_width else 'wide'} on the native GEMM" if heads else "",
        fused,
        f"; kept {', '.join(report.kept_norms)} (another norm form)" if kept else "",
    )
    return report


BF16_MATMUL_ROWS = 32
"""From this many rows a bf16 :class:`NativeLinear` runs oneDNN's bf16 GEMM (AMX tiles or AVX512-BF16 where present)
on the module's weight in oneDNN's layout (:meth:`NativeLinear.keep_dense`, :class:`PackedLinear`), as
the per-op path does: a SmolLM2 prefill of 565 tokens took 813 ms through the packed GEMM, 225 ms per op (Sapphire
Rapids, 2 threads). A bf16 model so holds its decoder projections twice in bf16: the bytes of one fp32 copy."""

BF16_DOT_MATMUL_ROWS = 64
""":data:`BF16_MATMUL_ROWS` where the native bf16 GEMM runs ``vdpbf16ps`` (:func:`~tgi_paged_kernels.cpu_gemm.
set_bf16_dot`, no AMX): 30 cold SmolLM2 layers at 32 rows took 22.3 ms against oneDNN's 29.8, at 64 rows even
(39.8 / 39.7), at 256 rows 157 / 141 (AMD EPYC, 2 threads, ``bench_packed_linears.py --bf16-paths``)."""


NO_BF16_MATMUL = 1 << 62
""":func:`bf16_matmul_rows` where oneDNN has no bf16 GEMM (AVX2-only CPUs): the native GEMM serves every row count."""


def bf16_matmul_rows(native: NativeKernels) -> int:
    """From how many rows a bf16 :class:`NativeLinear` hands its input to oneDNN, for the path this process's
    bf16 GEMM runs now; :data:`NO_BF16_MATMUL` where oneDNN cannot run bf16 here."""
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        return NO_BF16_MATMUL
    dot = bool(native.gemm_bf16_dot(-1)) and not native.gemm_bf16_amx(-1)
    return BF16_DOT_MATMUL_ROWS if dot else BF16_MATMUL_ROWS


class NativeLinear(nn.Module):
    """``x @ W.T (+ bias)`` through the native GEMM on ``W`` packed once (fp32 or bf16, :mod:`tgi_paged_kernels.
    cpu_gemm`), for any rows; a bf16 ``x`` is widened, the fp32 result rounded back to bf16, or from
    :attr:`bf16_rows` rows, oneDNN's bf16 GEMM (:meth:`keep_dense`, as the per-op path computes it; the
    weight unpacked per call without it).

    Under ``torch.compile`` (the static step) it runs ``F.linear`` on an unpacked view instead."""

    def __init__(
        self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, native: NativeKernels,
        in_features: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.native = native
        self.resident_bytes = packed.numel() * packed.element_size()
        self.dense: PackedLinear | None = None
        self.bf16_rows = bf16_matmul_rows(native)
        """From this many bf16 rows, :attr:`dense` (oneDNN) serves the call (:func:`bf16_matmul_rows`)."""

    def keep_dense(self, linear: nn.Linear) -> None:
        """Serve bf16 inputs of many rows by ``linear`` (the module's own, same weight and bias) in oneDNN's layout
        (its bytes count there, :attr:`PackedLinear.resident_bytes`), where oneDNN runs bf16 (:func:`can_pack`;
        elsewhere the native GEMM serves every row count and nothing is kept)."""
        if self.bf16_rows != NO_BF16_MATMUL:
            self.dense = PackedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        bf16_matmul = x.dtype == torch.bfloat16 and rows.shape[0] >= self.bf16_rows
        if bf16_matmul or torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.bfloat16):
            if self.dense is not None and bf16_matmul and not torch.compiler.is_compiling():
                return self.dense(x)
            weight = unpack_weight(self.packed, self.out_features, self.in_features)
            return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = gemm_packed(self.native, rows.float(), self.packed, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class NativeInt8Linear(nn.Module):
    """:class:`NativeLinear` of int8 or fp8 codes (:func:`~tgi_paged_kernels.gemm_packed_int8`: dequantized in the
    tile), the layer's one copy of its weights; a bf16 input is widened and the output rounded back (fp32 sums);
    other inputs (compiled, fp16) run ``F.linear`` on them dequantized."""

    def __init__(self, packed: PackedInt8, bias: torch.Tensor | None, native: NativeKernels):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.native = native
        self.resident_bytes = sum(t.numel() * t.element_size() for t in (packed.codes, packed.zeros, packed.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.bfloat16) or rows.stride(-1) != 1:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, dequantized_int8(self.packed).to(x.dtype), bias)
        out = gemm_packed_int8(self.native, rows.float(), self.packed, self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
