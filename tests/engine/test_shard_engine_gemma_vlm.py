"""Gemma 3 (vision) and PaliGemma served end to end (issue 40): their image tokens (Gemma 3) or whole prompt
(PaliGemma's prefix-LM) attend bidirectionally. Tiny random checkpoints (:mod:`tests.helpers.gemma_vlm_models`)
through the shard engine, token for token against HF ``generate`` with the same images, ``pixel_values`` and the
processors' ``token_type_ids``: one image, images batched with text-only requests, chunked prefill (the chunk
boundary moves out of a span), prefix retention (the same image hits, another misses), recompute and swap
preemption (the scenarios of :mod:`tests.helpers.llava_next_scenarios`); without the spans the tokens differ; a
span longer than the prefill budget is refused at admission; the prompt text is stock's."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.conftest import RouterDriver, make_engine, make_text, router_warmup
from tests.helpers import llava_next_scenarios as scenarios
from tests.helpers.gemma_vlm_models import GemmaVlmReference, write_gemma_vlm_model
from tests.helpers.llava_next_scenarios import GREEN, RED, WIDE, counting_encodes, image_spec, mismatches
from tgi_paged_backend.engine.types import BatchSpec, InvalidRequestError

FAMILIES = {"gemma3": ("gemma3", "gemma"), "paligemma": ("paligemma", "gemma"), "paligemma2": ("paligemma", "gemma2")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tmp_path_factory):
    family, text_model = FAMILIES[request.param]
    return write_gemma_vlm_model(tmp_path_factory.mktemp(request.param), family, text_model=text_model)


@pytest.fixture(scope="module")
def reference(model_dir) -> GemmaVlmReference:
    return GemmaVlmReference(model_dir)


def _text(engine, ids) -> str:
    return engine.image_prompts.tokenizer.tokenizer.decode(ids, skip_special_tokens=False)


def test_prompt_text_is_stocks(model_dir) -> None:
    """Gemma 3: ``\\n\\n<start_of_image>`` + soft tokens + ``<end_of_image>\\n\\n`` per image, the request's special
    tokens; PaliGemma: ``<image>`` × N, each text chunk as ``<bos>`` + text + ``\\n``, no special tokens, text-only
    prompts wrapped too (stock's ``preprocess_text``)."""
    engine = make_engine(model_dir, num_blocks=32)
    ids, images = engine.image_prompts.encode(image_spec(engine, None, 1, [RED, "caption en"]))
    if engine.runner.model.config.model_type == "gemma3":
        soft = "<image_soft_token>" * 16
        assert _text(engine, ids) == f"<s>\n\n<start_of_image>{soft}<end_of_image>\n\ncaption en"
        assert images.bidirectional == images.spans == (range(4, 20),)
        assert engine.image_prompts.encode(image_spec(engine, None, 2, ["caption en"]))[1] is None
    else:
        assert _text(engine, ids) == "<image>" * 16 + "<bos>caption en\n"
        assert images.bidirectional == (range(0, len(ids)),)
        text_ids, text_only = engine.image_prompts.encode(image_spec(engine, None, 2, ["caption en"]))
        assert _text(engine, text_ids) == "<bos>caption en\n" and text_only.bidirectional == (range(len(text_ids)),)


def test_single_image_request(model_dir, reference) -> None:
    run = scenarios.single(model_dir)
    assert mismatches(run, reference) == [] and run.encodes == [1]
    run.driver.assert_idle()


def test_the_bidirectional_mask_and_the_image_matter(model_dir, reference) -> None:
    """HF's tokens change with another image and with a causal mask over the spans (the test can fail)."""
    engine = make_engine(model_dir, num_blocks=32)
    ids, _ = engine.image_prompts.encode(image_spec(engine, None, 1, ["the fox ", RED, " is quick"]))
    bidirectional = reference.greedy(ids, [RED], 16)
    assert bidirectional != reference.greedy(ids, [GREEN], 16)
    causal = GemmaVlmReference.__new__(GemmaVlmReference)
    causal.__dict__.update(reference.__dict__, _cache={})
    if causal.prefix_lm:
        causal.prefix_lm = False  # token_type_ids 1: no prefix
    else:
        causal.image_token_id = -1  # no image tokens marked
    assert causal.greedy(ids, [RED], 16) != bidirectional


def test_images_batched_with_text_only_requests(model_dir, reference) -> None:
    run = scenarios.mixed_batch(model_dir)
    assert mismatches(run, reference) == [] and run.encodes == [2, 1]
    run.driver.assert_idle()


def test_chunked_prefill_moves_the_boundary_out_of_a_span(model_dir, reference) -> None:
    """The router's ``chunk_len`` of 11 falls inside the first image: Gemma 3's first chunk ends before it (the
    image goes whole in the next); PaliGemma's prompt is one span, computed whole in the first step."""

    def after_first_chunk(run) -> None:
        state = run.engine.requests[20]
        span = state.attend_spans[0]
        if run.engine.runner.model.config.model_type == "gemma3":
            assert 0 < span.start < 11 < span.stop and state.num_computed == span.start
        else:
            assert state.num_computed == len(state.prompt_ids) == span.stop and state.output_ids

    run = scenarios.chunked_prefill(model_dir, then=after_first_chunk)
    assert mismatches(run, reference) == [] and run.encodes == [2]
    run.driver.assert_idle()


def test_a_span_waits_for_room_in_the_step(model_dir, reference) -> None:
    """A 32-token budget: the first request's prompt takes most of it, so the second request's image (Gemma 3) or
    prompt (PaliGemma) does not fit what is left and waits a step instead of being cut; both exact."""
    engine = make_engine(model_dir, num_blocks=64)
    router_warmup(engine, 32)
    driver = RouterDriver(engine)
    first, second = (image_spec(engine, None, 50, ["a ", RED, " b"], 6), image_spec(engine, None, 51, [GREEN, " c"], 6))
    n_first = len(engine.image_prompts.encode(first)[0])
    batch = driver.prefill(BatchSpec(id=7, requests=(first, second)))
    assert engine.requests[50].num_computed == n_first  # the older request's prompt fits the budget whole
    assert engine.requests[51].num_computed in (0, engine.requests[51].attend_spans[0].start)
    driver.drain(batch)
    assert mismatches(scenarios.ScenarioRun(engine, driver, [first, second]), reference) == []


def test_prefix_retention_is_keyed_by_the_image_and_the_span(model_dir, reference) -> None:
    """The same image (and, PaliGemma, the same whole prompt) hits everything but the last prompt token; another
    image hits only the blocks before its span (Gemma 3) or nothing (PaliGemma: the span is the whole prompt)."""
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    router_warmup(engine, 256)
    calls = counting_encodes(engine)
    driver = RouterDriver(engine)
    prefix = make_text(30, 5)
    first, again, other = (image_spec(engine, None, rid, [prefix, im, " is quick"], 5) for rid, im in
                           ((30, RED), (31, RED), (32, GREEN)))  # fmt: skip
    ids, images = engine.image_prompts.encode(first)
    assert engine.image_prompts.encode(other)[0] == ids
    driver.run(BatchSpec(id=4, requests=(first,)))
    hits = []
    for spec in (again, other):
        before = engine.stats.prefix_hit_tokens
        driver.run(BatchSpec(id=spec.id, requests=(spec,)))
        hits.append(engine.stats.prefix_hit_tokens - before)
    assert hits[0] == len(ids) - 1
    span = images.bidirectional[0]
    assert span.start - 4 < hits[1] <= span.start
    assert calls == [1, 1]
    assert mismatches(scenarios.ScenarioRun(engine, driver, [first, again, other]), reference) == []
    driver.assert_idle()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(model_dir, reference, mode) -> None:
    run = scenarios.preemption(model_dir, mode)
    assert run.engine.stats.preemptions[mode] > 0, run.engine.stats.preemptions
    assert mismatches(run, reference) == []
    assert len(run.encodes) > 3 if mode == "recompute" else run.encodes == [1, 1, 1], run.encodes
    run.driver.assert_idle()


def test_a_span_longer_than_the_prefill_budget_is_refused(model_dir) -> None:
    """A 16-token budget cannot hold a 16-token image and its neighbours (PaliGemma: the whole prompt), nor a
    longer span: INVALID_ARGUMENT for that request, nothing registered."""
    engine = make_engine(model_dir, num_blocks=64)
    router_warmup(engine, 8)
    spec = image_spec(engine, None, 60, ["the fox ", WIDE, " is quick"], 4)
    with pytest.raises(InvalidRequestError, match="bidirectional span of .* prefill budget"):
        engine.prefill(BatchSpec(id=9, requests=(spec,)), None)
    assert engine.requests == {}
    text_only = dataclasses.replace(spec, id=61, chunks=(), text="hi")
    engine.prefill(BatchSpec(id=10, requests=(text_only,)), None)  # a short prompt still runs
    assert 61 in engine.requests


def test_paligemma2_prompt_longer_than_the_window_is_refused(model_dir) -> None:
    """transformers lets PaliGemma 2's prefix see past the sliding window (56 here, 4096 released): a longer
    prompt is INVALID_ARGUMENT, a shorter one runs."""
    engine = make_engine(model_dir, num_blocks=64)
    router_warmup(engine, 256)
    if getattr(engine.runner.image_encoder, "span_window", None) is None:
        pytest.skip("no window the prefix sees past: Gemma 3 (windowed spans), PaliGemma (1)'s Gemma language model")
    long = image_spec(engine, None, 80, [RED, make_text(80, 30)], 4)
    assert len(engine.image_prompts.encode(long)[0]) > 56
    with pytest.raises(InvalidRequestError, match="longer than the sliding window"):
        engine.prefill(BatchSpec(id=11, requests=(long,)), None)
    assert engine.requests == {}


def test_stock_routers_reservation_is_enough(model_dir, reference) -> None:
    """Stock's router reserves ``input_length + max_new_tokens - 1`` slots, ``input_length`` counting each image as
    its placeholders (the replay's rule) and the text with the tokenizer's BOS. PaliGemma's shard prompt is longer
    (the server-side ``<bos>`` + text + ``\\n`` wrap): admitted all the same, token-exact."""
    from types import SimpleNamespace

    from integration.router_replay.image_tokens import router_image_rule
    from tests.engine.conftest import RouterBlocks

    engine = make_engine(model_dir, num_blocks=64)
    router_warmup(engine, 256)
    config = engine.runner.model.config
    rule = router_image_rule(SimpleNamespace(model_type=config.model_type, text_config=config.text_config))
    tokenizer = engine.image_prompts.tokenizer.tokenizer
    input_length = len(tokenizer(rule(40, 24) + "caption en").input_ids)
    max_new = next(n for n in range(6, 14) if (input_length + n - 1) % 8 == 0)  # the reservation fills its blocks
    spec = image_spec(engine, None, 90, [RED, "caption en"], max_new)
    got = RouterBlocks(engine).allocate(input_length + max_new - 1)
    assert got is not None
    spec = dataclasses.replace(spec, blocks=got[0], slots=got[1])
    shard_length = len(engine.image_prompts.encode(spec)[0])
    assert shard_length == input_length + 1 if config.model_type == "paligemma" else shard_length == input_length - 240
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=12, requests=(spec,)))
    assert mismatches(scenarios.ScenarioRun(engine, driver, [spec]), reference) == []
