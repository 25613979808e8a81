"""No-gather paged decode attention on CPU: one plain-torch function, compiled by inductor.

:func:`decode_attention_math` states decode attention over the paged pool in plain torch: each
request's K/V is indexed through its block table (``k_cache[block_tables]``), scores are a product
and a sum over ``head_dim``, and the softmax, soft-cap, sliding window, sinks and fp8 dequantization
are elementwise around them. Run eagerly it is the readable reference (it materialises the indexed
K/V); compiled by ``torch.compile`` (inductor's C++ backend, dynamic shapes) the indexing becomes an
indirect load inside the score and output loops, so no layer ever copies a request's context: the
kernel reads the blocks where they lie, once for K and once for V. One compiled graph serves every
batch size and context length (dynamic shapes; sizes 0 and 1 get their own), and it is built once per
process and per model geometry (minutes saved by inductor's on-disk cache on later starts).

Rows a query must not see (past ``seq_len``, before the window, or in a block nobody owns) are
removed with ``where`` before any arithmetic touches them, so NaN or garbage in unowned pool slots
never reaches the output. Math is fp32 whatever the cache dtype, as in the other CPU paths.

:func:`compiled_decode_attention` returns the compiled function, or ``None`` when this torch cannot
compile here (no C++ compiler, an old torch); the caller then takes the gather + SDPA path of
:mod:`.cpu_attention`, which computes the same thing.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def decode_attention_math(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """fp32 ``[B, Hq, Dv]``: each request's one query (at position ``seq_lens[b] - 1``) over its paged K/V.

    ``query`` ``[B, Hq, D]`` (any strides); caches ``[num_blocks, block_size, Hkv, D]`` (V: ``Dv <= D``, any
    view); ``block_tables`` int64 ``[B, nb]`` covering every position ``< seq_lens[b]`` (extra columns are never read);
    ``sinks`` fp32 ``[Hq]`` or ``None``; ``softcap`` 0 disables capping.
    """
    num_requests, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    positions = block_tables.shape[1] * block_size
    pos = torch.arange(positions, device=query.device)
    lens = seq_lens.long()[:, None]
    visible = pos[None, :] < lens  # [B, P]
    if sliding_window is not None:
        visible = visible & (pos[None, :] >= lens - sliding_window)
    keys = k_cache[block_tables].view(num_requests, positions, num_kv_heads, 1, head_dim).float()
    v_head_dim = v_cache.shape[3]
    values = v_cache[block_tables].view(num_requests, positions, num_kv_heads, 1, v_head_dim).float()
    if k_cache.element_size() == 1:  # fp8 pools store x / scale
        keys = keys * k_scale
        values = values * v_scale
    q = query.float().reshape(num_requests, 1, num_kv_heads, group, head_dim)
    scores = (q * keys).sum(-1) * scale  # [B, P, Hkv, G]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = torch.where(visible[:, :, None, None], scores, float("-inf"))
    peak = scores.amax(dim=1)  # [B, Hkv, G]
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group)
        peak = torch.maximum(peak, sink)
    weights = torch.exp(scores - peak[:, None])
    denominator = weights.sum(dim=1)
    if sinks is not None:
        denominator = denominator + torch.exp(sink - peak)
    weights = weights / denominator[:, None]
    weighted = torch.where(visible[:, :, None, None, None], weights[..., None] * values, 0.0)
    return weighted.sum(dim=1).reshape(num_requests, num_q_heads, v_head_dim)


class CompiledDecode:
    """The compiled :func:`decode_attention_math`, turned off for the process when compiling fails.

    Compilation happens at the first call (seconds; Warmup makes that call). When it fails (no C++
    compiler for inductor, an unsupported torch) the failure is logged once and :meth:`__call__` returns
    ``None`` from then on, so the caller's gather + SDPA path serves instead. A failure the input causes
    (a query that does not fit the pool, a block id outside it) is not a compile failure: the eager math
    fails on it too, and that error is raised, the same for the same input on every call; the kernel stays on.
    """

    def __init__(self, backend: Any = "inductor") -> None:
        self._fn = torch.compile(decode_attention_math, backend=backend, dynamic=False, fullgraph=True)
        self.failed: str | None = None

    def __call__(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, *options: Any,
    ) -> torch.Tensor | None:  # fmt: skip
        """:func:`decode_attention_math` compiled, or ``None`` once compiling has failed in this process.

        Raises what the eager :func:`decode_attention_math` raises for an input it cannot take."""
        if self.failed is not None:
            return None
        if torch.compiler.is_compiling():  # inside a compiled step: trace the math into the outer graph
            return decode_attention_math(query, k_cache, v_cache, block_tables, seq_lens, *options)
        given = (query, k_cache, v_cache, block_tables, seq_lens, *options)
        try:
            num_requests = query.shape[0]
            # Sizes 0 and 1 get graphs of their own under dynamic shapes: give the kernel >= 2 requests and
            # >= 2 block columns (a repeated row, a column of the scratch block that no position reaches).
            if num_requests == 1:
                query, block_tables, seq_lens = query.expand(2, -1, -1), block_tables.expand(2, -1), seq_lens.expand(2)
            if block_tables.shape[1] == 1:
                block_tables = torch.cat([block_tables, torch.zeros_like(block_tables)], dim=1)
            # Dynamic: batch size, block-table width, pool size. Static: heads, head_dim, block size, so the
            # generated loops are specialised (vectorised) for this model's geometry.
            dynamic = ((query, (0,)), (block_tables, (0, 1)), (seq_lens, (0,)), (k_cache, (0,)), (v_cache, (0,)))
            for tensor, dims in dynamic:
                for dim in dims:
                    torch._dynamo.mark_dynamic(tensor, dim)
            return self._fn(query, k_cache, v_cache, block_tables, seq_lens, *options)[:num_requests]
        except Exception as e:  # noqa: BLE001 - told apart below: the input's fault or the compiler's
            failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            compiler_failed = isinstance(e, _compile_failures())
        if not compiler_failed:
            # Dynamo reports a bad input as an error of its own (a fake-tensor TorchRuntimeError) or as what
            # the generated code's checks raise, so that type does not say whose fault it is; the eager math
            # does. Run on the same input outside the handler, it raises the input's own error (what the eager
            # path raises) and the kernel stays on; when it succeeds, compiling is what failed.
            decode_attention_math(*given)
        self.failed = failure
        logger.warning("compiled CPU decode attention off, gather + SDPA serves instead (%s)", self.failed)
        return None


def _compile_failures() -> tuple[type[BaseException], ...]:
    """Dynamo's errors for a failed compile: the backend (inductor: no C++ compiler, a lowering bug) raised,
    or dynamo cannot trace the math (an older torch). Not raised for an input's fault."""
    from torch._dynamo import exc

    return (exc.BackendCompilerFailed, exc.Unsupported, exc.InternalTorchDynamoError)


@functools.cache
def compiled_decode_attention() -> CompiledDecode:
    """The process's one :class:`CompiledDecode` (dynamo keeps one graph cache per function anyway)."""
    return CompiledDecode()
