"""The per-step input of the model runner: packed tokens plus paged-attention metadata.

All requests of a step are packed into one sequence of ``T`` tokens (the model sees batch size 1);
request ``b`` owns rows ``query_start_loc[b]:query_start_loc[b + 1]``, which are the last
``q_len_b`` positions of its ``seq_lens[b]`` tokens. The engine builds a :class:`ForwardBatch` from
numpy arrays (:meth:`ForwardBatch.from_numpy`, or :func:`build_forward_batch` from per-request
chunks) and the runner moves it to the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardBatch:
    """One forward step over ``B`` requests and ``T`` packed tokens.

    Attributes
    ----------
    input_ids : torch.Tensor
        ``[T]`` int64 token ids.
    positions : torch.Tensor
        ``[T]`` int64 rotary positions the model gets (``position_ids``): each token's index in its own
        request, plus the request's M-RoPE delta past an image prompt (:mod:`tgi_paged_backend.vision.mrope`,
        where the three streams agree, e.g. every decode row). The KV layout never reads them (slots,
        block tables and ``seq_lens`` place the tokens).
    slot_mapping : torch.Tensor
        ``[T]`` int64 physical slots (``physical_block * block_size + offset``) where each token's
        K/V is written.
    block_tables : torch.Tensor
        ``[B, max_blocks]`` int32 physical blocks of each request in token order (padding: any
        valid block id, e.g. 0; entries past ``seq_lens`` are never read).
    query_start_loc : torch.Tensor
        ``[B + 1]`` int32 prefix sums of the per-request query lengths; ``query_start_loc[-1] == T``.
    seq_lens : torch.Tensor
        ``[B]`` int32 tokens of each request with K/V after this step (cached + new).
    is_decode : bool
        Every request has exactly one new token (``T == B``).
    logits_indices : torch.Tensor
        ``[K]`` int64 rows of the packed tokens whose logits are returned, in output order.
    lora_slots : torch.Tensor or None
        ``[T]`` int64 LoRA slot of each packed token (adapter index - 1; ``-1``: the base model);
        ``None`` when no request of the step has an adapter.
    group_slot_mappings, group_block_tables : tuple of torch.Tensor
        With KV layer groups (``memory.layer_groups``): the slots and block tables of groups 1, 2, ...
        (``slot_mapping`` and ``block_tables`` are group 0's), same shapes; ``()`` with one group.
    image_rows : tuple of (int, torch.Tensor)
        Image embeddings of this step's prefill chunks (vision-language models, issue 40): ``(row, values)``
        puts ``values`` (``[n, hidden]``) at packed rows ``row .. row + n`` in place of those tokens'
        embeddings; ``()`` (every text-only step): the model embeds ``input_ids`` itself.
    rope_positions : torch.Tensor or None
        ``[3, T]`` int64 multimodal rotary positions (M-RoPE families, :mod:`tgi_paged_backend.vision.mrope`)
        given to the model instead of ``positions`` when a row of the step has three different streams (a
        prefill chunk over an image); ``None``: the model rotates by ``positions``.
    attend_limits : torch.Tensor or None
        ``[T]`` int32 last key position each packed row attends to (bidirectional spans: Gemma 3's image tokens,
        PaliGemma's prefix-LM prompt; :mod:`tgi_paged_backend.vision.attend_spans`): a row inside a span sees the
        whole span, every other row its own position. ``None`` (every step without such a span): causal.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    is_decode: bool
    logits_indices: torch.Tensor
    lora_slots: torch.Tensor | None = None
    group_slot_mappings: tuple[torch.Tensor, ...] = ()
    group_block_tables: tuple[torch.Tensor, ...] = ()
    image_rows: tuple[tuple[int, torch.Tensor], ...] = ()
    rope_positions: torch.Tensor | None = None
    attend_limits: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """``T``, the packed token count."""
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        """``B``, the number of requests."""
        return int(self.seq_lens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def from_numpy(
        cls,
        *,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        logits_indices: np.ndarray,
        is_decode: bool | None = None,
        lora_slots: np.ndarray | None = None,
        group_slot_mappings: Sequence[np.ndarray] = (),
        group_block_tables: Sequence[np.ndarray] = (),
    ) -> ForwardBatch:
        """Wrap numpy arrays (copied to the canonical dtypes) and check their shapes.

        ``is_decode`` defaults to "every query length is 1".
        """
        qsl = np.asarray(query_start_loc, dtype=np.int32)
        if is_decode is None:
            is_decode = bool(np.all(np.diff(qsl) == 1))
        batch = cls(
            input_ids=torch.from_numpy(np.asarray(input_ids, dtype=np.int64).copy()),
            positions=torch.from_numpy(np.asarray(positions, dtype=np.int64).copy()),
            slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64).copy()),
            block_tables=torch.from_numpy(np.atleast_2d(np.asarray(block_tables, dtype=np.int32)).copy()),
            query_start_loc=torch.from_numpy(qsl.copy()),
            seq_lens=torch.from_numpy(np.asarray(seq_lens, dtype=np.int32).copy()),
            is_decode=is_decode,
            logits_indices=torch.from_numpy(np.asarray(logits_indices, dtype=np.int64).copy()),
            lora_slots=None if lora_slots is None else torch.from_numpy(np.asarray(lora_slots, dtype=np.int64).copy()),
            group_slot_mappings=tuple(
                torch.from_numpy(np.asarray(m, dtype=np.int64).copy()) for m in group_slot_mappings
            ),
            group_block_tables=tuple(
                torch.from_numpy(np.atleast_2d(np.asarray(t, dtype=np.int32)).copy()) for t in group_block_tables
            ),
        )
        batch.validate()
        return batch

    def validate(self) -> None:
        """Raise ``ValueError`` when shapes or dtypes disagree (cheap; no device sync)."""
        t, b = self.num_tokens, self.num_requests
        expected = {
            "input_ids": (torch.int64, (t,)),
            "positions": (torch.int64, (t,)),
            "slot_mapping": (torch.int64, (t,)),
            "query_start_loc": (torch.int32, (b + 1,)),
            "seq_lens": (torch.int32, (b,)),
            "logits_indices": (torch.int64, (int(self.logits_indices.shape[0]),)),
        }
        for name, (dtype, shape) in expected.items():
            tensor = getattr(self, name)
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"ForwardBatch.{name}: expected {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
                )
        if self.block_tables.dtype != torch.int32 or self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(
                f"ForwardBatch.block_tables: expected int32 [{b}, max_blocks], "
                f"got {self.block_tables.dtype} {tuple(self.block_tables.shape)}"
            )
        lora = self.lora_slots
        if lora is not None and (lora.dtype != torch.int64 or tuple(lora.shape) != (t,)):
            raise ValueError(f"ForwardBatch.lora_slots: expected int64 ({t},), got {lora.dtype} {tuple(lora.shape)}")
        if self.is_decode and t != b:
            raise ValueError(f"ForwardBatch.is_decode with {t} tokens for {b} requests")
        if len(self.group_slot_mappings) != len(self.group_block_tables):
            raise ValueError("ForwardBatch: one slot mapping and one block table per extra layer group")
        for m, table in zip(self.group_slot_mappings, self.group_block_tables):
            if m.dtype != torch.int64 or tuple(m.shape) != (t,) or table.dtype != torch.int32 or table.shape[0] != b:
                raise ValueError("ForwardBatch: a layer group's slots or table has the wrong dtype or shape")

    def to(self, device: torch.device | str, non_blocking: bool = True) -> ForwardBatch:
        """The same batch on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        if self.device == device:
            return self
        non_blocking = non_blocking and device.type == "cuda"

        def move(x: torch.Tensor) -> torch.Tensor:
            if non_blocking and not x.is_pinned():
                x = x.pin_memory()
            return x.to(device, non_blocking=non_blocking)

        return ForwardBatch(
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            block_tables=move(self.block_tables),
            query_start_loc=move(self.query_start_loc),
            seq_lens=move(self.seq_lens),
            is_decode=self.is_decode,
            logits_indices=move(self.logits_indices),
            lora_slots=None if self.lora_slots is None else move(self.lora_slots),
            group_slot_mappings=tuple(move(m) for m in self.group_slot_mappings),
            group_block_tables=tuple(move(t) for t in self.group_block_tables),
            image_rows=tuple((row, values.to(device)) for row, values in self.image_rows),
            rope_positions=None if self.rope_positions is None else move(self.rope_positions),
            attend_limits=None if self.attend_limits is None else move(self.attend_limits),
        )


@dataclass(frozen=True, slots=True)
class RequestChunk:
    """The part of one request computed in a step.

    Attributes
    ----------
    token_ids : Sequence[int]
        New tokens to compute (the whole prompt, a chunk of it, or one generated token).
    num_computed : int
        Positions of this request whose K/V is already in the pool; the new tokens take positions
        ``num_computed, num_computed + 1, ...``.
    block_table : Sequence[int]
        Physical blocks covering at least ``num_computed + len(token_ids)`` positions.
    all_logits : bool
        Return logits for every new token (prompt logprobs), not only the last one.
    """

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]
    all_logits: bool = False
    lora_slot: int = -1
    """LoRA slot of the request (adapter index - 1; ``-1``: the base model)."""


def on_consecutive_blocks(
    requests: Sequence[tuple[list[int], int]], block_size: int, first_block: int = 1
) -> tuple[list[RequestChunk], int]:
    """Chunks of ``(token_ids, num_computed)`` requests, each on its own run of consecutive blocks from
    ``first_block`` on (benchmarks and load-time checks; block 0 stays the scratch block), and the first
    block they leave free."""
    chunks, block = [], first_block
    for token_ids, num_computed in requests:
        n = -(-(num_computed + len(token_ids)) // block_size)
        chunks.append(RequestChunk(token_ids, num_computed, list(range(block, block + n))))
        block += n
    return chunks, block


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """Where each request's tokens and logits rows sit in a packed step (the one place this is worked out:
    :func:`build_forward_batch`, the engine's step and the static decode buffers use it)."""

    positions: np.ndarray
    """``[T]`` int64 position of each packed token in its request."""
    query_start_loc: np.ndarray
    """``[B + 1]`` int64 prefix sums of the query lengths."""
    seq_lens: np.ndarray
    """``[B]`` int64 tokens of each request with K/V after the step."""
    logits_indices: np.ndarray
    """``[K]`` int64 packed rows whose logits are returned, request by request."""
    logits_start: np.ndarray
    """``[B]`` int64 first logits row of each request."""
    logits_count: np.ndarray
    """``[B]`` int64 logits rows of each request (its query length with ``all_logits``, else 1)."""
    is_decode: bool
    """Every request has exactly one new token."""


