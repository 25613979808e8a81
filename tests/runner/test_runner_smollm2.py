"""The real SmolLM2-135M-Instruct (GGUF from PyPI, converted once and cached): paged greedy == HF greedy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paged_driver import greedy_hf, greedy_paged
from tests.helpers.tiny_models import load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner

pytestmark = pytest.mark.slow

QUESTIONS = ("What is the capital of France?", "Write a haiku about paged memory.")


def test_smollm2_greedy_matches_hf_generate(smollm2_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(model_id=str(smollm2_dir)), CacheConfig(block_size=16), "cpu")
    tokenizer = runner.tokenizer
    assert tokenizer.chat_template
    assert runner.spec.num_layers == 30 and runner.spec.num_kv_heads == 3 and runner.spec.sliding_window is None
    prompts = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    assert len(prompts[0]) != len(prompts[1])

    got = greedy_paged(runner, prompts, 20, num_blocks=64, seed=3)
    want = greedy_hf(load_reference(smollm2_dir), prompts, 20, runner.eos_token_ids, tokenizer.pad_token_id)
    assert got == want
    assert "Paris" in tokenizer.decode(got[0])


def test_ensure_smollm2_returns_a_complete_dir_without_downloading(smollm2_dir: Path, monkeypatch) -> None:
    import integration.smollm2 as smollm2

    def no_download(*args, **kwargs):
        raise AssertionError("a complete directory must not be downloaded again")

    monkeypatch.setattr(smollm2, "_download_wheel", no_download)
    assert smollm2.ensure_smollm2(smollm2_dir, progress=False) == smollm2_dir
    assert smollm2.is_complete(smollm2_dir)
    assert (smollm2_dir / "chat_template.jinja").is_file() or "chat_template" in (
        smollm2_dir / "tokenizer_config.json"
    ).read_text()
