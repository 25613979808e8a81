"""The real SmolLM2-135M-Instruct under ``--quantize fp8``: paged greedy == HF greedy on the dequantized
weights (token-exact, with a mid-generation recompute), and the answer is still right. (On 2 CPU cores
the fp8 path dequantizes each of the 210 linears every step: one short prompt keeps it to ~1 min.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paged_driver import greedy_hf, greedy_paged
from tests.helpers.quant_models import dequantized_reference
from tests.runner.test_runner_smollm2 import QUESTIONS
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner

pytestmark = pytest.mark.slow


def test_smollm2_fp8_greedy_matches_the_dequantized_hf_model(smollm2_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(model_id=str(smollm2_dir), quantize="fp8"), CacheConfig(block_size=16), "cpu")
    tokenizer = runner.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, tokenize=False
    )
    prompts = [tokenizer(text, add_special_tokens=False).input_ids]

    def preempt(driver) -> None:  # recompute mid-decode
        if driver.step_index == 6:
            driver.drop_kv(0)

    got = greedy_paged(runner, prompts, 12, num_blocks=64, seed=3, hook=preempt)
    want = greedy_hf(dequantized_reference(smollm2_dir), prompts, 12, runner.eos_token_ids, tokenizer.pad_token_id)
    assert got == want
    assert "Paris" in tokenizer.decode(got[0])
