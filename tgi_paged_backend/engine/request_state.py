"""Per-request state the shard keeps between RPCs.

The router never resends a request's prompt, blocks or parameters, so everything needed to resume a
preempted request (its token ids, sampling and stopping state, detokenizer offsets) lives here.

Token regions of one request (``all_ids = prompt_ids + output_ids``)::

    |<------------- prompt_ids ------------->|<---- output_ids ---->|
    |<--- num_computed (K/V in the pool) --->|<- to compute ->|
                                                               ^ the last sampled token is fed next step

A step computes ``all_ids[num_computed : num_computed + n]``; when that reaches the end of
``all_ids`` the logits of its last position give the next token. Decode is the ``n == 1`` case;
chunked prefill, the first prefill and recompute after preemption are all the same operation.

Progress has one owner: ``num_computed`` (and ``num_cached_prompt``, ``prefill_done``) change only
through the methods here -- :meth:`start_from_cache` (admission and resume), :meth:`advance` (a
computed step), :meth:`drop_computed` and the ``mark_*`` transitions.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tgi_paged_backend.engine.types import FinishReason, RequestSpec

if TYPE_CHECKING:  # annotations only: importing grammar would pull in torch and outlines_core
    from tgi_paged_backend.engine.detokenize import IncrementalDetokenizer
    from tgi_paged_backend.engine.grammar import GrammarState
    from tgi_paged_backend.engine.image_prompts import RequestImages
    from tgi_paged_backend.engine.stopping import StoppingCriteria


class RequestStatus(enum.Enum):
    RUNNING = "running"
    """Holds physical blocks for ``num_computed`` positions (or is waiting for its first blocks)."""
    SWAPPED = "swapped"
    """Preempted: its blocks sit in CPU swap space."""
    PREEMPTED = "preempted"
    """Preempted for recompute: no blocks; resumes by prefilling ``all_ids``."""
    FINISHED = "finished"


@dataclass(slots=True, kw_only=True)
class RequestState:
    spec: RequestSpec
    prompt_ids: list[int]
    admitted_seq: int
    """Admission order (lower = older = higher priority); kept across preemptions."""
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Positions whose K/V sit in the pool."""
    num_cached_prompt: int = 0
    """Prompt positions found in retained prefix blocks at (re)admission."""
    status: RequestStatus = RequestStatus.RUNNING
    num_preemptions: int = 0
    preempted_at: float | None = None
    prefill_done: bool = False
    """The original prompt has been fully computed once (recompute does not reset it)."""
    prefill_logprobs: list[float] = field(default_factory=list)
    """Accumulated prompt-token logprobs across chunks (only when requested and enabled)."""
    wants_prompt_logprobs: bool = False
    """Prompt logprobs were asked for and are served (``REQUEST_LOGPROBS``): until its prefill is done
    the request computes every prompt position itself (a cached position has no logits)."""
    finish_reason: FinishReason | None = None
    recomputed_tokens: int = 0
    waiting_for_blocks: bool = False
    """The last step could not give it the KV blocks it needed (nothing left to preempt): it holds its
    place in the batch and waits for memory. Set and cleared by the scheduler."""
    adapter: int = 0
    """LoRA adapter index serving the request (0: the base model), resolved once at admission."""
    waiting_for_adapter: bool = False
    """The last step did not run it because ``max_loras`` other adapters ran (set by the scheduler)."""
    draft: list[int] = field(default_factory=list)
    """Speculative tokens to verify this step after the last sampled one (``engine.speculation``): set before
    planning, dropped by the scheduler when the pool cannot back them, consumed by the model step."""
    proposal: list[int] = field(default_factory=list)
    """The Medusa heads' guess for the tokens after the last sampled one (set by the model step when the
    shard has heads); the next step drafts from it. Empty with n-gram drafts."""
    chunk_len_hint: int | None = None
    """The router's ``chunk_len`` for the first chunk, consumed once."""
    stop_state: StoppingCriteria | None = None
    """Stopping-criteria state (engine.stopping)."""
    detok_state: IncrementalDetokenizer | None = None
    """Incremental detokenizer state (engine.detokenize)."""
    grammar: GrammarState | None = None
    """The request's automaton (engine.grammar.GrammarState) when it has a grammar: advanced with every
    generated token; preemption leaves it alone (swap and recompute keep ``output_ids``)."""
    images: RequestImages | None = None
    """The request's images (a served vision-language model; ``engine.image_prompts``), else ``None``."""

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def prompt_keys(self) -> list[int]:
        """The prompt as the memory manager matches and registers it: each image's placeholders keyed by the
        image's content (``vision.image_keys``), so another image never shares their blocks."""
        return self.prompt_ids if self.images is None else self.images.prompt_keys

    @property
    def attend_spans(self) -> tuple[range, ...]:
        """Prompt spans attended bidirectionally (``vision.attend_spans``; ``()``: causal)."""
        return () if self.images is None else self.images.bidirectional

    @property
    def key_ids(self) -> list[int]:
        """:attr:`all_ids` with the prompt keyed (:attr:`prompt_keys`)."""
        return self.prompt_keys + self.output_ids

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens to compute before this request yields its next token."""
        return self.num_tokens - self.num_computed

    @property
    def may_reuse_prefix(self) -> bool:
        """Whether retained K/V may stand in for positions not computed yet (admission or resume)."""
        return self.prefill_done or not self.wants_prompt_logprobs

    def start_from_cache(self, num_cached: int) -> None:
        """The first ``num_cached`` positions' K/V came from retained blocks (admission or resume)."""
        assert self.num_computed == 0, f"request {self.id} already computed {self.num_computed} positions"
        assert num_cached == 0 or self.may_reuse_prefix, f"request {self.id} must compute its prompt itself"
        self.num_computed = num_cached
        if not self.prefill_done:
            self.num_cached_prompt = min(num_cached, len(self.prompt_ids))

    def advance(self, num_tokens: int) -> bool:
        """``num_tokens`` more positions were computed this step; True when the request yields a token."""
        self.num_computed += num_tokens
        assert self.num_computed <= self.num_tokens, f"request {self.id} computed past its history"
        self.chunk_len_hint = None
        if self.num_computed == self.num_tokens:
            self.prefill_done = True
            return True
        return False

    def accept_draft(self, num_accepted: int) -> None:
        """The first ``num_accepted`` draft tokens were confirmed (and appended to ``output_ids`` with the
        token after them): their positions, computed this step, hold valid K/V."""
        self.num_computed += num_accepted
        assert self.num_computed <= self.num_tokens - 1, f"request {self.id} accepted past its history"
        self.draft = []

    def drop_computed(self) -> None:
        """A waiting recompute-preempted request gave back the prefix it had matched again."""
        assert self.status is RequestStatus.PREEMPTED
        self.num_computed = 0

    @property
    def is_prefilling(self) -> bool:
        return self.num_remaining > 1

    @property
    def is_preempted(self) -> bool:
        return self.status in (RequestStatus.SWAPPED, RequestStatus.PREEMPTED)

    @property
    def is_waiting(self) -> bool:
        """Admitted but waiting for memory without having been preempted: the last step could not give
        it KV blocks, or (a new request) it gave back its shared prefix blocks while waiting."""
        if self.status is RequestStatus.PREEMPTED and self.num_preemptions == 0:
            return True
        return self.status is RequestStatus.RUNNING and self.waiting_for_blocks

    @property
    def reserved_tokens(self) -> int:
        """Slots the router reserved (what stock TGI would have allocated)."""
        return len(self.spec.slots)

    def mark_preempted(self, status: RequestStatus) -> None:
        assert status in (RequestStatus.SWAPPED, RequestStatus.PREEMPTED)
        assert self.status is RequestStatus.RUNNING, f"request {self.id} is {self.status}"
        if status is RequestStatus.PREEMPTED:
            self.recomputed_tokens += self.num_computed
            self.num_computed = 0
            if self.images is not None:  # re-encoded from the bytes when the prefill reaches them again
                self.images.release()
        self.status = status
        self.num_preemptions += 1
        self.preempted_at = time.monotonic()

    def mark_waiting(self) -> None:
        """A new request gave back its shared prefix blocks while waiting for memory: it resumes like
        a recompute-preempted one, but this does not count as a preemption."""
        assert self.status is RequestStatus.RUNNING and not self.prefill_done
        self.num_computed = 0
        self.status = RequestStatus.PREEMPTED
        self.preempted_at = time.monotonic()

    def mark_resumed(self) -> float:
        """Back to running; returns seconds spent preempted."""
        assert self.is_preempted
        waited = time.monotonic() - (self.preempted_at or time.monotonic())
        self.status = RequestStatus.RUNNING
        self.preempted_at = None
        return waited