def layout_tokens(num_computed: Sequence[int] | np.ndarray, q_lens: Sequence[int] | np.ndarray,
                  all_logits: Sequence[bool] | np.ndarray | bool = False) -> TokenLayout:  # fmt: skip
    """The packed layout of requests that already hold ``num_computed[b]`` positions and compute the next
    ``q_lens[b]``; logits for every new token of the requests with ``all_logits`` (prompt logprobs, draft
    verification), else for the last one. Raises ``ValueError`` for an empty step or an empty chunk."""
    computed = np.asarray(num_computed, dtype=np.int64)
    lens = np.asarray(q_lens, dtype=np.int64)
    if lens.size == 0:
        raise ValueError("a step needs at least one request")
    if (lens < 1).any():
        raise ValueError("every request chunk needs at least one token")
    query_start_loc = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    is_decode = num_tokens == lens.size
    # Token i of request b sits at packed row query_start_loc[b] + i and position num_computed[b] + i.
    positions = (
        computed.copy() if is_decode else np.repeat(computed - query_start_loc[:-1], lens) + np.arange(num_tokens)
    )
    every = np.broadcast_to(np.asarray(all_logits, dtype=bool), lens.shape)
    logits_count = np.where(every, lens, 1)
    logits_start = np.zeros(lens.size, dtype=np.int64)
    np.cumsum(logits_count[:-1], out=logits_start[1:])
    num_logits = int(logits_count.sum())
    # Row j of request b's logits is packed row (its last token - count + 1) + j.
    offsets = np.arange(num_logits) - np.repeat(logits_start, logits_count)
    logits_indices = np.repeat(query_start_loc[1:] - logits_count, logits_count) + offsets
    return TokenLayout(
        positions, query_start_loc, computed + lens, logits_indices, logits_start, logits_count, is_decode
    )


