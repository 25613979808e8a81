"""The load-time check of :mod:`.layers` (:func:`~.layers.wrap_native_layers`): random decode and
verify steps over scratch pools (:func:`check_metadata`), a layer called on one as the model calls it
(:func:`call_as_model`), and what a bf16 layer's check needs: the layer run in fp32 for a while, and the bf16
step's tolerance. Then the native projections that prefills run (:func:`own_proven`: a prefill before and after
the swap).

A bf16 layer is proven in two steps. First its description, on the layer in fp32 (:func:`fp32_params`: every
bf16 parameter and buffer widened in place, which is exact, and narrowed back after, which gives the same bits):
the native step on fp32-packed weights must give the module's output and K/V within :func:`fp32_close`, as for an
fp32 model.
Then the bf16 step (bf16-packed weights, bf16 hidden state, pools of the KV dtype) against the module's own
bf16 step, on the same bf16-valued inputs, both measured from the fp32 module's output on them
(:func:`bf16_step_close`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger
from torch import nn

from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata
from tgi_paged_backend.runner.cpu.fused_blocks import rope_table_width
from tgi_paged_backend.runner.input_batch import build_forward_batch, on_consecutive_blocks
from tgi_paged_backend.runner.parallel.row_parallel import local_sums
from tgi_paged_kernels import LayerWeights

if TYPE_CHECKING:
    from tgi_paged_backend.runner.native.layers import NativeDecoderLayer


BF16_EPS = 2.0**-8
"""bf16's rounding unit (half an ulp at the top of a binade, relative)."""
FP32_CHECK_TOLERANCE = 1e-4
"""The fp32 check's tolerance, relative and absolute (:func:`fp32_close`)."""
FP32_CHECK_SCALE_TOLERANCE = 2e-5
"""The fp32 check's absolute tolerance in units of the result's largest magnitude, where that is larger: fp32 sums
in another order differ by < 1e-6 of it on the tiny models and ~1e-5 on SmolLM2's layers of large activations
(values ~150 over inner sums of ~500: 1.4e-3 on a small value); a wrong description differs by more (GeLU-tanh
for GeLU: 1.2e-4 of it)."""


@contextmanager
def fp32_params(module: nn.Module) -> Iterator[None]:
    """``module``'s bf16 parameters and buffers widened to fp32 in place while the block runs, narrowed back
    after (bf16 -> fp32 -> bf16 is exact); tensors of other dtypes untouched. Each gets new storage both ways:
    what holds their addresses (a :class:`~tgi_paged_kernels.LayerLora`) is built after the block, not before."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.dtype == torch.bfloat16]
    for t in tensors:
        t.data = t.data.float()
    try:
        yield
    finally:
        for t in tensors:
            t.data = t.data.to(torch.bfloat16)


def bf16_step_close(native: torch.Tensor, per_op: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether the native bf16 step's result is as close to the fp32 module's (``exact``, on the same bf16-valued
    inputs and weights) as the module's own bf16 step is, within a factor two and two roundings:
    ``max|native - exact| <= 2 max|per_op - exact| + 2 * 2^-8 max|exact|``.

    The native step sums in fp32 and rounds once (its GEMM may round activations to bf16 first: a second rounding);
    the module rounds after every op, and at a given element may land closer by luck (SmolLM2's layer 2, values
    ~560: native one ulp off, per op 0.2): a right description lands well inside, a wrong packing or layout off by
    O(1)."""
    if native.shape != per_op.shape or native.shape != exact.shape:
        return False
    exact = exact.float()
    scale = exact.abs().max().item() if exact.numel() else 0.0
    native_error = (native.float() - exact).abs().max().item() if exact.numel() else 0.0
    per_op_error = (per_op.float() - exact).abs().max().item() if exact.numel() else 0.0
    return bool(native_error <= 2.0 * per_op_error + 2.0 * BF16_EPS * scale)


def check_lengths(block_size: int) -> tuple[int, ...]:
    """Contexts of the check's decode step: within a block, across blocks, and past the tests' windows of 8."""
    return (5, block_size + 3, 2 * block_size, 3 * block_size + 5)


def check_metadata(
    w: LayerWeights,
    layer_idx: int,
    block_size: int,
    rows: int = 1,
    dtype: torch.dtype = torch.float32,
    bf16_values: bool = False,
) -> PagedAttentionMetadata:
    """A decode step (``rows`` 1) or verify step (``rows`` new tokens per request) of :func:`check_lengths`
    requests over random pools of ``dtype`` (``bf16_values``: values rounded to bf16, whatever ``dtype`` holds
    them)."""
    lengths = check_lengths(block_size)
    chunks, block = on_consecutive_blocks([([0] * rows, length - rows) for length in lengths], block_size)
    generator = torch.Generator().manual_seed(layer_idx)
    shape = (block, block_size, w.num_kv_heads, w.head_dim)
    values = [torch.randn(shape, generator=generator) for _ in range(2)]
    pools = [(v.bfloat16() if bf16_values else v).to(dtype) for v in values]
    layers = layer_idx + 1
    return PagedAttentionMetadata(build_forward_batch(chunks, block_size), [pools[0]] * layers, [pools[1]] * layers)


