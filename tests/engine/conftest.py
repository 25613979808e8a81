"""Shared helpers for the shard-engine tests (``test_shard_engine_*.py``).

- model fixtures from ``tests.helpers.fixtures`` (tiny Llama/Qwen2/Mistral, SmolLM2);
- :func:`make_engine`: a ``PagedShardEngine`` from env-style knobs (never touches ``os.environ``);
- :class:`RouterBlocks`: the router's ``SimpleAllocator`` (virtual ids, block 0 never handed out,
  LIFO free list, ``slots = block * bs + offset``, ``len = prompt + max_new - 1``);
- :class:`RouterDriver`: plays the router's side of Prefill/Decode/FilterBatch and checks the
  ``Generation`` shape rules plus ``kv.check_invariants()`` after every RPC;
- ``hf_greedy``: cached ``model.generate`` references.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import TINY_CORPUS, load_reference
from tgi_paged_backend.engine import build_engine
from tgi_paged_backend.engine.request_state import RequestStatus
from tgi_paged_backend.engine.types import (
    U64_MAX,
    BatchSpec,
    FinishReason,
    Generation,
    RequestSpec,
    SamplingParams,
    StepResult,
    StoppingParams,
)
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.model_files import with_local_model

TINY_KIND_FIXTURES = {"llama": "tiny_llama_dir", "qwen2": "tiny_qwen2_dir", "mistral": "tiny_mistral_dir"}


@pytest.fixture(autouse=True)
def _one_torch_thread(request):
    """Tiny models on a shared 2-core box: one intra-op thread is ~10x faster than two contending."""
    if not request.module.__name__.rpartition(".")[2].startswith("test_shard_engine"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=sorted(TINY_KIND_FIXTURES))
def tiny_dir(request) -> Path:
    """Each tiny model family in turn."""
    return request.getfixturevalue(TINY_KIND_FIXTURES[request.param])


# ------------------------------------------------------------------------------------ engine


def make_engine(
    model_dir: Path,
    *,
    num_blocks: int = 64,
    block_size: int = 8,
    preemption: str = "recompute",
    swap_gb: float = 0.01,
    speculate: int | None = 0,
    **env: str,
):
    """Engine on ``model_dir`` with a capped physical pool (``num_blocks`` incl. the scratch block).

    ``PREFIX_CACHING`` is on unless ``env`` says otherwise: the launcher's choice for these models."""
    settings = {
        "TGI_PAGED_NUM_BLOCKS": str(num_blocks),
        "TGI_PAGED_BLOCK_SIZE": str(block_size),
        "TGI_PAGED_PREEMPTION": preemption,
        "TGI_PAGED_SWAP_SPACE_GB": str(swap_gb),
        "PREFIX_CACHING": "1",
        "TGI_PAGED_SPECULATE_MAX_BATCH": "64",  # drafts in batched decode steps too (CPU's default: alone only)
    }
    settings.update({k: str(v) for k, v in env.items()})
    return build_engine(with_local_model(build_config({"model_id": str(model_dir), "speculate": speculate}, settings)))


def warmup_batch(
    max_prefill_tokens: int,
    *,
    max_input_tokens: int | None = None,
    max_total_tokens: int | None = None,
    max_batch_size: int | None = None,
) -> BatchSpec:
    """The router's warmup batch (``grpc_client.rs::warmup``), image chunk already dropped."""
    requests = []
    n_tokens = 0
    while n_tokens < max_prefill_tokens:
        truncate = max_prefill_tokens - n_tokens
        if max_input_tokens is not None:
            truncate = min(truncate, max_input_tokens)
        max_new = max_total_tokens - truncate if max_total_tokens is not None else 1
        requests.append(
            RequestSpec(
                id=0,
                text="_test " * truncate,
                truncate=truncate,
                add_special_tokens=True,
                sampling=SamplingParams(
                    temperature=0.9,
                    top_k=10,
                    top_p=0.9,
                    typical_p=0.9,
                    do_sample=False,
                    seed=0,
                    repetition_penalty=1.2,
                    frequency_penalty=0.1,
                    watermark=True,
                ),
                stopping=StoppingParams(max_new_tokens=max_new, ignore_eos_token=True),
                prefill_logprobs=True,
                top_n_tokens=20,
            )
        )
        n_tokens += truncate
        if max_batch_size is not None and len(requests) == max_batch_size:
            break
    return BatchSpec(id=0, requests=tuple(requests), max_tokens=max_input_tokens or 0)


def router_warmup(
    engine,
    max_prefill_tokens: int,
    *,
    max_input_tokens: int | None = None,
    max_total_tokens: int | None = None,
    max_batch_size: int | None = None,
):
    batch = warmup_batch(
        max_prefill_tokens,
        max_input_tokens=max_input_tokens,
        max_total_tokens=max_total_tokens,
        max_batch_size=max_batch_size,
    )
    return engine.warmup(
        batch,
        max_input_tokens=max_input_tokens,
        max_prefill_tokens=max_prefill_tokens,
        max_total_tokens=max_total_tokens,
    )


