"""Executes a :class:`~tgi_paged_backend.engine.scheduler.StepPlan`: copies, one forward, sampling,
stopping and detokenization, producing ``Generation`` records.

Only requests whose computed tokens reach the end of their history yield a token; a request in the
middle of a prefill chunk (or of a recompute) gets nothing this step, which the router tolerates.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from tgi_paged_backend.engine.detokenize import TokenDecoder
from tgi_paged_backend.engine.grammar import apply_grammar_masks
from tgi_paged_backend.engine.request_state import RequestState, RequestStatus
from tgi_paged_backend.engine.sampling import ChosenToken, choose_next_tokens
from tgi_paged_backend.engine.scheduler import StepPlan
from tgi_paged_backend.engine.speculation import accepted_prefix, drafting_pays
from tgi_paged_backend.engine.step_anatomy import StepTimer
from tgi_paged_backend.engine.types import GeneratedText, Generation, Tokens
from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
from tgi_paged_backend.offload.tier_io import TierIO
from tgi_paged_backend.runner.input_batch import ForwardBatch, layout_tokens
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.vision.attend_spans import attend_limits


@dataclass(frozen=True, slots=True)
class StepOutput:
    generations: list[Generation]
    finished: list[RequestState]
    num_computed_tokens: int
    num_recomputed_tokens: int
    forward_ns: int
    decode_ns: int
    num_constrained_rows: int = 0
    """Sampled rows masked by a grammar this step."""
    num_swapped_blocks: int = 0
    """Blocks swapped out or in before the forward (copy-on-write copies not counted)."""
    copy_ns: int = 0
    """Time of this step's block copies (after a device sync on CUDA): with the swapped blocks, a
    measured swap rate for the preemption cost model."""
    num_draft_tokens: int = 0
    """Speculative tokens verified this step (``engine.speculation``)."""
    num_accepted_tokens: int = 0
    """Of those, the ones the requests' choosers confirmed."""
    num_image_tokens: int = 0
    """Image placeholder positions computed this step (their embeddings from the vision tower)."""
    num_images_encoded: int = 0
    """Images run through the vision tower this step (again after a recompute preemption)."""