def call_as_model(
    layer: nn.Module, wrapped: NativeDecoderLayer, x: torch.Tensor, tables: Any, metadata: PagedAttentionMetadata
) -> Any:
    """``layer`` (``wrapped`` or the layer it wraps) on one step as the model calls it: the metadata as a keyword
    and, for Falcon's layers (which pass none down), in the attention's channel; arguments the wrapped layer
    requires beyond these (Falcon's ``alibi``) None."""
    inner, channel = wrapped.layer, wrapped.channel
    given = {"position_embeddings": tables, "attention_mask": None, METADATA_KWARG: metadata}
    params = list(inspect.signature(inner.forward).parameters.values())[1:]
    required = [p.name for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    if channel is not None:
        channel.metadata = metadata
    try:
        return layer(x, **{name: None for name in required if name not in given}, **given)
    finally:
        if channel is not None:
            channel.metadata = None


def check_step(
    layer: nn.Module,
    wrapped: NativeDecoderLayer,
    block_size: int,
    rows: int = 1,
    lora: bool = False,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = torch.float32,
    bf16_values: bool = False,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``layer`` (``wrapped`` or the layer it wraps) on one random check step of :func:`check_lengths` requests:
    what it returns, and the K and V pools after it. ``rows`` > 1: a verify step of that many rows per request;
    ``lora``: rows of the base model and of each adapter mixed (when ``wrapped`` adds adapters natively); hidden
    state and tables in ``dtype``, pools in ``kv_dtype``; ``bf16_values``: every input rounded to bf16 first (the
    bf16 check's inputs, another seed)."""
    w = wrapped.weights
    tokens = rows * len(check_lengths(block_size))
    x, cos, sin = _random_inputs(wrapped, tokens, 1 if bf16_values else 0, dtype, bf16_values)
    step, slots = wrapped.lora_step, None
    if lora and step is not None and wrapped.lora is not None:
        slots = torch.arange(tokens) % (wrapped.lora.num_slots + 1) - 1
    routing = step.open(slots) if step is not None else nullcontext()
    meta = check_metadata(w, wrapped.layer_idx, block_size, rows, kv_dtype, bf16_values)
    with torch.inference_mode(), routing:
        out = call_as_model(layer, wrapped, x, (cos, sin), meta)
    return out, meta.k_caches[-1], meta.v_caches[-1]


def reproduces(
    layer: nn.Module, wrapped: NativeDecoderLayer, block_size: int, rows: int = 1, lora: bool = False
) -> bool:
    """Whether ``wrapped`` gives ``layer``'s output and K/V (:func:`fp32_close`) on one random fp32 check step
    (:func:`check_step`) that it ran natively (it learns there whether the layer returns a tuple)."""
    expected, *ref_kv = check_step(layer, wrapped, block_size, rows, lora)
    wrapped.as_tuple = isinstance(expected, tuple)
    steps = wrapped.native_steps
    got, *kv = check_step(wrapped, wrapped, block_size, rows, lora)
    if wrapped.native_steps == steps:  # the step fell back to the per-op path: nothing proven
        return False
    pairs = [(_output(expected), _output(got)), *zip(ref_kv, kv)]
    return all(a.shape == b.shape and fp32_close(a, b) for a, b in pairs)


def fp32_close(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """``got`` within :data:`FP32_CHECK_TOLERANCE` of ``expected``, relative and absolute; where
    :data:`FP32_CHECK_SCALE_TOLERANCE` of ``max|expected|`` is larger, within that at every element (no relative
    term on top: the largest values are held to it too)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    scaled = FP32_CHECK_SCALE_TOLERANCE * scale
    if scaled <= FP32_CHECK_TOLERANCE:
        return torch.allclose(expected, got, rtol=FP32_CHECK_TOLERANCE, atol=FP32_CHECK_TOLERANCE)
    return torch.allclose(expected, got, rtol=0.0, atol=scaled)


def bf16_step(
    layer: nn.Module,
    wrapped: NativeDecoderLayer,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    rows: int = 1,
    lora: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer`` (or ``wrapped``) on the bf16 check's step (:func:`check_step` on bf16 values) in ``dtype`` over
    pools of ``kv_dtype``: its output and the K and V pools after it."""
    out, k, v = check_step(layer, wrapped, block_size, rows, lora, dtype, kv_dtype, True)
    return _output(out), k, v


def reproduces_bf16(
    layer: nn.Module,
    wrapped: NativeDecoderLayer,
    block_size: int,
    kv_dtype: torch.dtype,
    exact: tuple,
    rows: int = 1,
    lora: bool = False,
) -> bool:
    """Whether ``wrapped`` (bf16 weights) runs the bf16 check's step natively, as close to the fp32 module's
    results ``exact`` (the same step: :func:`bf16_step` in fp32) as the bf16 module's own step
    (:func:`bf16_step_close`), output and K/V."""
    per_op = bf16_step(layer, wrapped, block_size, torch.bfloat16, kv_dtype, rows, lora)
    steps = wrapped.native_steps
    native = bf16_step(wrapped, wrapped, block_size, torch.bfloat16, kv_dtype, rows, lora)
    if wrapped.native_steps == steps:
        return False
    return all(bf16_step_close(*triple) for triple in zip(native, per_op, exact))


def prefill_output(
    layer: nn.Module,
    wrapped: NativeDecoderLayer,
    block_size: int,
    bf16_values: bool,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``layer``'s output on a prefill of two whole prompts (across blocks) over fresh pools, inputs in ``dtype``
    (rounded to bf16 first for a bf16 model's check): :func:`own_proven`'s step."""
    w = wrapped.weights
    lengths = (block_size + 3, 3 * block_size + 5)
    chunks, blocks = on_consecutive_blocks([([0] * n, 0) for n in lengths], block_size)
    x, cos, sin = _random_inputs(wrapped, sum(lengths), 2, dtype, bf16_values)
    pools = [torch.zeros(blocks, block_size, w.num_kv_heads, w.head_dim, dtype=kv_dtype) for _ in range(2)]
    layers = wrapped.layer_idx + 1
    meta = PagedAttentionMetadata(build_forward_batch(chunks, block_size), [pools[0]] * layers, [pools[1]] * layers)
    with torch.inference_mode():
        return _output(call_as_model(layer, wrapped, x, (cos, sin), meta))


def own_proven(
    child: nn.Module,
    candidate: NativeDecoderLayer,
    block_size: int,
    kv_dtype: torch.dtype,
    exact: torch.Tensor | None = None,
) -> NativeDecoderLayer | str:
    """``candidate`` with its projections swapped for the native ones
    (:meth:`~.layers.NativeDecoderLayer.own_projections`) where a prefill through them (prefills, chunks and
    recompute run them) gives the module's own: fp32 as :func:`fp32_close`; bf16 as close to the fp32 module's as
    the module's own bf16 prefill is (``exact``: the fp32 module's, :func:`prefill_output` on bf16 values, taken
    under :func:`fp32_params` before the bf16 candidate was built; :func:`bf16_step_close`: the module's
    projections may round weights to bf16, ours dequantize int8/fp8 codes into fp32). Else why not (the originals
    put back). A projection that reads its weights wrongly is off by O(1)."""
    bf16 = exact is not None
    with local_sums(candidate):
        try:
            dtype = torch.bfloat16 if bf16 else torch.float32
            before = prefill_output(child, candidate, block_size, bf16, dtype, kv_dtype)
            candidate.own_projections()
            after = prefill_output(child, candidate, block_size, bf16, dtype, kv_dtype)
            same = bf16_step_close(after, before, exact) if exact is not None else fp32_close(before, after)
        except Exception as e:  # noqa: BLE001 - any failure means: keep the Python path
            logger.debug("layer {} projections kept: {}: {}", type(child).__name__, type(e).__name__, e)
            same = False
    if not same:
        candidate.restore_projections()
        return "its prefill through the native projections differs"
    return candidate


def _random_inputs(
    wrapped: NativeDecoderLayer, tokens: int, seed: int, dtype: torch.dtype, bf16_values: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A check step's hidden state and RoPE tables ``[1, tokens, *]`` in ``dtype``: random values from ``seed``,
    rounded to bf16 first with ``bf16_values``."""
    w = wrapped.weights
    table = rope_table_width(wrapped.rope, w.form.rotary_dim or w.head_dim)
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, tokens, width, generator=generator) for width in (w.hidden_size, table, table)]
    x, cos, sin = ((t.bfloat16() if bf16_values else t).to(dtype) for t in inputs)
    return x, cos, sin


def _output(returned: Any) -> torch.Tensor:
    """A decoder layer's output: the tensor, or the first of the tuple older transformers return."""
    return returned[0] if isinstance(returned, tuple) else returned
