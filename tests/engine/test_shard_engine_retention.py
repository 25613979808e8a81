"""Generated tokens join the prefix cache as prompts do (issue 14, item 4).

A finished request's full blocks -- prompt *and* generated positions -- are retained, so a chat
follow-up that re-sends the conversation reuses them, and a recompute resume re-prefills only what
is no longer cached.
"""

from __future__ import annotations

from tests.engine.conftest import RouterDriver, make_engine, make_text, prompt_ids, spec
from tgi_paged_backend.engine.types import BatchSpec

BLOCK_SIZE = 8


def test_a_finished_requests_generated_blocks_are_matched_by_its_history(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=40, block_size=BLOCK_SIZE)
    driver = RouterDriver(engine)
    text = make_text(90, 6)
    driver.run(BatchSpec(id=0, requests=(spec(1, text, 20),)))
    history = prompt_ids(engine, text) + driver.tokens[1]
    # K/V exists for every position but the last sampled token's; full blocks of it are retained.
    written = len(history) - 1
    engine.kv.add_request(99)
    match = engine.kv.match_prefix(99, history)
    assert match.num_cached_tokens >= written // BLOCK_SIZE * BLOCK_SIZE > len(history) - 20
    engine.kv.free(99)


def test_a_follow_up_reuses_the_generated_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=40, block_size=BLOCK_SIZE)
    driver = RouterDriver(engine)
    text = make_text(90, 6)
    driver.run(BatchSpec(id=0, requests=(spec(1, text, 20),)))
    prompt = prompt_ids(engine, text)
    reply = driver.generations[1][-1].generated_text.text
    follow_up = text + reply + " and then"
    shared = 0  # leading tokens the follow-up's prompt has in common with the first history
    for a, b in zip(prompt + driver.tokens[1], prompt_ids(engine, follow_up)):
        if a != b:
            break
        shared += 1
    full_shared = min(shared, len(prompt) + 19) // BLOCK_SIZE * BLOCK_SIZE  # written positions only
    assert full_shared > len(prompt) // BLOCK_SIZE * BLOCK_SIZE  # some shared block holds generated tokens
    before = engine.stats.prefix_hit_tokens
    RouterDriver(engine).run(BatchSpec(id=1, requests=(spec(2, follow_up, 2),)))
    assert engine.stats.prefix_hit_tokens - before >= full_shared
