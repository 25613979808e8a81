"""Speculative decoding (``--speculate N``): proposals from the request's own history, verified in one
forward, accepted while the request's normal chooser picks them.

Per decoding request and step (``engine.shard_engine`` calls :func:`propose_drafts` before planning):

1. :func:`ngram_draft` proposes up to N tokens: the tokens that followed the **most recent** earlier
   occurrence of the longest suffix of ``prompt + output`` (suffix lengths :data:`MAX_NGRAM` down to 1).
   Stock TGI copies after the first occurrence of the last token only; the latest occurrence of a longer
   suffix is where repetitive text (edits, code, summaries quoting the source) most often continues.
   With a Medusa checkpoint (``runner.model.medusa``) the draft is instead the heads' argmax at the hidden
   state of the last sampled token, computed by the previous step (``RequestState.proposal``).
2. The scheduler computes ``[last token] + draft`` in one step (the chunked-prefill path: several query
   positions of one request), backing them with blocks only if the pool has them without preempting.
3. ``engine.model_step`` samples every position with the request's chooser (same seed stream as without
   speculation: position ``i`` is output step ``len(output) + i``) and accepts draft token ``i`` while the
   chosen token equals it; the first mismatch (or the position after the last draft) gives the extra
   token. Greedy and seeded output are therefore exactly the non-speculative output.
4. The page map keeps the accepted positions only: rejected positions' blocks go back to the pool
   (``KVCacheManager.truncate``) and only accepted tokens are committed for prefix retention.

Grammar rows draft too: the draft is cut at the first token their automaton forbids
(``GrammarState.valid_draft``) and every verified position is masked by the automaton advanced along the
draft before it. Penalised rows see, at each position, the history up to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tgi_paged_backend.engine.request_state import RequestState, RequestStatus

MAX_NGRAM = 3
"""Longest history suffix looked up (then shorter ones)."""
MAX_LOOKBACK = 4096
"""Tokens of history searched (the most recent ones), bounding the per-step cost."""


def ngram_draft(history: Sequence[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``history``
    (of length ``max_ngram`` down to 1); ``[]`` when no suffix recurs."""
    if k <= 0 or len(history) < 2:
        return []
    tail = list(history[-MAX_LOOKBACK:])
    n_hist = len(tail)
    for n in range(min(max_ngram, n_hist - 1), 0, -1):
        suffix = tail[n_hist - n :]
        first = suffix[0]
        # latest start s < n_hist - n with tail[s : s + n] == suffix
        for s in range(n_hist - n - 1, -1, -1):
            if tail[s] == first and tail[s : s + n] == suffix:
                follow = tail[s + n : s + n + k]
                if follow:
                    return follow
                break
    return []


def may_speculate(r: RequestState) -> bool:
    """Whether a request drafts this step: decoding (its next token is due, its prompt is done), and its
    automaton set up when it has a grammar."""
    p = r.spec.sampling
    return (
        r.status is RequestStatus.RUNNING
        and r.prefill_done
        and r.num_remaining == 1
        and bool(r.output_ids)
        and (p.grammar is None or r.grammar is not None)
    )


def drafting_pays(requests: Sequence[RequestState], max_batch: int | None) -> bool:
    """Whether this step drafts at all: always when a request in it prefills (the step takes the
    multi-position path anyway, drafts only add positions), else only when at most ``max_batch`` requests
    decode (``None``: no limit). On CPU a pure decode step runs the one-call native decode path, which a
    draft leaves for the multi-position path: at batch 8 that costs 1.9-2.7x the step, more than the
    accepted tokens give back (docs/performance.md, "Speculative decoding")."""
    if max_batch is None or len(requests) <= max_batch:
        return True
    return any(r.status is RequestStatus.RUNNING and r.num_remaining > 1 for r in requests)


def propose_drafts(requests: Iterable[RequestState], speculate: int, medusa: bool = False) -> int:
    """Set every request's ``draft`` for this step (``[]`` when it does not speculate): the Medusa heads'
    ``proposal`` when the shard has heads, else :func:`ngram_draft`. Returns the number of proposed
    tokens. A draft never runs past ``max_new_tokens``: the last token is the verified one."""
    proposed = 0
    for r in requests:
        r.draft = []
        if speculate <= 0 or not may_speculate(r):
            continue
        k = min(speculate, r.spec.stopping.max_new_tokens - len(r.output_ids) - 1)
        draft = r.proposal[: max(k, 0)] if medusa else ngram_draft(r.all_ids, k)
        r.draft = r.grammar.valid_draft(draft) if r.grammar is not None and draft else draft
        proposed += len(r.draft)
    return proposed


def accepted_prefix(draft: Sequence[int], chosen: Sequence[int]) -> int:
    """How many leading draft tokens the chooser confirmed (``chosen[i]`` is the choice at draft position i)."""
    n = 0
    for d, c in zip(draft, chosen):
        if d != c:
            break
        n += 1
    return n
