"""A real model end to end: SmolLM2-135M-Instruct, greedy, preempted, token-identical to HF."""

from __future__ import annotations

import pytest

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, prompt_ids, router_spec
from tgi_paged_backend.engine.types import BatchSpec, FinishReason

MAX_NEW = 16


@pytest.mark.slow
def test_smollm2_greedy_under_preemption_matches_hf(smollm2_dir, hf_greedy):
    # 9 physical blocks of 8 (64 tokens): the three requests need ~110 token slots together.
    engine = make_engine(smollm2_dir, num_blocks=9, preemption="auto", swap_gb=0.05)
    tokenizer = engine.runner.tokenizer
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompts = [("The capital of Germany is", True), ("def fibonacci(n):", True), (chat, False)]
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [
        router_spec(engine, blocks, i, text, MAX_NEW, add_special_tokens=special, ignore_eos=False)
        for i, (text, special) in enumerate(prompts)
    ]
    lengths = [len(prompt_ids(engine, r.text, r.truncate, r.add_special_tokens)) for r in requests]
    assert sum(lengths) + 3 * MAX_NEW > 64 and max(lengths) + MAX_NEW <= 64, lengths
    batch = driver.prefill(BatchSpec(id=0, requests=tuple(requests[:2])))
    batch = driver.decode([batch])
    driver.drain(driver.prefill(BatchSpec(id=1, requests=(requests[2],)), cached=batch))
    assert sum(engine.stats.preemptions.values()) > 0, engine.stats.preemptions
    driver.assert_idle()
    for r in requests:
        ids = prompt_ids(engine, r.text, r.truncate, r.add_special_tokens)
        want = hf_greedy(smollm2_dir, ids, MAX_NEW, stop_at_eos=True)
        assert driver.tokens[r.id] == want, r.text
        reason = driver.final[r.id].generated_text.finish_reason
        assert reason is (FinishReason.EOS_TOKEN if len(want) < MAX_NEW else FinishReason.LENGTH)
    # The chat answer ends with <|im_end|> (EOS) before 16 tokens; its text leaves the EOS out.
    assert driver.final[2].generated_text.finish_reason is FinishReason.EOS_TOKEN
    assert "Paris" in driver.final[2].generated_text.text
    assert "<|im_end|>" not in driver.final[2].generated_text.text
