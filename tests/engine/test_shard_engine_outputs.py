"""What the engine emits: seeded sampling, Generation shapes, finish reasons, top-n, prefill logprobs.

``RouterDriver`` checks the per-Generation rules on every response (one token, four equal-length
lists, finite logprobs, exactly one final with ``generated_tokens`` = tokens emitted >= 1, nothing
after it, ``seed`` only when sampling, no token for a request that is preempted); the tests here add
the specific cases: seeded sampling independent of runs, batch composition and preemption; batch
``None`` once all finished; EOS / stop-sequence / length stops; top-n alternatives against HF logits;
prompt logprobs against HF ``log_softmax`` (also across chunks, after prefix reuse and preemption).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
    spec,
)
from tests.helpers.tiny_models import EOS_ID
from tgi_paged_backend.engine.types import BatchSpec, FinishReason, SamplingParams

SAMPLED = dict(do_sample=True, temperature=0.8, top_k=20)
BIG_SEED = 2**64 - 12345  # the router sends full u64 seeds


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(seed=seed, **SAMPLED)


# --------------------------------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible_across_runs_and_batch_compositions(tiny_llama_dir):
    text = make_text(50, 8)
    target = 7

    def run(engine, others: list[tuple[str, int]], position: int, join: bool = False) -> list[int]:
        requests = [spec(100 + i, t, n, sampling=sampled(1000 + i)) for i, (t, n) in enumerate(others)]
        requests.insert(position, spec(target, text, 12, sampling=sampled(BIG_SEED)))
        driver = RouterDriver(engine)
        if join:  # the sampled request joins a running batch mid-flight
            mine = requests.pop(position)
            batch = driver.prefill(BatchSpec(id=1, requests=tuple(requests)))
            batch = driver.decode([batch])
            driver.drain(driver.prefill(BatchSpec(id=2, requests=(mine,)), cached=batch))
        else:
            driver.run(BatchSpec(id=1, requests=tuple(requests)))
        driver.assert_idle()
        final = driver.final[target].generated_text
        assert final.seed == BIG_SEED and final.generated_tokens == 12
        return driver.tokens[target]

    engine = make_engine(tiny_llama_dir, num_blocks=40)
    alone = run(engine, [], 0)
    assert run(engine, [], 0) == alone  # same engine, again (prefix now retained)
    assert run(make_engine(tiny_llama_dir, num_blocks=40), [], 0) == alone  # fresh engine
    others = [(make_text(51, 20), 14), (make_text(52, 3), 5), (make_text(53, 11), 9)]
    assert run(engine, others, 0) == alone
    assert run(engine, others, 2) == alone
    assert run(engine, others[:2], 2, join=True) == alone
    # Different seed, different text (sanity: the seed is actually used).
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=3, requests=(spec(9, text, 12, sampling=sampled(7)),)))
    assert driver.tokens[9] != alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_survives_preemption(tiny_llama_dir, mode):
    requests = tuple(spec(rid, make_text(rid, 3), 20, sampling=sampled(900 + rid)) for rid in (40, 41, 42, 44))
    roomy = RouterDriver(make_engine(tiny_llama_dir, num_blocks=64))
    roomy.run(BatchSpec(id=0, requests=requests))
    assert roomy.engine.stats.preemptions == {"swap": 0, "recompute": 0}
    tight = RouterDriver(make_engine(tiny_llama_dir, num_blocks=9, preemption=mode))
    tight.run(BatchSpec(id=0, requests=requests))
    assert tight.engine.stats.preemptions[mode] > 0
    assert tight.tokens == roomy.tokens
    tight.assert_idle()


def test_greedy_requests_have_no_seed_and_warpers_mean_sampling(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=32)
    driver = RouterDriver(engine)
    text = make_text(55, 6)
    requests = (
        spec(1, text, 4, sampling=SamplingParams(seed=5)),
        spec(2, text, 4, sampling=SamplingParams(seed=5, temperature=0.7)),
    )  # do_sample off
    driver.run(BatchSpec(id=0, requests=requests))
    assert driver.final[1].generated_text.seed is None
    assert driver.final[2].generated_text.seed == 5


# ---------------------------------------------------------------------------------- shape rules


def test_lifecycle_final_once_then_gone_and_batch_none(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir, num_blocks=32)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 4), n) for rid, n in ((1, 1), (2, 3), (3, 6))]
    batch = driver.prefill(BatchSpec(id=4, requests=tuple(requests)))
    # max_new_tokens=1: the final Generation comes with the prefill; request 1 is gone at once.
    assert driver.final[1].generated_text.generated_tokens == 1
    assert batch.request_ids == [2, 3] and batch.size == 2
    driver.drain(batch)
    for r in requests:
        gens = driver.generations[r.id]
        assert len(gens) == r.stopping.max_new_tokens
        assert [g.generated_text is not None for g in gens] == [False] * (len(gens) - 1) + [True]
        assert gens[-1].generated_text.finish_reason is FinishReason.LENGTH
    listed = [set(res.batch.request_ids) if res.batch else set() for res in driver.results]
    assert listed == [{2, 3}, {2, 3}, {3}, {3}, {3}, set()]
    assert driver.results[-1].batch is None  # the engine itself answers batch=None (no ClearCache)
    driver.assert_idle()


# --------------------------------------------------------------------------------- EOS and stops


@pytest.fixture(scope="module")
def eos_llama(tiny_llama_dir, tmp_path_factory, hf_greedy):
    """Tiny Llama whose EOS logit is 1.5x the logit of a token greedy decoding picks at step 4."""
    text = make_text(60, 5)
    engine = make_engine(tiny_llama_dir, num_blocks=16)
    ids = prompt_ids(engine, text)
    ref = hf_greedy.models.get(str(tiny_llama_dir))
    if ref is None:
        hf_greedy(tiny_llama_dir, ids, 1)
        ref = hf_greedy.models[str(tiny_llama_dir)]
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=6,
            do_sample=False,
            min_new_tokens=6,
            output_logits=True,
            return_dict_in_generate=True,
        )
    step = next(k for k in range(3, 6) if out.logits[k][0].max() > 0 and int(out.logits[k][0].argmax()) != EOS_ID)
    token = int(out.logits[step][0].argmax())
    path = tmp_path_factory.mktemp("eos-llama")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, path / f.name)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][EOS_ID] = 1.5 * weights["lm_head.weight"][token]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path, text


def test_eos_stops_with_eos_token_like_hf(eos_llama, hf_greedy):
    model_dir, text = eos_llama
    engine = make_engine(model_dir, num_blocks=16)
    ids = prompt_ids(engine, text)
    want = hf_greedy(model_dir, ids, 12, stop_at_eos=True)
    assert want[-1] == EOS_ID and len(want) < 12, "fixture must make greedy decoding hit EOS"
    driver = RouterDriver(engine)
    driver.run(
        BatchSpec(id=0, requests=(spec(1, text, 12, ignore_eos=False), spec(2, make_text(61, 3), 12, ignore_eos=False)))
    )
    assert driver.tokens[1] == want
    final = driver.final[1]
    assert final.generated_text.finish_reason is FinishReason.EOS_TOKEN
    assert final.generated_text.generated_tokens == len(want)
    assert final.tokens.is_special == [True] and final.tokens.texts == ["</s>"]
    assert "</s>" not in final.generated_text.text
    driver.assert_idle()


def test_eos_ignored_and_length_wins_over_eos(eos_llama, hf_greedy):
    model_dir, text = eos_llama
    engine = make_engine(model_dir, num_blocks=16)
    want = hf_greedy(model_dir, prompt_ids(engine, text), 12, stop_at_eos=True)
    driver = RouterDriver(engine)
    driver.run(
        BatchSpec(id=0, requests=(spec(1, text, 12, ignore_eos=True), spec(2, text, len(want), ignore_eos=False)))
    )
    assert driver.tokens[1][: len(want)] == want and len(driver.tokens[1]) == 12
    assert driver.final[1].generated_text.finish_reason is FinishReason.LENGTH
    assert driver.tokens[2] == want  # the last token is EOS, but max_new_tokens is checked first
    assert driver.final[2].generated_text.finish_reason is FinishReason.LENGTH


def find_stop(texts: list[str]) -> tuple[str, int] | None:
    """A stop string the running output first ends with after token ``k`` (k >= 2), and ``k``."""
    for k in range(2, len(texts) - 1):
        full = "".join(texts[: k + 1])
        earlier = ["".join(texts[: j + 1]) for j in range(k)]
        for width in range(2, len(full) + 1):
            cand = full[-width:]
            if cand.strip() and not any(e.endswith((cand, cand + "\n")) for e in earlier):
                return cand, k
    return None


def test_stop_sequence_stops_and_is_included(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=16)
    for seed in range(62, 72):  # random tiny models often emit ids without text: find a talkative prompt
        text = make_text(seed, 5)
        free = RouterDriver(engine)
        free.run(BatchSpec(id=0, requests=(spec(1, text, 12),)))
        found = find_stop(free.texts[1])
        if found:
            break
    assert found, "no prompt produced text"
    stop, k = found
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=1, requests=(spec(2, text, 12, stop_sequences=("zzz-never", stop)),)))
    assert driver.tokens[2] == free.tokens[1][: k + 1]
    final = driver.final[2].generated_text
    assert final.finish_reason is FinishReason.STOP_SEQUENCE and final.generated_tokens == k + 1
    assert final.text.endswith(stop)
    driver.assert_idle()


# -------------------------------------------------------------------------------------- top-n


def test_top_n_tokens_are_the_n_best_highest_first(tiny_llama_dir, hf_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=16)
    text = make_text(63, 6)
    ids = prompt_ids(engine, text)
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=0, requests=(spec(1, text, 4, top_n_tokens=5), spec(2, text, 4))))
    ref = hf_greedy.models.get(str(tiny_llama_dir))
    if ref is None:
        hf_greedy(tiny_llama_dir, ids, 1)
        ref = hf_greedy.models[str(tiny_llama_dir)]
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=4,
            do_sample=False,
            min_new_tokens=4,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert driver.tokens[1] == out.sequences[0, len(ids) :].tolist()
    for step, g in enumerate(driver.generations[1]):
        (top,) = g.top_tokens
        assert len(top.ids) == len(top.logprobs) == len(top.texts) == len(top.is_special) == 5
        assert top.logprobs == sorted(top.logprobs, reverse=True)
        assert top.ids[0] == g.tokens.ids[0] and top.logprobs[0] == pytest.approx(g.tokens.logprobs[0], abs=1e-5)
        lp = torch.log_softmax(out.logits[step][0].float(), -1)
        want = torch.topk(lp, 5)
        assert top.ids == want.indices.tolist()
        assert top.logprobs == pytest.approx(want.values.tolist(), abs=1e-4)
    assert all(g.top_tokens == [] for g in driver.generations[2])


# ----------------------------------------------------------------------------- prefill logprobs


def hf_prompt_logprobs(hf_greedy, model_dir, ids) -> list[float]:
    ref = hf_greedy.models.get(str(model_dir))
    if ref is None:
        hf_greedy(model_dir, ids, 1)
        ref = hf_greedy.models[str(model_dir)]
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return lp.tolist()


def check_prefill_tokens(driver, engine, rid, want_ids, want_lps) -> None:
    gens = driver.generations[rid]
    assert gens[0].prefill_tokens is not None and all(g.prefill_tokens is None for g in gens[1:])
    pt = gens[0].prefill_tokens
    assert pt.ids == want_ids and len(pt.logprobs) == len(pt.texts) == len(want_ids)
    assert math.isnan(pt.logprobs[0])
    assert pt.logprobs[1:] == pytest.approx(want_lps, abs=1e-4)
    assert pt.texts == engine.decoder.token_texts(want_ids)


@pytest.mark.parametrize("chunked", [False, True])
def test_prefill_logprobs_match_hf_log_softmax(tiny_qwen2_dir, hf_greedy, chunked):
    engine = make_engine(tiny_qwen2_dir, num_blocks=40, REQUEST_LOGPROBS="1")
    if chunked:
        router_warmup(engine, 16)  # prompts of ~40-60 tokens then take 3-4 forwards
    driver = RouterDriver(engine)
    texts = [make_text(70, 14), make_text(71, 20), make_text(72, 5)]
    requests = (
        spec(1, texts[0], 3, prefill_logprobs=True),
        spec(2, texts[1], 3, prefill_logprobs=True),
        spec(3, texts[2], 3),
    )
    driver.run(BatchSpec(id=0, requests=requests))
    if chunked:
        assert not driver.results[0].generations or 2 not in {g.request_id for g in driver.results[0].generations}
    for rid, t in ((1, texts[0]), (2, texts[1])):
        ids = prompt_ids(engine, t)
        check_prefill_tokens(driver, engine, rid, ids, hf_prompt_logprobs(hf_greedy, tiny_qwen2_dir, ids))
    assert all(g.prefill_tokens is None for g in driver.generations[3])
    driver.assert_idle()


def test_prefill_logprobs_need_request_logprobs_enabled(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir, num_blocks=16)
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=0, requests=(spec(1, make_text(73, 5), 2, prefill_logprobs=True),)))
    assert all(g.prefill_tokens is None for g in driver.generations[1])


def test_prefill_logprobs_complete_for_a_repeated_prompt(tiny_qwen2_dir, hf_greedy):
    engine = make_engine(tiny_qwen2_dir, num_blocks=40, REQUEST_LOGPROBS="1")
    text = make_text(74, 16)
    ids = prompt_ids(engine, text)
    want = hf_prompt_logprobs(hf_greedy, tiny_qwen2_dir, ids)
    for rid in (1, 2):  # the second arrives after the first finished: its prompt blocks are retained
        driver = RouterDriver(engine)
        driver.run(BatchSpec(id=rid, requests=(spec(rid, text, 2, prefill_logprobs=True),)))
        check_prefill_tokens(driver, engine, rid, ids, want)


def test_prefill_logprobs_survive_recompute_preemption_mid_prefill(tiny_llama_dir, hf_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=9, preemption="recompute", REQUEST_LOGPROBS="1")
    router_warmup(engine, 16)
    driver = RouterDriver(engine)
    old = spec(1, make_text(80, 3), 40)  # decodes and grows into the blocks of the younger request
    text = make_text(81, 18)
    young = spec(2, text, 2, prefill_logprobs=True, chunk_len=5)
    batch = driver.prefill(BatchSpec(id=0, requests=(old, young)))
    preempted_while_prefilling = False
    while batch is not None:
        batch = driver.decode([batch])
        if not driver.tokens[2] and engine.requests[2].is_preempted:
            preempted_while_prefilling = True
    assert preempted_while_prefilling
    ids = prompt_ids(engine, text)
    check_prefill_tokens(driver, engine, 2, ids, hf_prompt_logprobs(hf_greedy, tiny_llama_dir, ids))


def test_prefill_logprobs_never_come_from_another_requests_blocks_at_resume(tiny_llama_dir, hf_greedy):
    # A prompt-logprobs request preempted mid-prefill resumes after a request with the same prompt
    # finished: that one's retained blocks cover positions this request never computed (no logits),
    # so it must recompute its prompt itself -- admission and resume follow the same rule.
    # (With the resume matching as admission did not, 19 of its 58 prompt logprobs came back NaN.)
    engine = make_engine(tiny_llama_dir, num_blocks=17, preemption="recompute", REQUEST_LOGPROBS="1")
    router_warmup(engine, 16)
    driver = RouterDriver(engine)
    text = make_text(82, 18)
    donor = spec(1, text, 6)  # same prompt, no logprobs: finishes while the young one waits
    old = spec(2, make_text(83, 20), 40)  # grows into the young request's blocks
    young = spec(3, text, 2, prefill_logprobs=True, chunk_len=5)
    batch = driver.prefill(BatchSpec(id=0, requests=(donor, old, young)))
    preempted_while_prefilling = resumed_after_donor = False
    while batch is not None:
        batch = driver.decode([batch])
        state = engine.requests.get(3)
        if state is not None and not driver.tokens[3] and state.is_preempted:
            preempted_while_prefilling = True
            resumed_after_donor = 1 not in engine.requests
    assert preempted_while_prefilling and resumed_after_donor
    ids = prompt_ids(engine, text)
    check_prefill_tokens(driver, engine, 3, ids, hf_prompt_logprobs(hf_greedy, tiny_llama_dir, ids))