class ModelStep:
    """Turns a plan into generations. Owns no request state; mutates the planned requests."""

    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCacheManager,
        decoder: TokenDecoder,
        spec_max_batch: int | None = None,
        tier_io: TierIO | None = None,
    ) -> None:
        self.runner = runner
        self.tier_io = tier_io
        """Runs the host tier's moves (``offload``, ``load``) of the copy list."""
        self.kv = kv
        self.decoder = decoder
        self.spec_max_batch = spec_max_batch
        """Decoding requests up to which a step drafts (``speculation.drafting_pays``): Medusa proposals are
        not computed for a batch larger than that (the next step would not draft from them)."""

    def run(self, plan: StepPlan, timer: StepTimer | None = None) -> StepOutput:
        """``timer`` (the engine's, for the step anatomy) gets the copy, prepare, forward,
        bookkeeping, sample and detokenize laps."""
        timer = timer if timer is not None else StepTimer()
        t_copy = time.perf_counter_ns()
        self._apply_copies(plan)
        if plan.copy_ops:
            timer.device_lap("copy")
        t0 = time.perf_counter_ns()
        copies = dict(
            num_swapped_blocks=sum(len(src) for kind, src, _ in plan.copy_ops if kind in ("out", "in")),
            copy_ns=t0 - t_copy,
        )
        if not plan.scheduled:
            return StepOutput([], [], 0, 0, 0, 0, **copies)
        batch, rows, images_encoded = self._build_batch(plan)
        timer.lap("prepare")
        logits = self.runner.forward(batch)
        timer.device_lap("forward")
        sampled, recomputed = self._advance(plan, rows, logits)
        timer.lap("schedule")
        t1 = time.perf_counter_ns()
        drafted = sum(len(r.draft) for r, _ in sampled)
        generations, finished, accepted = self._emit(sampled, logits, timer)
        t2 = time.perf_counter_ns()
        constrained = sum(1 for r, _ in sampled if r.grammar is not None)
        return StepOutput(
            generations,
            finished,
            plan.num_tokens,
            recomputed,
            t1 - t0,
            t2 - t1,
            constrained,
            **copies,
            num_draft_tokens=drafted,
            num_accepted_tokens=accepted,
            num_image_tokens=sum(int(values.shape[0]) for _, values in batch.image_rows),
            num_images_encoded=images_encoded,
        )

    # -- phases ------------------------------------------------------------------------------

    def _apply_copies(self, plan: StepPlan) -> None:
        for kind, src, dst in plan.copy_ops:
            if kind == "out":
                self.runner.swap_out(src, dst)
            elif kind == "in":
                self.runner.swap_in(src, dst)
            elif kind == "cow":
                self.runner.copy_blocks(src, dst)
            else:
                assert self.tier_io is not None, f"a {kind} move without a host tier"
                self.tier_io.run(kind, src, dst)

    @staticmethod
    def _wants_prompt_logprobs(r: RequestState) -> bool:
        return r.wants_prompt_logprobs and not r.prefill_done and r.num_computed < len(r.prompt_ids)

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[tuple[int, int, bool]], int]:
        """Packed inputs; ``rows[i]`` = (first logits row, number of rows, rows are prompt logprobs)
        of scheduled request i; the images encoded for the step's image rows."""
        ids, starts, counts, chunks, every_row, prompt_rows = [], [], [], [], [], []
        for r, n in plan.scheduled:
            start = r.num_computed
            ids.append(r.id)
            starts.append(start)
            counts.append(n)
            if r.draft:  # the last sampled token, then the draft; every position's logits are verified
                chunks.append([r.output_ids[-1], *r.draft])
                every_row.append(True)
                prompt_rows.append(False)
                continue
            if n == 1 and start >= len(r.prompt_ids):
                chunks.append(r.output_ids[start - len(r.prompt_ids) : start - len(r.prompt_ids) + 1])
            else:
                chunks.append(r.all_ids[start : start + n])
            logprobs = self._wants_prompt_logprobs(r)
            every_row.append(logprobs)
            prompt_rows.append(logprobs)
        layout = layout_tokens(starts, counts, every_row)
        rows = [
            (int(first), int(count), logprobs)
            for first, count, logprobs in zip(layout.logits_start, layout.logits_count, prompt_rows)
        ]
        groups = range(1, self.kv.num_groups)  # KV layer groups past the first (memory.layer_groups)
        if layout.is_decode:  # a decode step's positions are its requests' computed counts
            slots = self.kv.decode_slot_mapping(ids, layout.positions)
            group_slots = [self.kv.decode_slot_mapping(ids, layout.positions, group=g) for g in groups]
        else:
            slots = self.kv.slot_mapping(ids, starts, counts)
            group_slots = [self.kv.slot_mapping(ids, starts, counts, group=g) for g in groups]
        # PaliGemma's rotary positions start at 1 (HF's and stock's), the KV layout's at 0
        offset = int(getattr(self.runner.image_encoder, "position_offset", 0))
        batch = ForwardBatch.from_numpy(
            input_ids=np.fromiter((t for c in chunks for t in c), dtype=np.int64, count=len(layout.positions)),
            positions=layout.positions + offset if offset else layout.positions,
            slot_mapping=slots,
            block_tables=self.kv.block_tables(ids),
            query_start_loc=layout.query_start_loc,
            seq_lens=layout.seq_lens,
            logits_indices=layout.logits_indices,
            is_decode=layout.is_decode,
            lora_slots=self._lora_slots(plan, np.asarray(counts, dtype=np.int64)),
            group_slot_mappings=group_slots,
            group_block_tables=self.kv.group_block_tables(ids)[1:] if group_slots else (),
        )
        image_rows, encoded = [], 0
        for (r, n), first in zip(plan.scheduled, layout.query_start_loc):
            if r.images is not None and not r.draft:
                held = r.images.features is not None
                image_rows += r.images.chunk_rows(r.id, r.num_computed, n, int(first), self.runner.image_encoder)
                encoded += 0 if held or r.images.features is None else len(r.images.images)
        if image_rows:
            batch = dataclasses.replace(batch, image_rows=tuple(image_rows))
        limits = self._attend_limits(plan, layout.positions, layout.query_start_loc)
        if limits is not None:
            batch = dataclasses.replace(batch, attend_limits=torch.from_numpy(limits))
        rope = self._rope_positions(plan, layout.positions, layout.query_start_loc)
        if rope is not None and (rope == rope[0]).all():  # the three streams agree (decode): 1-D, static decode
            batch = dataclasses.replace(batch, positions=torch.from_numpy(rope[0].copy()))
        elif rope is not None:
            batch = dataclasses.replace(batch, rope_positions=torch.from_numpy(rope))
        return batch.to(self.runner.device), rows, encoded

    @staticmethod
    def _rope_positions(plan: StepPlan, positions: np.ndarray, starts: np.ndarray) -> np.ndarray | None:
        """``[3, T]`` M-RoPE positions when a request of the step has them (each row's index elsewhere),
        else ``None``; decode and generated positions get the request's delta (:mod:`~..vision.mrope`).
        A step whose rows all have three equal streams (every decode) passes them as 1-D ``positions``, so
        the static decode step (compiled / graphs) still runs it."""
        if not any(r.images is not None and r.images.rope is not None for r, _ in plan.scheduled):
            return None
        rope = np.broadcast_to(positions, (3, positions.shape[0])).astype(np.int64)
        for (r, _), first, stop in zip(plan.scheduled, starts[:-1], starts[1:]):
            if r.images is not None and r.images.rope is not None:
                rope[:, first:stop] = r.images.rope.at(positions[first:stop])
        return rope

    @staticmethod
    def _attend_limits(plan: StepPlan, positions: np.ndarray, starts: np.ndarray) -> np.ndarray | None:
        """int32 ``[T]`` last key position of each packed row when a chunk of the step touches a bidirectional
        span (:mod:`~..vision.attend_spans`; every other row: its own position), else ``None`` (causal)."""
        limits: np.ndarray | None = None
        for (r, n), first in zip(plan.scheduled, starts[:-1]):
            rows = attend_limits(r.attend_spans, r.num_computed, n) if r.attend_spans and not r.draft else None
            if rows is not None:
                if limits is None:
                    limits = positions.astype(np.int32)
                limits[first : first + n] = rows
        return limits

    @staticmethod
    def _lora_slots(plan: StepPlan, counts: np.ndarray) -> np.ndarray | None:
        """Each packed token's LoRA slot (adapter index - 1, ``-1``: base); ``None`` when no request has one."""
        adapters = np.fromiter((r.adapter for r, _ in plan.scheduled), dtype=np.int64, count=len(counts))
        return np.repeat(adapters - 1, counts) if adapters.any() else None

    def _advance(self, plan: StepPlan, rows: list[tuple[int, int, bool]], logits: torch.Tensor):
        """Account computed tokens; collect (request, row of ``logits``) for those that yield a token (with a
        draft: the row of its last sampled token, the draft's rows follow). Draft positions are accounted
        once verified (:meth:`_emit`)."""
        sampled: list[tuple[RequestState, int]] = []
        recomputed = 0
        for (r, n), (first, count, prompt_rows) in zip(plan.scheduled, rows):
            if r.draft:
                start = r.num_computed
                self.kv.commit_tokens(r.id, r.output_ids[-1:], start)
                r.advance(1)
                sampled.append((r, first))
                continue
            start, end = r.num_computed, r.num_computed + n
            if prompt_rows:
                self._record_prompt_logprobs(r, start, end, logits[first : first + count])
            num_prompt = len(r.prompt_ids)
            if r.prefill_done:
                recomputed += max(0, min(end, r.num_tokens - 1) - start)
            if start < num_prompt:
                self.kv.commit_tokens(r.id, r.prompt_keys[start : min(end, num_prompt)], start)
            if end > num_prompt:  # generated tokens join the history retention registers, as prompts do
                gen_start = max(start, num_prompt)
                self.kv.commit_tokens(r.id, r.output_ids[gen_start - num_prompt : end - num_prompt], gen_start)
            if r.images is not None:
                r.images.release(end)
            if r.advance(n):
                sampled.append((r, first + count - 1))
        return sampled, recomputed

    def _record_prompt_logprobs(self, r: RequestState, start: int, end: int, rows: torch.Tensor) -> None:
        """Row ``p - start`` predicts prompt token ``p + 1``; position 0 and cached ones are NaN.

        Entry ``i`` of ``r.prefill_logprobs`` is the logprob of prompt token ``i + 1``; a chunk
        starting at ``start`` owns entries ``start..``, so a resumed (recomputed) prefill overwrites
        rather than appends."""
        del r.prefill_logprobs[start:]
        r.prefill_logprobs.extend([math.nan] * (start - len(r.prefill_logprobs)))
        prompt = r.prompt_ids
        targets = [p + 1 for p in range(start, end) if p + 1 < len(prompt)]
        if targets:
            lp = torch.log_softmax(rows[: len(targets)].float(), dim=-1)
            tgt = torch.tensor([prompt[t] for t in targets], device=lp.device)
            values = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
            r.prefill_logprobs.extend(v if math.isfinite(v) else -1e30 for v in values)

    def _emit(self, sampled: list[tuple[RequestState, int]], step_logits: torch.Tensor, timer: StepTimer):
        """Choose, verify drafts, stop and detokenize; returns (generations, finished, accepted draft tokens)."""
        if not sampled:
            return [], [], 0
        # One row per position to choose: a request's own row, then one per draft token after it.
        owners = [(r, i) for r, _ in sampled for i in range(len(r.draft) + 1)]
        picked = [row + i for r, row in sampled for i in range(len(r.draft) + 1)]
        constrained = [j for j, (r, _) in enumerate(owners) if r.grammar is not None]
        grammars = [(r.grammar, r.draft) for r, _ in sampled if r.grammar is not None]
        # A decode step samples every row in order: no [B, V] copy then, unless grammar masks write into it
        # (the forward's logits are an inference tensor, read-only here).
        if not constrained and picked == list(range(step_logits.shape[0])):
            logits = step_logits
        else:
            logits = step_logits[torch.tensor(picked, device=step_logits.device)]
        apply_grammar_masks(logits, constrained, [g for g, _ in grammars], [d for _, d in grammars])  # before sampling
        params = [r.spec.sampling for r, _ in owners]
        needs_history = [p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 for p in params]
        histories = [r.all_ids + r.draft[:i] if need else [] for (r, i), need in zip(owners, needs_history)]
        chosen = choose_next_tokens(
            logits,
            params,
            [len(r.output_ids) + i for r, i in owners],  # draft position i is output step len + i: same seeds
            histories if any(needs_history) else None,
            [r.spec.top_n_tokens for r, _ in owners],
            greedy=self.runner.greedy_pick,
        )
        timer.lap("sample")
        generations, finished, accepted_total, j = [], [], 0, 0
        proposing: list[tuple[RequestState, int]] = []  # (request, logits row of its last emitted token)
        for r, row in sampled:
            draft, mine = r.draft, chosen[j : j + len(r.draft) + 1]
            j += len(mine)
            accepted = accepted_prefix(draft, [c.id for c in mine])
            generation = self._emit_request(r, mine[: accepted + 1])
            generations.append(generation)
            accepted_total += accepted
            if generation.generated_text is not None:
                finished.append(r)
                r.draft = []
                continue
            proposing.append((r, row + accepted))
            if draft:  # keep the accepted positions' K/V, give back the rejected ones' blocks
                self.kv.commit_tokens(r.id, draft[:accepted], r.num_computed)
                r.accept_draft(accepted)
                self.kv.truncate(r.id, r.num_computed)
        if (
            self.runner.medusa is not None
            and proposing
            and drafting_pays([r for r, _ in proposing], self.spec_max_batch)  # else the next step will not draft
        ):
            proposals = self.runner.propose_medusa([row for _, row in proposing], self.runner.medusa.num_heads)
            for (r, _), proposal in zip(proposing, proposals):
                r.proposal = proposal
        timer.lap("detokenize")
        return generations, finished, accepted_total

    def _emit_request(self, r: RequestState, choices: list[ChosenToken]) -> Generation:
        """Append ``choices`` in order until a stop condition; one ``Generation`` with every emitted id."""
        detok, stop = r.detok_state, r.stop_state
        assert detok is not None and stop is not None  # both set when the request is registered
        first = not r.output_ids
        tokens = Tokens(ids=[], logprobs=[], texts=[], is_special=[])
        top: list[Tokens] = []
        reason = None
        for c in choices:
            r.output_ids.append(c.id)
            if r.grammar is not None:
                r.grammar.advance(c.id)
            text = detok.step(c.id)
            tokens.ids.append(c.id)
            tokens.logprobs.append(c.logprob)
            tokens.texts.append(text)
            tokens.is_special.append(self.decoder.is_special(c.id))
            if r.spec.top_n_tokens > 0:
                top.append(
                    Tokens(
                        ids=c.top_ids,
                        logprobs=c.top_logprobs,
                        texts=self.decoder.token_texts(c.top_ids),
                        is_special=self.decoder.is_special_many(c.top_ids),
                    )
                )
            reason = stop(c.id, text)
            if reason is not None:  # a stop inside the accepted run cuts it there
                break
        prefill = self._prefill_tokens(r) if first and r.wants_prompt_logprobs else None
        generated = None
        if reason is not None:
            r.finish_reason = reason
            r.status = RequestStatus.FINISHED
            generated = GeneratedText(
                text=detok.final_text(),
                generated_tokens=len(r.output_ids),
                finish_reason=reason,
                seed=r.spec.sampling.seed if r.spec.sampling.is_sampling else None,
            )
        return Generation(
            request_id=r.id, tokens=tokens, prefill_tokens=prefill, generated_text=generated, top_tokens=top
        )

    def _prefill_tokens(self, r: RequestState) -> Tokens:
        n = len(r.prompt_ids)
        lps = ([math.nan] + r.prefill_logprobs[: n - 1]) if r.prefill_logprobs else [math.nan] * n
        lps = (lps + [math.nan] * n)[:n]
        return Tokens(
            ids=list(r.prompt_ids), logprobs=lps, texts=self.decoder.prefill_texts(r.prompt_ids), is_special=[]
        )
