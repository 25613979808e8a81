"""Greedy decoding through ModelRunner's paged pool matches ``model.generate`` token for token.

Tiny random Llama, Qwen2 and Mistral (sliding window 24, shorter than the longest sequences)
models; several prompts of different lengths packed into one prefill; shuffled physical blocks
at block sizes 8 and 16. Variants: chunked prefill, late arrivals (mixed prefill + decode steps),
recompute after dropping K/V, and blocks moved by copy_blocks or a swap round trip. Phi-3 (fused
QKV, window 20) and Gemma 2 (soft-capping, alternating window-8 layers) are checked against a
cache-less HF forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.paged_driver import PagedDriver, greedy_hf, greedy_hf_full_recompute, greedy_paged
from tests.helpers.tiny_models import EOS_ID, EXTRA_KINDS, PAD_ID, TINY_KINDS, load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner

MAX_NEW_TOKENS = 20
PROMPT_LENGTHS = (5, 17, 33, 41)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1234)
    return [rng.integers(4, 320, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(tiny_model_factory: Callable[..., Path], prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """HF greedy generations per model kind (eager attention, DynamicCache)."""
    return {
        kind: greedy_hf(load_reference(tiny_model_factory(kind)), prompts, MAX_NEW_TOKENS, [EOS_ID], PAD_ID)
        for kind in TINY_KINDS
    }


@pytest.fixture(scope="module")
def runners(tiny_model_factory: Callable[..., Path]) -> Callable[[str, int], ModelRunner]:
    made: dict[tuple[str, int], ModelRunner] = {}

    def get(kind: str, block_size: int) -> ModelRunner:
        if (kind, block_size) not in made:
            made[kind, block_size] = ModelRunner(
                ModelConfig(model_id=str(tiny_model_factory(kind))), CacheConfig(block_size=block_size), "cpu"
            )
        return made[kind, block_size]

    return get


def test_reference_is_not_degenerate(expected: dict[str, list[list[int]]]) -> None:
    for outputs in expected.values():
        assert all(len(set(tokens)) > 3 for tokens in outputs)
        assert len({tuple(tokens) for tokens in outputs}) == len(outputs)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_packed_prefill_then_decode(kind, block_size, runners, prompts, expected) -> None:
    assert greedy_paged(runners(kind, block_size), prompts, MAX_NEW_TOKENS, seed=block_size) == expected[kind]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_chunked_prefill(kind, block_size, runners, prompts, expected) -> None:
    # chunk 16: the prompts take 1, 2, 3 and 3 chunks
    assert greedy_paged(runners(kind, block_size), prompts, MAX_NEW_TOKENS, chunk_size=16) == expected[kind]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_late_arrivals_mix_prefill_and_decode(kind, runners, prompts, expected) -> None:
    got = greedy_paged(runners(kind, 8), prompts, MAX_NEW_TOKENS, chunk_size=12, arrival_steps=[0, 3, 4, 9])
    assert got == expected[kind]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_recompute_after_dropping_kv(kind, block_size, runners, prompts, expected) -> None:
    def hook(driver: PagedDriver) -> None:
        if driver.step_index == 5:  # requests 1 and 3 preempted by recompute mid-decode
            driver.drop_kv(1)
            driver.drop_kv(3)
        if driver.step_index == 12:  # everyone
            for i in range(len(driver.requests)):
                if not driver.requests[i].done:
                    driver.drop_kv(i)

    assert greedy_paged(runners(kind, block_size), prompts, MAX_NEW_TOKENS, hook=hook) == expected[kind]


@pytest.mark.parametrize("kind", EXTRA_KINDS)
def test_other_families(kind, tiny_model_factory, prompts) -> None:
    path = tiny_model_factory(kind)
    want = greedy_hf_full_recompute(load_reference(path), prompts, MAX_NEW_TOKENS, [EOS_ID])
    runner = ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=8), "cpu")
    assert greedy_paged(runner, prompts, MAX_NEW_TOKENS) == want
    assert greedy_paged(runner, prompts, MAX_NEW_TOKENS, chunk_size=16, arrival_steps=[0, 2, 2, 5]) == want


@pytest.mark.parametrize("via", ["copy", "swap"])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_blocks_moved_mid_generation(kind, via, runners, prompts, expected) -> None:
    runner = runners(kind, 8)
    runner.allocate_swap_space(64)

    def hook(driver: PagedDriver) -> None:
        if driver.step_index in (4, 11):
            for i, request in enumerate(driver.requests):
                if not request.done:
                    driver.move_blocks(i, via)

    assert greedy_paged(runner, prompts, MAX_NEW_TOKENS, hook=hook) == expected[kind]


@pytest.mark.parametrize("via", ["copy", "swap"])
def test_moved_blocks_give_identical_logits(via, runners, prompts) -> None:
    """The decode step after a copy / swap round trip produces bit-identical logits."""
    runner = runners("llama", 16)
    runner.allocate_swap_space(32)
    logits = []
    for move in (False, True):
        driver = PagedDriver(runner, num_blocks=64, seed=7)
        for prompt in prompts:
            driver.add_request(prompt)
        driver.step(MAX_NEW_TOKENS)  # prefill
        if move:
            for i in range(len(prompts)):
                driver.move_blocks(i, via)
        driver.step(MAX_NEW_TOKENS)  # decode over the (moved) blocks
        logits.append(driver.last_logits.clone())
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_prefill_logits_for_every_prompt_position(runners, tiny_model_factory, prompts) -> None:
    """``all_logits`` rows (prompt logprobs) match the HF forward over the prompt."""
    from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch

    runner = runners("qwen2", 16)
    runner.allocate_kv_cache(32)
    prompt = prompts[2]
    batch = build_forward_batch(
        [RequestChunk(prompts[0], 0, [5]), RequestChunk(prompt, 0, [9, 2, 30], all_logits=True)], 16
    )
    got = runner.forward(batch)
    assert got.shape == (1 + len(prompt), runner.spec.vocab_size) and got.dtype == torch.float32
    with torch.no_grad():
        want = load_reference(tiny_model_factory("qwen2"))(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got[1:], want, rtol=1e-4, atol=1e-4)
