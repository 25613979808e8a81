"""The static decode step: fixed-shape decode inputs that a CUDA graph can capture and torch.compile trace.

A decode batch of ``B`` requests runs as the smallest *bucket* (a ``CUDA_GRAPHS`` batch size) that
holds it. Its inputs are copied into buffers allocated once for the largest bucket
(:class:`StaticDecodeInputs`), and each bucket's forward reads the same fixed views of those buffers,
so a graph captured once per bucket replays new inputs once the buffers are refilled. Block tables
are padded to a fixed width: the most blocks one request can hold (``max_total_tokens`` at Warmup).

Padding rows ``B .. bucket-1`` are harmless: token 0 at position 0 writes its K/V into slot 0, which
belongs to the scratch block (block 0, never handed out: :mod:`tgi_paged_backend.memory.block_pool`),
and attends over that one position; their logits are dropped.

With KV layer groups (:mod:`tgi_paged_backend.memory.layer_groups`) the buffers hold a slot mapping and
a block table per group past the first, padded the same way, and each layer reads its group's (the
metadata's ``layer_groups``): a sliding group's holes are scratch entries behind its window, which the
kernels never read and the padded CPU plan masks.

Inside the forward no tensor value is read on the host and no Python branch depends on one: the
attention metadata is marked ``static``, so the CPU decode plan is the padded one built from shapes
(``plan_decode_gather(padded=True)``), and on CUDA the Triton kernels choose their split from shapes.
:class:`StaticDecodeStep` runs a bucket eagerly (the reference), through ``torch.compile``
(:meth:`StaticDecodeStep.compile`), or as the replay of its CUDA graph (:mod:`.cuda_graphs`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from loguru import logger

from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata, mask_placeholder
from tgi_paged_backend.runner.input_batch import ForwardBatch, layout_tokens

StaticViews = tuple[torch.Tensor, ...]
"""One bucket's inputs in :data:`VIEW_NAMES` order, views of :class:`StaticDecodeInputs`' buffers."""

CPU_COMPILE_BUCKETS = tuple(range(2, 257))
"""``TGI_PAGED_COMPILE``: decode batches of 2..256 rows run through the compiled step (one row is padded
to two, more than 256 run eagerly); one graph serves them all (``compile(dynamic_rows=True)``)."""

VIEW_NAMES = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")
"""The :class:`ForwardBatch` fields of a static step, in the order the forward takes them; with layer
groups the slot mappings of groups 1, 2, ... follow, then their block tables."""


def choose_bucket(buckets: Sequence[int], batch_size: int) -> int | None:
    """The smallest of ``buckets`` (ascending) holding ``batch_size`` rows; ``None`` above the largest."""
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


def blocks_per_request(max_seq_len: int, block_size: int) -> int:
    """Block-table width of the static step: the blocks one request of ``max_seq_len`` tokens holds."""
    return max(1, -(-max_seq_len // block_size))


class StaticDecodeInputs:
    """Decode inputs of up to ``max_batch`` requests of up to ``max_blocks`` blocks, allocated once.

    ``input_ids``, ``positions``, ``slot_mapping`` (int64 ``[max_batch]``), ``seq_lens`` (int32
    ``[max_batch]``) and the block tables are refilled each step (:meth:`fill`); ``query_start_loc``
    (int32 ``0..max_batch``) and ``logits_indices`` (int64 ``0..max_batch-1``) never change: one token
    and one logits row per request. The block tables of a step are a contiguous ``[bucket, width]``
    view of one flat int32 buffer per group (``table_storage``), so every width gives the same strides.
    ``num_groups`` > 1 (KV layer groups): ``group_slot_mappings`` and ``table_storage`` hold one more
    buffer per group past the first. Allocated all padding.
    """

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, num_groups: int = 1) -> None:
        if max_batch < 1 or max_blocks < 1 or num_groups < 1:
            raise ValueError(
                f"static decode inputs need max_batch, max_blocks and num_groups >= 1, "
                f"got {max_batch}, {max_blocks}, {num_groups}"
            )
        self.max_batch, self.max_blocks, self.device = max_batch, max_blocks, device
        self.num_groups = num_groups
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.group_slot_mappings = [
            torch.zeros(max_batch, dtype=torch.int64, device=device) for _ in range(num_groups - 1)
        ]
        self.table_storage = [
            torch.zeros(max_batch * max_blocks, dtype=torch.int32, device=device) for _ in range(num_groups)
        ]
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        # One token and one logits row per request, whatever the step holds.
        layout = layout_tokens(np.zeros(max_batch, dtype=np.int64), np.ones(max_batch, dtype=np.int64))
        self.query_start_loc = torch.from_numpy(layout.query_start_loc).to(device=device, dtype=torch.int32)
        self.logits_indices = torch.from_numpy(layout.logits_indices).to(device)
        self._views: dict[tuple[int, int], StaticViews] = {}

    @staticmethod
    def _tables(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        return (batch.block_tables, *batch.group_block_tables)

    def used_width(self, batch: ForwardBatch) -> int:
        """The widest block table of ``batch`` over its groups."""
        return max(int(table.shape[1]) for table in self._tables(batch))

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a decode batch these buffers hold (rows, groups, block-table width)."""
        return (
            batch.is_decode
            and batch.num_requests <= self.max_batch
            and 1 + len(batch.group_block_tables) == self.num_groups
            and self.used_width(batch) <= self.max_blocks
            and batch.device == self.device
        )

    def block_tables(self, bucket: int, width: int, group: int = 0) -> torch.Tensor:
        """Group ``group``'s block tables of a ``bucket`` x ``width`` step (a contiguous view of its
        ``table_storage``)."""
        return self.table_storage[group][: bucket * width].view(bucket, width)

    def fill(self, batch: ForwardBatch, bucket: int, width: int) -> None:
        """Copy ``batch`` (``B <= bucket`` decode rows that :meth:`fits`, tables at most ``width`` wide)
        into rows ``0..B-1``; rows ``B..bucket-1`` become padding (token 0 at position 0 in the scratch
        slot 0, length 1, table all scratch block), in every group."""
        b, used = batch.num_requests, self.used_width(batch)
        if not (self.fits(batch) and b <= bucket <= self.max_batch and used <= width <= self.max_blocks):
            raise ValueError(f"a decode batch of {b} rows x {used} blocks does not fit {bucket} x {width}")
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            getattr(self, name)[:b].copy_(getattr(batch, name), non_blocking=True)
        for buffer, slots in zip(self.group_slot_mappings, batch.group_slot_mappings, strict=True):
            buffer[:b].copy_(slots, non_blocking=True)
        for group, source in enumerate(self._tables(batch)):
            table = self.block_tables(bucket, width, group)
            table.zero_()
            table[:b, : source.shape[1]].copy_(source, non_blocking=True)
        self._pad_rows(b, bucket)

    def pad(self, bucket: int, width: int) -> None:
        """Make all ``bucket`` rows padding rows (warm-up and capture)."""
        for group in range(self.num_groups):
            self.block_tables(bucket, width, group).zero_()
        self._pad_rows(0, bucket)

    def _pad_rows(self, start: int, stop: int) -> None:
        for buffer in (self.input_ids, self.positions, self.slot_mapping, *self.group_slot_mappings):
            buffer[start:stop].zero_()
        self.seq_lens[start:stop].fill_(1)

    def views(self, bucket: int, width: int) -> StaticViews:
        """The first ``bucket`` rows, tables ``width`` wide, in :data:`VIEW_NAMES` order, then the groups'
        slot mappings and tables (the same view objects for the same arguments)."""
        if not (1 <= bucket <= self.max_batch and 1 <= width <= self.max_blocks):
            raise ValueError(f"{bucket} x {width} outside {self.max_batch} x {self.max_blocks}")
        key = (bucket, width)
        if key not in self._views:
            rows = {name: getattr(self, name)[:bucket] for name in VIEW_NAMES if name != "block_tables"}
            rows["query_start_loc"] = self.query_start_loc[: bucket + 1]
            rows["block_tables"] = self.block_tables(bucket, width)
            groups = range(1, self.num_groups)
            self._views[key] = (
                *(rows[name] for name in VIEW_NAMES),
                *(self.group_slot_mappings[g - 1][:bucket] for g in groups),
                *(self.block_tables(bucket, width, g) for g in groups),
            )
        return self._views[key]


