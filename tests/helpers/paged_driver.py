"""A minimal greedy engine over :class:`ModelRunner`, for parity tests.

It plays the engine's part with none of its policy: physical blocks come from a shuffled free
list (so block tables are never contiguous), every active request computes its pending tokens
each step (optionally capped per step: chunked prefill), requests may arrive late (mixed
prefill + decode steps), and hooks can drop a request's K/V (recompute) or move its blocks
(copy / swap round trip) between steps. Outputs are compared with ``model.generate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner


@dataclass
class DriverRequest:
    """One request's state: token ids (prompt + generated), computed positions, physical blocks."""

    prompt: list[int]
    arrival_step: int = 0
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


class PagedDriver:
    """Greedy decoding of several requests through a runner's paged pool.

    Parameters
    ----------
    runner : ModelRunner
        Its pool is (re)allocated with ``num_blocks`` blocks.
    num_blocks : int
        Physical blocks; they are handed out in a seeded random order.
    seed : int
        Seed of the block order.
    """

    def __init__(self, runner: ModelRunner, num_blocks: int, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.rng = np.random.default_rng(seed)
        runner.allocate_kv_cache(num_blocks)
        self.free_blocks: list[int] = [int(b) for b in self.rng.permutation(num_blocks)]
        self.requests: list[DriverRequest] = []
        self.step_index = 0
        self.last_logits: torch.Tensor | None = None

    # ------------------------------------------------------------- blocks
    def take_block(self) -> int:
        return self.free_blocks.pop()

    def release(self, blocks: Sequence[int]) -> None:
        """Return blocks to the free list at random places (the next owner gets a scattered table)."""
        for block in blocks:
            self.free_blocks.insert(int(self.rng.integers(0, len(self.free_blocks) + 1)), int(block))

    def drop_kv(self, index: int) -> None:
        """Preempt by recompute: free request ``index``'s blocks; its tokens are recomputed later."""
        request = self.requests[index]
        self.release(request.block_table)
        request.block_table, request.num_computed = [], 0

    def move_blocks(self, index: int, via: str) -> None:
        """Move request ``index``'s K/V to fresh blocks via ``copy_blocks`` or a swap out + in."""
        request = self.requests[index]
        old = list(request.block_table)
        new = [self.take_block() for _ in old]
        if via == "copy":
            self.runner.copy_blocks(old, new)
        elif via == "swap":
            cpu_ids = [int(i) for i in self.rng.permutation(self.runner.num_cpu_blocks)[: len(old)]]
            self.runner.swap_out(old, cpu_ids)
            self.runner.swap_in(cpu_ids, new)
        else:
            raise ValueError(via)
        for layer_caches in (self.runner.k_caches, self.runner.v_caches):  # poison the old copies
            for cache in layer_caches:
                cache[old] = float("nan") if cache.dtype.is_floating_point and cache.element_size() > 1 else 0
        request.block_table = new
        self.release(old)

    # -------------------------------------------------------------- steps
    def add_request(self, prompt: Sequence[int], arrival_step: int = 0) -> None:
        self.requests.append(DriverRequest(prompt=[int(t) for t in prompt], arrival_step=arrival_step))

    def step(self, max_new_tokens: int, chunk_size: int | None = None) -> bool:
        """Run one forward over every active request; return False when nothing was left to do."""
        active = [r for r in self.requests if not r.done and r.arrival_step <= self.step_index]
        self.step_index += 1
        if not active:
            return any(not r.done for r in self.requests)
        chunks = []
        for request in active:
            pending = request.tokens[request.num_computed :]
            if chunk_size is not None:
                pending = pending[:chunk_size]
            needed = -(-(request.num_computed + len(pending)) // self.block_size)
            while len(request.block_table) < needed:
                request.block_table.append(self.take_block())
            chunks.append(RequestChunk(pending, request.num_computed, list(request.block_table)))
        batch = build_forward_batch(chunks, self.block_size)
        logits = self.runner.forward(batch)
        self.last_logits = logits
        eos = set(self.runner.eos_token_ids)
        for row, (request, chunk) in enumerate(zip(active, chunks, strict=True)):
            request.num_computed += len(chunk.token_ids)
            if request.num_computed < len(request.tokens):
                continue  # a prompt chunk: its logits are not used
            token = int(torch.argmax(logits[row]))
            request.tokens.append(token)
            if token in eos or len(request.generated) >= max_new_tokens:
                request.done = True
                self.release(request.block_table)
                request.block_table = []
        return True

    def run(
        self,
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
        hook: Callable[[PagedDriver], None] | None = None,
        max_steps: int = 10_000,
    ) -> list[list[int]]:
        """Step until every request is done; ``hook(driver)`` runs before each step."""
        for _ in range(max_steps):
            if hook is not None:
                hook(self)
            if not self.step(max_new_tokens, chunk_size):
                break
        return [r.generated for r in self.requests]


def greedy_paged(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    num_blocks: int = 128,
    seed: int = 0,
    chunk_size: int | None = None,
    arrival_steps: Sequence[int] | None = None,
    hook: Callable[[PagedDriver], None] | None = None,
) -> list[list[int]]:
    """Greedy generations of ``prompts`` through ``runner`` (see :class:`PagedDriver`)."""
    driver = PagedDriver(runner, num_blocks, seed)
    for i, prompt in enumerate(prompts):
        driver.add_request(prompt, arrival_steps[i] if arrival_steps else 0)
    return driver.run(max_new_tokens, chunk_size=chunk_size, hook=hook)


def greedy_hf(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int | None = None,
) -> list[list[int]]:
    """Reference: ``model.generate(do_sample=False)`` one prompt at a time (no padding involved)."""
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([list(prompt)], dtype=torch.int64)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=list(eos_token_ids),
                pad_token_id=pad_token_id if pad_token_id is not None else eos_token_ids[0],
            )
        outputs.append(out[0, input_ids.shape[1] :].tolist())
    return outputs


def greedy_hf_full_recompute(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_ids: Sequence[int]
) -> list[list[int]]:
    """Reference without any KV cache: a full forward over the whole sequence for every token.

    Independent of the HF cache classes (transformers 4.51's Gemma 2 ``HybridCache`` decodes
    differently from its own cache-less forward at the sliding-window boundary).
    """
    outputs = []
    for prompt in prompts:
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
                tokens.append(int(torch.argmax(logits)))
                if tokens[-1] in eos_token_ids:
                    break
        outputs.append(tokens[len(prompt) :])
    return outputs