def prompt_ids(engine, text: str, truncate: int = 10_000, add_special_tokens: bool = True) -> list[int]:
    """The prompt as the engine (and a tokenizer-aligned router) tokenizes it."""
    return engine.prompt_tokenizer.encode(text, truncate, add_special_tokens)


def make_text(seed: int, num_words: int) -> str:
    """Deterministic text from the tiny tokenizer's corpus words."""
    words = " ".join(TINY_CORPUS).split()
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(num_words))


def spec(
    rid: int, text: str, max_new: int = 8, *, ignore_eos: bool = True, truncate: int = 10_000, **kw
) -> RequestSpec:
    """A shard-managed request (no router blocks)."""
    return RequestSpec(
        id=rid,
        text=text,
        truncate=truncate,
        stopping=StoppingParams(
            max_new_tokens=max_new, ignore_eos_token=ignore_eos, stop_sequences=tuple(kw.pop("stop_sequences", ()))
        ),
        **kw,
    )


# ------------------------------------------------------------------------------------ router


class RouterBlocks:
    """The router's ``SimpleAllocator`` over ``max_supported_total_tokens // block_size`` blocks."""

    def __init__(self, engine, num_tokens: int | None = None) -> None:
        self.block_size = engine.block_size
        total = engine.capacity.max_supported_total_tokens if num_tokens is None else num_tokens
        self.free = list(range(1, total // self.block_size))  # block 0: health checks only

    def allocate(self, num_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        need = -(-num_tokens // self.block_size)
        if need > len(self.free):
            return None
        blocks = self.free[len(self.free) - need :]
        del self.free[len(self.free) - need :]
        slots = [b * self.block_size + o for b in blocks for o in range(self.block_size)][:num_tokens]
        return tuple(blocks), tuple(slots)

    def release(self, blocks) -> None:
        self.free.extend(blocks)


def router_spec(
    engine,
    blocks: RouterBlocks,
    rid: int,
    text: str,
    max_new: int = 8,
    *,
    truncate: int = 10_000,
    add_special_tokens: bool = True,
    ignore_eos: bool = True,
    **kw,
) -> RequestSpec:
    """A request with router-style reservations: ``len(slots) = prompt + max_new - 1``."""
    n = len(prompt_ids(engine, text, truncate, add_special_tokens))
    got = blocks.allocate(n + max_new - 1)
    assert got is not None, "router virtual pool exhausted"
    b, s = got
    return RequestSpec(
        id=rid,
        text=text,
        truncate=truncate,
        add_special_tokens=add_special_tokens,
        stopping=StoppingParams(
            max_new_tokens=max_new, ignore_eos_token=ignore_eos, stop_sequences=tuple(kw.pop("stop_sequences", ()))
        ),
        blocks=b,
        slots=s,
        **kw,
    )


class RouterDriver:
    """The router's bookkeeping around one engine, with the contract's shape checks.

    ``entries`` are live requests (router view); a final ``Generation`` removes the entry and frees its
    router blocks at once; then the router's ``filter_batch`` step runs (FilterBatch / ClearCache only
    when ``size`` differs from the live entries).
    """

    def __init__(self, engine, blocks: RouterBlocks | None = None, *, check_preempted: bool = True) -> None:
        self.engine = engine
        self.blocks = blocks
        self.check_preempted = check_preempted
        self.entries: dict[int, RequestSpec] = {}
        self.tokens: dict[int, list[int]] = {}
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.generations: dict[int, list[Generation]] = {}
        self.final: dict[int, Generation] = {}
        self.results: list[StepResult] = []
        self.num_rpcs = 0

    # -- RPCs ---------------------------------------------------------------------------------
    def prefill(self, batch: BatchSpec, cached=None):
        for r in batch.requests:
            self.entries[r.id] = r
            self.tokens.setdefault(r.id, [])
            self.texts.setdefault(r.id, [])
            self.logprobs.setdefault(r.id, [])
            self.generations.setdefault(r.id, [])
        result = self.engine.prefill(batch, None if cached is None else cached.id)
        return self._absorb(result)

    def decode(self, batches):
        result = self.engine.decode([b.id for b in batches])
        return self._absorb(result)

    def drain(self, batch, max_steps: int = 2000):
        """Decode until the batch is gone."""
        for _ in range(max_steps):
            if batch is None:
                return None
            batch = self.decode([batch])
        raise AssertionError("batch did not finish")

    def run(self, batch: BatchSpec, max_steps: int = 2000):
        return self.drain(self.prefill(batch), max_steps)

    # -- checks -------------------------------------------------------------------------------
    def _absorb(self, result: StepResult):
        self.num_rpcs += 1
        self.results.append(result)
        engine = self.engine
        seen = set()
        for g in result.generations:
            rid = g.request_id
            assert rid in self.entries, f"Generation for unknown or finished request {rid}"
            assert rid not in seen, f"two Generations for request {rid} in one response"
            seen.add(rid)
            t = g.tokens
            speculate = engine.config.model.num_speculative_tokens
            assert 1 <= len(t.ids) <= 1 + speculate, "one token per Generation, up to 1 + speculate with it"
            assert len(t.ids) == len(t.logprobs) == len(t.texts) == len(t.is_special)
            assert all(math.isfinite(x) for x in t.logprobs)
            self.tokens[rid].extend(t.ids)
            self.texts[rid].extend(t.texts)
            self.logprobs[rid].extend(t.logprobs)
            self.generations[rid].append(g)
            spec_ = self.entries[rid]
            assert len(self.tokens[rid]) <= spec_.stopping.max_new_tokens
            if spec_.top_n_tokens:
                assert len(g.top_tokens) == len(t.ids)
            else:
                assert g.top_tokens == []
            if g.generated_text is None:
                if self.check_preempted and rid in engine.requests:
                    assert engine.requests[rid].status is RequestStatus.RUNNING, (
                        f"request {rid} got a token but is {engine.requests[rid].status}"
                    )
                continue
            gt = g.generated_text
            assert gt.generated_tokens == len(self.tokens[rid]) >= 1
            assert gt.finish_reason in tuple(FinishReason)
            if gt.finish_reason is FinishReason.LENGTH:
                assert gt.generated_tokens == spec_.stopping.max_new_tokens
            assert (gt.seed is not None) == spec_.sampling.is_sampling
            self.final[rid] = g
            del self.entries[rid]
            if self.blocks is not None and spec_.blocks:
                self.blocks.release(spec_.blocks)
        engine.kv.check_invariants()
        batch = result.batch
        if batch is None:
            return None
        assert batch.size == len(batch.request_ids) == len(set(batch.request_ids))
        for rid in batch.request_ids:
            assert rid not in self.final or self.final[rid] in [g for g in result.generations], (
                f"finished request {rid} still listed in a later CachedBatch"
            )
        kept = [rid for rid in batch.request_ids if rid in self.entries]
        if len(kept) == batch.size:
            return batch
        if not kept:
            self.engine.clear_cache(batch.id)
            engine.kv.check_invariants()
            return None
        batch = self.engine.filter_batch(batch.id, kept)
        engine.kv.check_invariants()
        assert batch.request_ids == kept
        return batch

    def assert_idle(self) -> None:
        assert not self.entries, f"requests never finished: {sorted(self.entries)}"
        assert self.engine.batches == {} and self.engine.requests == {}
        assert self.engine.kv.num_used_blocks == 0
        self.engine.kv.check_invariants()


# ------------------------------------------------------------------------------------ liveness


LIVENESS = BatchSpec(
    id=U64_MAX,
    requests=(
        RequestSpec(
            id=U64_MAX,
            text="liveness",
            truncate=1,
            add_special_tokens=False,
            blocks=(0,),
            slots=(0,),
            stopping=StoppingParams(max_new_tokens=1),
        ),
    ),
    max_tokens=2,
    max_blocks=1,
)


def probe(engine) -> None:
    """The router's health Prefill: one final token, no batch, nothing left behind."""
    used, retained, requests = engine.kv.num_used_blocks, engine.kv.num_retained_blocks, set(engine.requests)
    batches = {k: list(v) for k, v in engine.batches.items()}
    result = engine.prefill(LIVENESS, None)
    assert result.batch is None
    (g,) = result.generations
    assert g.request_id == U64_MAX and len(g.tokens.ids) == 1
    assert g.generated_text.generated_tokens == 1 and g.generated_text.finish_reason is FinishReason.LENGTH
    assert U64_MAX not in engine.requests and U64_MAX not in engine.batches
    assert set(engine.requests) == requests and engine.batches == batches
    assert engine.kv.num_used_blocks == used and engine.kv.num_retained_blocks <= retained
    engine.kv.check_invariants()


# ------------------------------------------------------------------------------------ reference


@pytest.fixture(scope="session")
def hf_greedy():
    """``hf_greedy(model_dir, ids, n, stop_at_eos=False) -> list[int]`` (HF ``generate``, cached)."""
    models: dict[str, torch.nn.Module] = {}
    cache: dict[tuple, list[int]] = {}

    def run(model_dir, ids, n: int, stop_at_eos: bool = False) -> list[int]:
        key = (str(model_dir), tuple(ids), n, stop_at_eos)
        if key not in cache:
            if str(model_dir) not in models:
                models[str(model_dir)] = load_reference(model_dir)
            ref = models[str(model_dir)]
            x = torch.tensor([list(ids)])
            kwargs = dict(max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x))
            if not stop_at_eos:
                kwargs["min_new_tokens"] = n
            with torch.no_grad():
                out = ref.generate(x, **kwargs)
            cache[key] = out[0, x.shape[1] :].tolist()
        return cache[key]

    run.models = models  # type: ignore[attr-defined]
    return run
