"""LLaVA-NeXT served end to end (issue 40): a tiny random checkpoint (CLIP tower, Llama language model)
through the shard engine, token for token against HF ``generate`` with the same images as
``pixel_values``: one image, images batched with text-only requests, chunked prefill cutting inside an
image, prefix retention keyed by the image bytes, recompute and swap preemption, a bad image refused
alone, Warmup's vision peak. The family matrix's scenarios are text-only by construction; LLaVA-NeXT's
row runs the scenarios of :mod:`tests.helpers.llava_next_scenarios`, which these tests assert on."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, make_text, router_warmup
from tests.helpers import llava_next_scenarios as scenarios
from tests.helpers.llava_next_models import LlavaNextReference, write_llava_next_model
from tests.helpers.llava_next_scenarios import GREEN, RED, counting_encodes, image_spec, mismatches
from tgi_paged_backend.engine.types import BatchSpec, ImageInput, InvalidRequestError, RequestSpec, StoppingParams


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return write_llava_next_model(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def reference(llava_dir) -> LlavaNextReference:
    return LlavaNextReference(llava_dir)


def expect_reference(engine, reference, driver, specs) -> None:
    run = scenarios.ScenarioRun(engine, driver, list(specs))
    assert mismatches(run, reference) == []


def test_single_image_request(llava_dir, reference) -> None:
    run = scenarios.single(llava_dir)
    ids, images = run.engine.image_prompts.encode(run.specs[0])
    assert images is not None and len(images.spans[0]) == ids.count(run.engine.image_prompts.image_token_id) == 46
    assert mismatches(run, reference) == [] and run.encodes == [1]
    run.driver.assert_idle()


def test_images_change_the_tokens(llava_dir, reference) -> None:
    """The images matter: the same placeholders with other pixels give other tokens."""
    engine = make_engine(llava_dir, num_blocks=32)
    red, green = (image_spec(engine, None, 1, ["the fox ", im, " is quick"]) for im in (RED, GREEN))
    ids = engine.image_prompts.encode(red)[0]
    assert ids == engine.image_prompts.encode(green)[0]
    assert reference.greedy(ids, [RED], 8) != reference.greedy(ids, [GREEN], 8)


def test_images_batched_with_text_only_requests(llava_dir, reference) -> None:
    run = scenarios.mixed_batch(llava_dir)
    assert [s.chunks != () for s in run.specs] == [False, True, False, True]
    assert mismatches(run, reference) == [] and run.encodes == [2, 1]
    run.driver.assert_idle()


def test_chunked_prefill_cuts_inside_images(llava_dir, reference) -> None:
    def after_first_chunk(run) -> None:
        state = run.engine.requests[20]
        assert state.images.spans[0].start < 11 < state.images.spans[0].stop  # the first chunk cut WIDE
        assert state.num_computed == 11 and not run.driver.tokens[20]
        assert state.images.features is not None  # held across the prefill's chunks
        step = run.engine.last_step  # telemetry: the chunk's image positions, both images encoded
        assert step.image_tokens == 11 - state.images.spans[0].start and step.images_encoded == 2

    run = scenarios.chunked_prefill(llava_dir, then=after_first_chunk)
    assert mismatches(run, reference) == [] and run.encodes == [2]  # encoded once for every chunk
    run.driver.assert_idle()


def test_speculation_under_preemption(llava_dir, reference) -> None:
    run = scenarios.preemption(llava_dir, "recompute", reference=reference)
    stats = run.engine.stats
    assert stats.preemptions["recompute"] > 0 and 0 < stats.accepted_tokens < stats.draft_tokens, stats
    assert mismatches(run, reference) == []
    run.driver.assert_idle()


def test_prefix_retention_is_keyed_by_the_image(llava_dir, reference) -> None:
    engine = make_engine(llava_dir, num_blocks=64, block_size=4)
    router_warmup(engine, 256)
    calls = counting_encodes(engine)
    driver = RouterDriver(engine)
    prefix = make_text(30, 5)
    first, again, other = (image_spec(engine, None, rid, [prefix, im, " is quick"], 5) for rid, im in
                           ((30, RED), (31, RED), (32, GREEN)))  # fmt: skip
    ids, images = engine.image_prompts.encode(first)
    assert images is not None and engine.image_prompts.encode(other)[0] == ids
    driver.run(BatchSpec(id=4, requests=(first,)))
    hits = []
    for spec in (again, other):
        before = engine.stats.prefix_hit_tokens
        driver.run(BatchSpec(id=spec.id, requests=(spec,)))
        hits.append(engine.stats.prefix_hit_tokens - before)
    assert hits[0] == len(ids) - 1  # the same image: everything but the last prompt token (its logits)
    assert hits[1] == images.spans[0].start  # another image: only the positions before it
    assert calls == [1, 1]  # the hit skipped the image entirely; the miss encoded its own
    expect_reference(engine, reference, driver, [first, again, other])
    driver.assert_idle()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(llava_dir, reference, mode) -> None:
    run = scenarios.preemption(llava_dir, mode)
    assert run.engine.stats.preemptions[mode] > 0, run.engine.stats.preemptions
    assert mismatches(run, reference) == []
    if mode == "recompute":  # a preempted image request re-encoded its image from the bytes
        assert run.encodes[:3] == [1, 1, 1] and len(run.encodes) > 3, run.encodes
    else:  # swap keeps the KV: nothing is encoded again
        assert run.encodes == [1, 1, 1], run.encodes
    run.driver.assert_idle()


def test_bad_image_is_refused_alone(llava_dir, reference) -> None:
    engine = make_engine(llava_dir, num_blocks=64)
    router_warmup(engine, 256)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    running = [
        image_spec(engine, blocks, 50, ["the fox ", RED], 8),
        image_spec(engine, blocks, 51, [make_text(51, 4)], 8),
    ]
    batch = driver.prefill(BatchSpec(id=6, requests=tuple(running)))
    bad = RequestSpec(
        id=52,
        text="see ",
        truncate=10_000,
        chunks=("see ", ImageInput(b"not an image", "image/png")),
        stopping=StoppingParams(max_new_tokens=4),
    )
    with pytest.raises(InvalidRequestError, match=r"request 52: image 0 .* cannot be decoded"):
        engine.prefill(BatchSpec(id=7, requests=(bad,)), None)
    assert set(engine.requests) == {50, 51} and 52 not in engine.requests  # nothing of it was registered
    driver.drain(batch)
    expect_reference(engine, reference, driver, running)
    driver.assert_idle()


def test_placeholder_text_without_images_is_refused(llava_dir) -> None:
    engine = make_engine(llava_dir, num_blocks=32)
    spec = image_spec(engine, None, 60, ["a literal <image> in the text"])
    with pytest.raises(InvalidRequestError, match="image placeholder tokens"):
        engine.prefill(BatchSpec(id=8, requests=(spec,)), None)
    assert engine.requests == {}


def test_warmup_counts_the_vision_peak(llava_dir) -> None:
    from tgi_paged_backend.vision.activation_peak import largest_image

    engine = make_engine(llava_dir, num_blocks=32)
    encoder = engine.runner.image_encoder
    image = largest_image(encoder)
    sizes = [(h, w) for h in range(8, 300, 13) for w in range(8, 300, 17)]  # no image gets more placeholders
    assert image.size == (64, 64) and encoder.token_count(image) == max(
        encoder.token_count(image.resize((w, h))) for h, w in sizes
    )
    text_peak = engine.runner.profile_prefill(64)
    router_warmup(engine, 64)
    held = engine.image_prompts.max_images * encoder.token_count(image) * engine.runner.spec.hidden_size * 4  # fp32
    assert engine.runner.activation_peak_bytes >= text_peak + held


def test_router_count_that_disagrees_is_refused(llava_dir) -> None:
    """The router budgets ``input_length`` with the same rule (exact for LLaVA-NeXT); reservations sized from
    another count cannot hold the prompt: INVALID_ARGUMENT for that request, nothing registered."""
    engine = make_engine(llava_dir, num_blocks=64)
    router_warmup(engine, 256)
    blocks = RouterBlocks(engine)
    spec = image_spec(engine, None, 70, ["the fox ", RED], 4)
    n = len(engine.image_prompts.encode(spec)[0])
    got = blocks.allocate(n - 10 + 4 - 1)  # ten placeholders fewer than the shard's count
    assert got is not None
    short = RequestSpec(**{**{k: getattr(spec, k) for k in ("id", "text", "truncate", "chunks", "stopping")},
                           "blocks": got[0], "slots": got[1]})  # fmt: skip
    with pytest.raises(InvalidRequestError, match="router and shard tokenizers may disagree"):
        engine.prefill(BatchSpec(id=9, requests=(short,)), None)
    assert engine.requests == {}


def test_routers_warmup_with_its_image(llava_dir) -> None:
    """Stock's v3 client warms a VLM up with its text chunk then a 20x20 PNG labelled ``image/jpeg;base64``
    (left truncation cuts the text, never the image): Warmup runs it and frees everything."""
    import dataclasses

    from integration.router_replay.client import WARMUP_IMAGE
    from tests.engine.conftest import warmup_batch

    engine = make_engine(llava_dir, num_blocks=64)
    calls = counting_encodes(engine)
    plain = warmup_batch(256)
    image = ImageInput(WARMUP_IMAGE, "image/jpeg;base64")
    batch = dataclasses.replace(
        plain, requests=tuple(dataclasses.replace(r, chunks=(r.text, image)) for r in plain.requests)
    )
    result = engine.warmup(batch, max_input_tokens=None, max_prefill_tokens=256, max_total_tokens=None)
    assert result.max_supported_total_tokens > 0 and engine.requests == {} and engine.kv.num_used_blocks == 0
    assert calls[0] == engine.image_prompts.max_images == 8 and calls[1:] == [1] * len(
        plain.requests
    )  # the peak, then the batch


def test_max_images_per_request_is_a_setting(llava_dir) -> None:
    """``TGI_PAGED_MAX_IMAGES_PER_REQUEST``: more images are INVALID_ARGUMENT and touch no state; Warmup encodes
    that many of the largest image for the vision peak."""
    from integration.router_replay.client import WARMUP_IMAGE
    from tests.engine.conftest import warmup_batch

    engine = make_engine(llava_dir, num_blocks=64, TGI_PAGED_MAX_IMAGES_PER_REQUEST="2")
    calls = counting_encodes(engine)
    plain = warmup_batch(256)
    image = ImageInput(WARMUP_IMAGE, "image/jpeg;base64")
    batch = dataclasses.replace(
        plain, requests=tuple(dataclasses.replace(r, chunks=(r.text, image)) for r in plain.requests)
    )
    engine.warmup(batch, max_input_tokens=None, max_prefill_tokens=256, max_total_tokens=None)
    assert calls[0] == 2
    three = image_spec(engine, None, 7, ["a", RED, "b", GREEN, "c", RED])
    with pytest.raises(InvalidRequestError, match="3 images, this model accepts at most 2"):
        engine.prefill(BatchSpec(id=5, requests=(three,)), None)
    assert engine.requests == {} and engine.kv.num_used_blocks == 0