def build_forward_batch(chunks: Sequence[RequestChunk], block_size: int) -> ForwardBatch:
    """Pack per-request chunks into a CPU :class:`ForwardBatch` (pure numpy, then one wrap).

    Raises ``ValueError`` when a block table is too short for its chunk.
    """
    if not chunks:
        raise ValueError("build_forward_batch needs at least one request")
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    layout = layout_tokens([c.num_computed for c in chunks], q_lens, [c.all_logits for c in chunks])
    max_blocks = max(len(c.block_table) for c in chunks)
    block_tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)
    slots = []
    for b, chunk in enumerate(chunks):
        table = np.asarray(chunk.block_table, dtype=np.int64)
        needed = -(-int(layout.seq_lens[b]) // block_size)
        if len(table) < needed:
            raise ValueError(
                f"request {b}: block table has {len(table)} blocks, {needed} needed "
                f"for {layout.seq_lens[b]} tokens at block_size={block_size}"
            )
        block_tables[b, : len(table)] = table
        pos = layout.positions[layout.query_start_loc[b] : layout.query_start_loc[b + 1]]
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return ForwardBatch.from_numpy(
        input_ids=np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks]),
        positions=layout.positions,
        slot_mapping=np.concatenate(slots),
        block_tables=block_tables,
        query_start_loc=layout.query_start_loc,
        seq_lens=layout.seq_lens,
        logits_indices=layout.logits_indices,
        is_decode=layout.is_decode,
        lora_slots=np.repeat([c.lora_slot for c in chunks], q_lens) if any(c.lora_slot >= 0 for c in chunks) else None,
    )


def dummy_prefill_chunks(num_tokens: int, block_size: int, max_len: int | None) -> tuple[list[RequestChunk], int]:
    """A prefill of ``num_tokens`` zero tokens split into requests of at most ``max_len`` tokens, on
    consecutive blocks from 0 (activation profiling on a temporary pool), and the blocks it takes."""
    max_len = max_len or num_tokens
    lengths = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
    return on_consecutive_blocks([([0] * n, 0) for n in lengths], block_size, first_block=0)
