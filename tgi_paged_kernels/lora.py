"""Batched multi-LoRA: add each row's own adapter delta to a base layer's output, many adapters per batch.

Every row (token) of a batch names a *slot* of the resident adapter stacks, or ``-1`` for none, and
gets ``scale[s] * (x @ A[s]^T) @ B[s]^T`` added to the base output: one launch pair per layer serves
a batch that mixes adapters (the BGMV scheme of Chen et al., "Punica: Multi-Tenant LoRA Serving",
2023; the code here is this project's own). Layouts::

    x           : [T, in_features], float16/bfloat16/float32
    token_slots : int64 (or int32) [T], adapter slot per row; negative (-1) = no adapter
    a_stack     : [S, R, in_features], LoRA A of every slot; a slot of rank r < R has zero rows r..R-1
    b_stack     : [S, out_features, R], LoRA B of every slot; zero columns r..R-1 likewise
    scales      : float32 [S], per slot ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` for rsLoRA)

Zero padding adds exact zeros to the sums, so padded ranks change nothing.

Two implementations, one contract:

- :func:`lora_delta_reference`: the specification, in fp32 (one matmul pair per distinct slot);
- :func:`add_lora_triton`: the Triton kernels for CUDA tensors (and the interpreter on CPU):
  :func:`lora_shrink` (``xa = x @ A[s]^T``, fp32 ``[T, R]``) then :func:`lora_expand_`
  (``out += scale[s] * xa @ B[s]^T``). Each program reads one row's slot, so rows of different
  adapters share a launch; the rank is small, so the products are ``tl.sum`` reductions, no ``tl.dot``.

Triton is imported only if installed (Linux only): without it the reference still works and the
kernels are plain, uncalled functions.
"""

from __future__ import annotations

import torch

from ._checks import QUERY_DTYPES, cdiv, check_index, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU serving on a platform without Triton: only the reference is usable
    triton = None

MAX_BLOCK_RANK = 16  # rank positions per shrink program / per expand step; LoRA ranks are 8..64
MAX_BLOCK_IN = 128  # input features per shrink step: a [16, 128] fp32 tile of A
MAX_BLOCK_OUT = 64  # output features per expand program: a [64, 16] fp32 tile of B


def _jit(fn):
    """``triton.jit`` where Triton is installed; the plain function elsewhere (never launched there)."""
    return fn if triton is None else triton.jit(fn)