def batch_of_views(views: Sequence[torch.Tensor]) -> ForwardBatch:
    """The decode :class:`ForwardBatch` a static step's views (:meth:`StaticDecodeInputs.views`) stand for."""
    base: dict[str, Any] = dict(zip(VIEW_NAMES, views[: len(VIEW_NAMES)], strict=True))
    extra = views[len(VIEW_NAMES) :]
    half = len(extra) // 2
    return ForwardBatch(
        **base,
        is_decode=True,
        group_slot_mappings=tuple(extra[:half]),
        group_block_tables=tuple(extra[half:]),
    )


class StaticDecodeStep:
    """The model's decode forward over :class:`StaticDecodeInputs`, one callable per bucket.

    Parameters
    ----------
    model : torch.nn.Module
        The loaded causal LM (paged attention registered).
    k_caches, v_caches : list[torch.Tensor]
        The pool the forward writes and reads (a captured graph holds their addresses).
    k_scale, v_scale : float
        fp8 KV scales.
    buckets : Sequence[int]
        Batch sizes, ascending and distinct; the buffers hold the largest.
    max_blocks : int
        Most block-table columns a request may use (:func:`blocks_per_request`).
    fixed_width : bool
        Every step reads all ``max_blocks`` columns (what a CUDA graph needs; on CUDA the kernels
        stop at each request's length anyway). Otherwise a step reads as many columns as its batch's
        table has (at least 2): the CPU paths' work grows with the width, and ``torch.compile`` then
        keeps the width dynamic (:meth:`compile`).
    layer_groups : tuple[int, ...], optional
        With KV layer groups: each layer's group (the pool is laid out for them, and every batch
        carries the block tables of every group); ``None``: one group.

    Attributes
    ----------
    runs : dict[int, Callable[..., torch.Tensor]]
        Per bucket, what computes float32 logits ``[bucket, vocab]`` from the bucket's views of the
        buffers: the eager :meth:`forward_views` until :meth:`compile` or a graph capture (which
        ignores its arguments: the graph reads the buffers) replaces it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        k_scale: float,
        v_scale: float,
        buckets: Sequence[int],
        max_blocks: int,
        fixed_width: bool = True,
        layer_groups: tuple[int, ...] | None = None,
    ) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct sizes >= 1, ascending, got {tuple(buckets)}")
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.k_scale, self.v_scale = k_scale, v_scale
        self.buckets = tuple(buckets)
        self.fixed_width = fixed_width
        self.layer_groups = layer_groups
        self.device = k_caches[0].device
        num_groups = 1 + max(layer_groups) if layer_groups else 1
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_blocks, self.device, num_groups)
        self._mask = mask_placeholder(self.device, next(model.parameters()).dtype)
        self.runs: dict[int, Callable[..., torch.Tensor]] = dict.fromkeys(self.buckets, self.forward_views)
        self.counts: dict[int, int] = dict.fromkeys(self.buckets, 0)
        """Steps :meth:`run` ran per bucket."""

    def forward_views(self, *views: torch.Tensor) -> torch.Tensor:
        """Logits (float32 ``[rows, vocab]``) of a static decode batch given as :data:`VIEW_NAMES` tensors.

        This is what ``torch.compile`` traces and a CUDA graph captures: shapes come from the views only.
        """
        batch = batch_of_views(views)
        metadata = PagedAttentionMetadata(
            batch, self.k_caches, self.v_caches, self.k_scale, self.v_scale, static=True,
            layer_groups=self.layer_groups if batch.group_block_tables else None,
        )  # fmt: skip
        out = self.model(
            input_ids=batch.input_ids.unsqueeze(0),
            position_ids=batch.positions.unsqueeze(0),
            attention_mask=self._mask,
            use_cache=False,
            logits_to_keep=batch.logits_indices,
            return_dict=True,
            **{METADATA_KWARG: metadata},
        )
        return out.logits[0].float()

    def forward(self, bucket: int) -> torch.Tensor:
        """Eager forward of the first ``bucket`` rows of the buffers, tables ``max_blocks`` wide."""
        return self.forward_views(*self.inputs.views(bucket, self.inputs.max_blocks))

    def width(self, batch: ForwardBatch) -> int:
        """Block-table columns the step of ``batch`` reads: all, or (not ``fixed_width``) the batch's own
        width, at least 2 (a width of 1 would be a shape torch.compile specializes)."""
        if self.fixed_width:
            return self.inputs.max_blocks
        return min(max(self.inputs.used_width(batch), 2), self.inputs.max_blocks)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits of ``batch`` (float32 ``[K, vocab]`` for its ``logits_indices``, a copy) through its
        bucket; ``None`` when the batch has none (a prefill, more rows than the largest bucket, a wider
        block table): the caller runs it eagerly."""
        if not self.inputs.fits(batch):
            return None
        bucket = choose_bucket(self.buckets, batch.num_requests)
        if bucket is None:
            return None
        width = self.width(batch)
        with torch.inference_mode():
            self.inputs.fill(batch, bucket, width)
            logits = self.runs[bucket](*self.inputs.views(bucket, width))
            self.counts[bucket] += 1
            return logits.index_select(0, batch.logits_indices)

    def prepare(self, mode: str, **compile_options: Any) -> bool:
        """Make the buckets run as ``mode``: ``"graphs"`` (capture, :mod:`.cuda_graphs`), ``"compile"``
        (:meth:`compile` with ``compile_options``) or ``"eager"``; ``False`` (logged) when that fails,
        and then nothing should run through this step."""
        if mode not in ("graphs", "compile", "eager"):
            raise ValueError(f"mode={mode!r} is invalid: allowed graphs, compile, eager")
        start = time.perf_counter()
        try:
            if mode == "graphs":
                from tgi_paged_backend.runner.static.cuda_graphs import capture_decode_graphs

                capture_decode_graphs(self)
            elif mode == "compile":
                self.compile(**compile_options)
        except Exception as e:  # a family whose forward syncs or branches on values: serve it eagerly
            logger.warning("static decode ({}) off: {}: {}", mode, type(e).__name__, e)
            return False
        logger.info(
            "static decode ({}) for batch sizes {}, {} blocks per request, ready in {:.1f} s",
            mode,
            bucket_span(self.buckets),
            self.inputs.max_blocks,
            time.perf_counter() - start,
        )
        return True

    def compile(self, *, dynamic_rows: bool = False, **options: Any) -> dict[int, float]:
        """Route every bucket through ``torch.compile(fullgraph=True, dynamic=False)`` of
        :meth:`forward_views` (``options``: more ``torch.compile`` arguments, e.g. ``backend``) and
        compile now; returns the seconds each compiling call took, by bucket.

        Default: one graph per bucket, every shape static (needs ``fixed_width``): the step a CUDA graph
        captures. ``dynamic_rows``: one graph for every bucket (all >= 2: a size of 1 would be
        specialized), rows and, unless ``fixed_width``, the table width dynamic, compiled once with the
        largest bucket: what ``TGI_PAGED_COMPILE`` serves on CPU.
        """
        if dynamic_rows and self.buckets[0] < 2:
            raise ValueError(f"dynamic_rows needs buckets >= 2, got {self.buckets}")
        if not (dynamic_rows or self.fixed_width):
            raise ValueError("one graph per bucket needs fixed_width")
        # All graphs are of the same function: dynamo's per-function limit must allow one per bucket.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(self.buckets) + 1)
        compiled = torch.compile(self.forward_views, fullgraph=True, dynamic=False, **options)
        seconds: dict[int, float] = {}
        width = self.inputs.max_blocks
        for bucket in self.buckets[-1:] if dynamic_rows else self.buckets:
            # Fresh view objects: dynamic-dimension marks shape this graph and stay off the cached views.
            views = tuple(view.view(view.shape) for view in self.inputs.views(bucket, width))
            names = (*VIEW_NAMES, *(["group"] * (len(views) - len(VIEW_NAMES))))
            if dynamic_rows and bucket > 2:
                for name, view in zip(names, views, strict=True):
                    extra = 1 if name == "query_start_loc" else 0
                    torch._dynamo.mark_dynamic(view, 0, min=2 + extra, max=bucket + extra)
            if dynamic_rows and not self.fixed_width and width > 2:
                for view in views:
                    if view.ndim == 2:  # the block tables, one per group, all the same width
                        torch._dynamo.mark_dynamic(view, 1, min=2, max=width)
            self.inputs.pad(bucket, width)
            start = time.perf_counter()
            with torch.inference_mode():
                compiled(*views)
            seconds[bucket] = time.perf_counter() - start
        self.runs.update(dict.fromkeys(self.buckets, compiled))
        logger.info(
            "static decode compiled for buckets {} in {:.1f} s", bucket_span(self.buckets), sum(seconds.values())
        )
        return seconds


def bucket_span(buckets: Sequence[int]) -> str:
    """``[1, 2, 4]``, or ``2..256`` for a long run of consecutive sizes."""
    consecutive = len(buckets) > 3 and list(buckets) == list(range(buckets[0], buckets[-1] + 1))
    return f"{buckets[0]}..{buckets[-1]}" if consecutive else str(list(buckets))
