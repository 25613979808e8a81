"""Qwen2-VL and Qwen2.5-VL served end to end (issue 40): tiny random checkpoints (vision tower of depth 2,
4 px patches, 2x2 merge, M-RoPE language model) through the shard engine, token for token against HF
``generate`` with the same images (``pixel_values``, ``image_grid_thw``): one image, images batched with
text-only requests, chunked prefill cutting inside an image, prefix retention keyed by the image bytes,
recompute and swap preemption, the router's larger budget. The M-RoPE positions equal transformers'
``get_rope_index`` and change the tokens. The scenarios are :mod:`tests.helpers.llava_next_scenarios`'s
(family-neutral), the rows of ``docs/models.md`` run them too."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, make_text, router_warmup
from tests.helpers import llava_next_scenarios as scenarios
from tests.helpers.llava_next_scenarios import GREEN, RED, SQUARE, WIDE, counting_encodes, image_spec, mismatches
from tests.helpers.qwen2_vl_models import IMAGE_PAD, VISION_END, VISION_START, Qwen2VlReference, write_qwen2_vl_model
from tgi_paged_backend.engine.types import BatchSpec, ImageInput


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_dir(request, tmp_path_factory):
    return write_qwen2_vl_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(qwen_dir) -> Qwen2VlReference:
    return Qwen2VlReference(qwen_dir)


def test_single_image_placeholders_and_tokens(qwen_dir, reference) -> None:
    run = scenarios.single(qwen_dir)
    prompts = run.engine.image_prompts
    ids, images = prompts.encode(run.specs[0])
    tokenizer = prompts.tokenizer.tokenizer
    start, pad, end = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
    span = images.spans[0]
    assert len(span) == 15  # 40x24 px: a 10x6 patch grid, 2x2 merged
    assert ids[span.start - 1] == start and ids[span.stop] == end and ids.count(pad) == 15
    assert images.rope is not None and images.rope.delta == 5 - 15  # 5x3 merged: the image spans max(5, 3) positions
    assert mismatches(run, reference) == [] and run.encodes == [1]
    run.driver.assert_idle()


def test_mrope_positions_equal_transformers(qwen_dir, reference) -> None:
    engine = make_engine(qwen_dir, num_blocks=64)
    spec = image_spec(engine, None, 1, ["the fox ", WIDE, RED, " and ", SQUARE, " is quick"])
    ids, images = engine.image_prompts.encode(spec)
    pil = [Image.open(io.BytesIO(c.data)).convert("RGB") for c in spec.chunks if isinstance(c, ImageInput)]
    grid = reference.processor(pil, return_tensors="pt")["image_grid_thw"]
    x = torch.tensor([ids])
    want, delta = reference.model.model.get_rope_index(x, (x == reference.model.config.image_token_id).int(), grid)
    assert images.rope.prompt.tolist() == want[:, 0].tolist() and images.rope.delta == int(delta)
    assert (
        images.rope.at(torch.tensor([len(ids), len(ids) + 4]).numpy()).tolist()
        == [[len(ids) + int(delta), len(ids) + 4 + int(delta)]] * 3
    )  # past the prompt: the index plus the delta, in all three streams


def test_positions_change_the_tokens(qwen_dir, reference) -> None:
    """Without the 3-D positions (each token at its index) the image request's tokens differ from HF's."""
    run = scenarios.single(qwen_dir)
    engine = make_engine(qwen_dir, num_blocks=32)
    engine.image_prompts.encoder.rope_positions = None
    driver = RouterDriver(engine)
    spec = image_spec(engine, None, 1, ["the fox ", RED, " is quick"])
    driver.run(BatchSpec(id=1, requests=(spec,)))
    assert driver.tokens[1] != run.driver.tokens[1]


def test_images_batched_with_text_only_requests(qwen_dir, reference) -> None:
    run = scenarios.mixed_batch(qwen_dir)
    assert mismatches(run, reference) == [] and run.encodes == [2, 1]
    run.driver.assert_idle()


def test_chunked_prefill_cuts_inside_an_image(qwen_dir, reference) -> None:
    def after_first_chunk(run) -> None:
        state = run.engine.requests[20]
        assert state.images.spans[0].start < 11 < state.images.spans[0].stop  # the first chunk cut WIDE
        assert state.num_computed == 11 and state.images.features is not None

    run = scenarios.chunked_prefill(qwen_dir, then=after_first_chunk)
    assert mismatches(run, reference) == [] and run.encodes == [2]
    run.driver.assert_idle()


def test_prefix_retention_is_keyed_by_the_image(qwen_dir, reference) -> None:
    engine = make_engine(qwen_dir, num_blocks=64, block_size=4)
    router_warmup(engine, 256)
    calls = counting_encodes(engine)
    driver = RouterDriver(engine)
    prefix = make_text(30, 5)
    first, again, other = (image_spec(engine, None, rid, [prefix, im, " is quick"], 6) for rid, im in
                           ((30, RED), (31, RED), (32, GREEN)))  # fmt: skip
    ids, images = engine.image_prompts.encode(first)
    driver.run(BatchSpec(id=4, requests=(first,)))
    hits = []
    for spec in (again, other):
        before = engine.stats.prefix_hit_tokens
        driver.run(BatchSpec(id=spec.id, requests=(spec,)))
        hits.append(engine.stats.prefix_hit_tokens - before)
    assert hits[0] == len(ids) - 1  # the same image: everything but the last prompt token; positions recomputed
    assert hits[1] == images.spans[0].start  # another image: only the text (and vision start) before it
    assert calls == [1, 1]
    assert mismatches(scenarios.ScenarioRun(engine, driver, [first, again, other]), reference) == []
    driver.assert_idle()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(qwen_dir, reference, mode) -> None:
    run = scenarios.preemption(qwen_dir, mode)
    assert run.engine.stats.preemptions[mode] > 0, run.engine.stats.preemptions
    assert mismatches(run, reference) == []  # a recompute re-prefills generated tokens at index + delta
    if mode == "recompute":
        assert len(run.encodes) > 3, run.encodes
    else:
        assert run.encodes == [1, 1, 1], run.encodes
    run.driver.assert_idle()


def test_routers_larger_budget_is_accepted(qwen_dir, reference) -> None:
    """Stock's router budgets ``h*w/patch**2`` pads per image (60 for 40x24 px, the shard places 15): its
    reservation holds more slots than the prompt needs; the shard counts its own and stays exact."""
    from integration.router_replay.images import placeholder_rule

    engine = make_engine(qwen_dir, num_blocks=64)
    router_warmup(engine, 256)
    blocks = RouterBlocks(engine)
    rule = placeholder_rule(engine.image_prompts.encoder.config)
    budget_text = "the fox " + rule(40, 24) + " is quick"
    budget = len(engine.image_prompts.tokenizer.encode(budget_text, 10_000, True))
    spec = image_spec(engine, None, 70, ["the fox ", RED, " is quick"], 8)
    ids, _ = engine.image_prompts.encode(spec)
    assert budget >= len(ids) + 45
    got = blocks.allocate(budget + 8 - 1)
    assert got is not None
    fields = ("id", "text", "truncate", "chunks", "stopping")
    sized = type(spec)(**{**{k: getattr(spec, k) for k in fields}, "blocks": got[0], "slots": got[1]})
    driver = RouterDriver(engine, blocks)
    driver.run(BatchSpec(id=9, requests=(sized,)))
    assert driver.tokens[70] == reference.greedy(ids, [RED], 8)
    driver.assert_idle()


def test_routers_warmup_with_its_image(qwen_dir) -> None:
    """Stock's v3 client warms a VLM up with a 20x20 PNG after its text: Warmup sizes the tower's peak for
    the largest images, runs the batch (M-RoPE positions included) and frees everything."""
    import dataclasses

    from integration.router_replay.client import WARMUP_IMAGE
    from tests.engine.conftest import warmup_batch

    engine = make_engine(qwen_dir, num_blocks=64)
    calls = counting_encodes(engine)
    plain = warmup_batch(256)
    image = ImageInput(WARMUP_IMAGE, "image/jpeg;base64")
    batch = dataclasses.replace(
        plain, requests=tuple(dataclasses.replace(r, chunks=(r.text, image)) for r in plain.requests)
    )
    result = engine.warmup(batch, max_input_tokens=None, max_prefill_tokens=256, max_total_tokens=None)
    assert result.max_supported_total_tokens > 0 and engine.requests == {} and engine.kv.num_used_blocks == 0
    assert calls[0] == engine.image_prompts.max_images and calls[1:] == [1] * len(plain.requests)
    assert engine.runner.image_encoder.token_count(engine.runner.image_encoder.largest_image()) == 64


def test_warmup_encodes_only_the_images_a_request_can_carry(qwen_dir) -> None:
    """With ``max_input_tokens`` 150 a request holds at most two largest images (64 placeholders each):
    Warmup sizes the tower's peak for two, not eight."""
    engine = make_engine(qwen_dir, num_blocks=64)
    calls = counting_encodes(engine)
    router_warmup(engine, 256, max_input_tokens=150, max_total_tokens=200)
    assert calls[0] == 2


def test_decode_runs_the_static_step_with_the_delta(qwen_dir, reference) -> None:
    """Decode rows of an image request have three equal streams (index + delta): they go to the static
    decode step as 1-D positions, and the tokens stay HF's."""
    engine = make_engine(qwen_dir, num_blocks=64)
    engine.runner.prepare_static_decode(256, mode="eager", buckets=(1, 2, 4))
    assert engine.runner.static_decode is not None
    static_runs = []
    plain = engine.runner.static_decode.run
    engine.runner.static_decode.run = lambda batch: static_runs.append(batch.positions.tolist()) or plain(batch)
    driver = RouterDriver(engine)
    specs = [image_spec(engine, None, 80, ["the fox ", RED, " is quick"], 6), image_spec(engine, None, 81, ["hi"], 6)]
    driver.run(BatchSpec(id=10, requests=tuple(specs)))
    ids, images = engine.image_prompts.encode(specs[0])
    assert static_runs and static_runs[0][0] == len(ids) + images.rope.delta  # the first decode: index + delta
    assert mismatches(scenarios.ScenarioRun(engine, driver, specs), reference) == []
    driver.assert_idle()
