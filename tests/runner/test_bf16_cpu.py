"""bfloat16 on CPU (``--dtype bfloat16``): packed bf16 linears where oneDNN computes bf16, the compiled
decode kernel over a bf16 pool, against HF's own bf16 modules.

Token-exactness is the fp32 oracle (``test_runner_parity``); in bf16 two correct implementations
round differently, so the statement here is a logits tolerance: for every token the paged runner
chose greedily, HF's bf16 forward over the same sequence (no cache) gives that token a logit within
``LOGIT_TOLERANCE`` of its maximum (it is a near-argmax for HF too), and the first-step logits agree to
the same tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.paged_driver import greedy_paged
from tests.helpers.tiny_models import load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu.fast_layers import can_pack
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner

LOGIT_TOLERANCE = 0.1
"""Max |logit difference| against HF bf16 (tiny random models' logits are O(1); bf16 has 8 bits of mantissa)."""

PROMPTS = [[5, 9, 31, 7, 100, 4], [17, 3, 250, 250, 8, 61, 2, 90, 11, 42, 6]]


@pytest.fixture(scope="module")
def bf16_pair(tiny_model_factory: Callable[..., Path]) -> tuple[ModelRunner, torch.nn.Module]:
    path = tiny_model_factory("llama")
    runner = ModelRunner(ModelConfig(model_id=str(path), dtype="bfloat16"), CacheConfig(block_size=4), "cpu")
    return runner, load_reference(path).to(torch.bfloat16)


def test_bf16_linears_are_packed_where_onednn_computes_bf16(bf16_pair) -> None:
    runner, _ = bf16_pair
    assert runner.dtype == torch.bfloat16 and runner.kv_dtype == torch.bfloat16
    assert (runner.fast_layers.packed_linears > 0) == can_pack(torch.bfloat16, torch.device("cpu"))


def test_bf16_prefill_logits_match_hf_bf16(bf16_pair) -> None:
    runner, reference = bf16_pair
    runner.allocate_kv_cache(16)
    prompt = PROMPTS[1]
    batch = build_forward_batch([RequestChunk(token_ids=prompt, num_computed=0, block_table=[3, 1, 7])], 4)
    ours = runner.forward(batch)[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0, -1].float()
    assert (ours - theirs).abs().max().item() <= LOGIT_TOLERANCE


def test_every_bf16_greedy_token_is_a_near_argmax_for_hf_bf16(bf16_pair) -> None:
    runner, reference = bf16_pair
    generations = greedy_paged(runner, PROMPTS, 12, num_blocks=32)
    for prompt, generated in zip(PROMPTS, generations):
        sequence = torch.tensor([prompt + generated])
        with torch.no_grad():
            logits = reference(sequence).logits[0].float()
        for step, token in enumerate(generated):
            row = logits[len(prompt) - 1 + step]
            assert row.max().item() - row[token].item() <= LOGIT_TOLERANCE, (step, token)