def check_lora(
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument unless shapes, dtypes and devices fit (reads no values)."""
    if x.dim() != 2 or x.dtype not in QUERY_DTYPES:
        raise ValueError(f"x must be a 2-D tensor of one of {QUERY_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    num_rows, in_features = x.shape
    if a_stack.dim() != 3 or a_stack.shape[2] != in_features or a_stack.dtype not in QUERY_DTYPES:
        raise ValueError(
            f"a_stack must be a float [slots, rank, {in_features}] tensor, got {a_stack.dtype} {tuple(a_stack.shape)}"
        )
    num_slots, rank = a_stack.shape[0], a_stack.shape[1]
    if b_stack.dim() != 3 or (b_stack.shape[0], b_stack.shape[2]) != (num_slots, rank):
        raise ValueError(f"b_stack must be [{num_slots}, out_features, {rank}], got {tuple(b_stack.shape)}")
    if b_stack.dtype not in QUERY_DTYPES:
        raise ValueError(f"b_stack dtype must be one of {QUERY_DTYPES}, got {b_stack.dtype}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (num_slots,):
        raise ValueError(f"scales must be float32 [{num_slots}], got {scales.dtype} {tuple(scales.shape)}")
    check_index("token_slots", token_slots, (num_rows,), x.device)
    if out is not None and (
        tuple(out.shape) != (num_rows, b_stack.shape[1]) or out.dtype not in QUERY_DTYPES or out.device != x.device
    ):
        raise ValueError(
            f"out must be a float tensor of shape {(num_rows, b_stack.shape[1])} on {x.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    devices = {t.device for t in (x, a_stack, b_stack, scales)}
    if len(devices) != 1:
        raise ValueError(f"x, a_stack, b_stack and scales must be on one device, got {sorted(map(str, devices))}")


def lora_delta_reference(
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """The specification: each row's adapter delta, computed in fp32.

    Parameters
    ----------
    x, token_slots, a_stack, b_stack, scales : see the module docstring; every slot must be ``< S``

    Returns
    -------
    [T, out_features] in ``x.dtype``: row t with slot ``s >= 0`` holds
    ``scales[s] * ((x[t] @ a_stack[s].T) @ b_stack[s].T)`` (fp32, rounded once); other rows are zero.
    """
    check_lora(x, token_slots, a_stack, b_stack, scales)
    num_slots = a_stack.shape[0]
    delta = torch.zeros(x.shape[0], b_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        if slot >= num_slots:
            raise ValueError(f"token_slots holds slot {slot}, but the stacks have {num_slots} slots")
        rows = token_slots == slot
        xa = x[rows].float() @ a_stack[slot].float().T
        delta[rows] = (xa @ b_stack[slot].float().T) * scales[slot].float()
    return delta.to(x.dtype)


@_jit
def _lora_shrink_kernel(
    x_ptr,
    stride_xt,
    stride_xk,  #
    slots_ptr,  #
    a_ptr,
    stride_as,
    stride_ar,
    stride_ak,  #
    xa_ptr,
    stride_xat,
    stride_xar,  #
    in_features,
    rank,  #
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    xa_ptrs = xa_ptr + row * stride_xat + offs_r * stride_xar
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # No adapter (slot < 0): every load is masked off, so xa is zero and the row's delta is zero whatever
    # reads it (masks, not an early return: one code path for the compiler).
    r_mask_a = r_mask & ((offs_r * 0 + slot) >= 0)
    slot = tl.maximum(slot, 0)

    # -- xa[row, r] = sum_k x[row, k] * A[slot, r, k], over k in BLOCK_K steps (masked tail) ----------
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xt
    a_rows = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        xk = tl.load(x_row + k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask_a[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    tl.store(xa_ptrs, acc, mask=r_mask)


@_jit
def _lora_expand_kernel(
    xa_ptr,
    stride_xat,
    stride_xar,  #
    slots_ptr,  #
    b_ptr,
    stride_bs,
    stride_bn,
    stride_br,  #
    scales_ptr,  #
    out_ptr,
    stride_ot,
    stride_on,  #
    out_features,
    rank,  #
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # No adapter (slot < 0): every load and the store are masked off, so out's row stays as it is.
    n_mask = (offs_n < out_features) & ((offs_n * 0 + slot) >= 0)
    slot = tl.maximum(slot, 0)

    # -- delta[n] = sum_r xa[row, r] * B[slot, n, r], over r in BLOCK_R steps (masked tail) -----------
    offs_r = tl.arange(0, BLOCK_R)
    xa_row = xa_ptr + row * stride_xat
    b_rows = b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + offs_r
        r_mask = r < rank
        xa = tl.load(xa_row + r * stride_xar, mask=r_mask, other=0.0)
        b = tl.load(b_rows + r[None, :] * stride_br, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * xa[None, :], axis=1)

    # -- out += scale * delta, added in fp32 and rounded once to out's dtype ----------------------------
    scale = tl.load(scales_ptr + slot)
    out_ptrs = out_ptr + row * stride_ot + offs_n * stride_on
    base = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + scale * acc).to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_shrink(x: torch.Tensor, token_slots: torch.Tensor, a_stack: torch.Tensor) -> torch.Tensor:
    """First half of the delta on the Triton path: each row times its slot's A.

    Parameters
    ----------
    x : [T, in_features], float16/bfloat16/float32, any strides
    token_slots : int64 (or int32) [T], slot per row in ``[0, S)``, or negative for no adapter
    a_stack : [S, R, in_features], float16/bfloat16/float32, any strides

    Returns
    -------
    xa : float32 [T, R], ``x[t] @ a_stack[s].T`` accumulated in fp32; zero rows where the slot is negative
    """
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"x [T, K] and a_stack [S, R, K] do not fit: {tuple(x.shape)}, {tuple(a_stack.shape)}")
    check_index("token_slots", token_slots, (x.shape[0],), x.device)
    if a_stack.device != x.device:
        raise ValueError(f"a_stack is on {a_stack.device}, x on {x.device}")
    num_rows, in_features = x.shape
    rank = a_stack.shape[1]
    xa = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    if num_rows == 0 or rank == 0:
        return xa
    block_r = min(next_power_of_2(rank), MAX_BLOCK_RANK)
    _lora_shrink_kernel[(num_rows, cdiv(rank, block_r))](
        x, *x.stride(),  #
        token_slots,  #
        a_stack, *a_stack.stride(),  #
        xa, *xa.stride(),  #
        in_features, rank,  #
        BLOCK_R=block_r, BLOCK_K=min(next_power_of_2(in_features), MAX_BLOCK_IN),  #
    )  # fmt: skip
    return xa


def lora_expand_(
    out: torch.Tensor, xa: torch.Tensor, token_slots: torch.Tensor, b_stack: torch.Tensor, scales: torch.Tensor
) -> None:
    """Second half on the Triton path, in place: ``out[t] += scales[s] * (xa[t] @ b_stack[s].T)``.

    Parameters
    ----------
    out : [T, out_features], float16/bfloat16/float32, any strides (e.g. a column slice of a fused
        projection's output); each sum is taken in fp32 and rounded once to ``out.dtype``; rows whose
        slot is negative are not touched
    xa : float32 [T, R], from :func:`lora_shrink`
    token_slots : int64 (or int32) [T], as for :func:`lora_shrink`
    b_stack : [S, out_features, R], float16/bfloat16/float32, any strides
    scales : float32 [S]
    """
    num_rows, rank = xa.shape
    num_slots, out_features = b_stack.shape[0], b_stack.shape[1]
    if xa.dtype != torch.float32 or b_stack.dim() != 3 or b_stack.shape[2] != rank:
        raise ValueError(
            f"xa must be float32 [T, R] and b_stack [S, N, R], got {xa.dtype} {tuple(xa.shape)}, {tuple(b_stack.shape)}"
        )
    if tuple(out.shape) != (num_rows, out_features) or out.dtype not in QUERY_DTYPES:
        raise ValueError(f"out must be a float [{num_rows}, {out_features}] tensor, got {out.dtype} {tuple(out.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (num_slots,):
        raise ValueError(f"scales must be float32 [{num_slots}], got {scales.dtype} {tuple(scales.shape)}")
    check_index("token_slots", token_slots, (num_rows,), out.device)
    if len({t.device for t in (out, xa, b_stack, scales)}) != 1:
        raise ValueError("out, xa, b_stack and scales must be on one device")
    if num_rows == 0 or rank == 0 or out_features == 0:
        return
    block_n = min(next_power_of_2(out_features), MAX_BLOCK_OUT)
    _lora_expand_kernel[(num_rows, cdiv(out_features, block_n))](
        xa, *xa.stride(),  #
        token_slots,  #
        b_stack, *b_stack.stride(),  #
        scales,  #
        out, *out.stride(),  #
        out_features, rank,  #
        BLOCK_N=block_n, BLOCK_R=min(next_power_of_2(rank), MAX_BLOCK_RANK),  #
    )  # fmt: skip


def add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Add each row's adapter delta to ``out`` in place: :func:`lora_shrink`, then :func:`lora_expand_`.

    Parameters
    ----------
    out : [T, out_features], float16/bfloat16/float32, the base layer's output; any strides, so a
        column slice of a wider tensor (one projection of a fused QKV / gate-up output) works in place
    x, token_slots, a_stack, b_stack, scales : see the module docstring; slots must be ``< S``
        (not checked: that would read device values)

    ``out`` ends as ``out + lora_delta_reference(...)`` up to summation order and the one rounding.
    """
    check_lora(x, token_slots, a_stack, b_stack, scales, out=out)
    lora_expand_(out, lora_shrink(x, token_slots, a_stack), token_slots, b_stack, scales)
