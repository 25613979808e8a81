"""Idefics3, SmolVLM (Idefics3's architecture under its own ``model_type``) and Idefics2 served end to end
(issue 40): tiny random checkpoints (:mod:`tests.helpers.idefics_models`) through the shard engine, token
for token against HF ``generate`` with the same images as ``pixel_values``: one image, images batched with
text-only requests, chunked prefill cutting inside an image, prefix retention keyed by the image bytes,
recompute and swap preemption (the scenarios of :mod:`tests.helpers.llava_next_scenarios`, which are
family-agnostic); the placeholder text equal to transformers' processor's; a router reservation smaller than
the shard's count refused; tensor parallelism: tests/distributed/test_tp_vlm.py."""

from __future__ import annotations

import io

import pytest
import transformers
from PIL import Image

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, make_text, router_warmup
from tests.helpers import llava_next_scenarios as scenarios
from tests.helpers.idefics_models import IdeficsReference, write_idefics_model
from tests.helpers.llava_next_scenarios import GREEN, RED, SQUARE, WIDE, counting_encodes, image_spec, mismatches
from tgi_paged_backend.engine.types import BatchSpec, InvalidRequestError, RequestSpec
from tgi_paged_backend.vision.idefics_encoder import FAKE_TOKEN, GLOBAL_TAG

FAMILIES = ("idefics3", "smolvlm", "idefics2")


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    return write_idefics_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(model_dir) -> IdeficsReference:
    return IdeficsReference(model_dir)


def _prompt_text(engine, spec) -> str:
    ids, _ = engine.image_prompts.encode(spec)
    return engine.image_prompts.tokenizer.tokenizer.decode(ids, skip_special_tokens=False)


def test_placeholder_text_is_the_processors(model_dir) -> None:
    """The prompt text equals what transformers' processor makes of ``<image>`` in the text, for images the
    processor splits into 2x2, 1x2 and no tiles (Idefics2: 5 crops, touching separators collapsed)."""
    engine = make_engine(model_dir, num_blocks=32)
    encoder = engine.runner.image_encoder
    if encoder.config.model_type == "smolvlm":
        return _smolvlm_prompt_string_is_the_processors(encoder)
    processor = transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    processor.image_seq_len = encoder.crop_tokens if encoder.config.model_type == "idefics2" else encoder.tile_tokens
    for parts in (["the fox ", RED, " is quick"], ["a ", WIDE, SQUARE, " b"], ["x ", GREEN]):
        spec = image_spec(engine, None, 1, parts)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
        text = "".join(p if isinstance(p, str) else "<image>" for p in parts)
        theirs = processor(text=[text], images=[images], return_tensors="pt")["input_ids"][0].tolist()
        ours, _ = engine.image_prompts.encode(spec)
        assert ours == theirs, (_prompt_text(engine, spec), processor.tokenizer.decode(theirs))


def _smolvlm_prompt_string_is_the_processors(encoder) -> None:
    """SmolVLM's processor class needs torchvision and num2words (not installed here): its module's prompt
    function is compared instead, for the same images."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    for data in (RED, WIDE, SQUARE):
        image = Image.open(io.BytesIO(data)).convert("RGB")
        rows, cols = encoder.grid(image)
        theirs = get_image_prompt_string(rows, cols, encoder.tile_tokens, FAKE_TOKEN, "<image>", GLOBAL_TAG)
        assert encoder.placeholder_text(image, "<image>") == theirs


def test_single_image_request(model_dir, reference) -> None:
    run = scenarios.single(model_dir)
    ids, images = run.engine.image_prompts.encode(run.specs[0])
    assert images is not None and len(images.positions[0]) == ids.count(run.engine.image_prompts.image_token_id) == 20
    assert mismatches(run, reference) == [] and run.encodes == [1]
    run.driver.assert_idle()


def test_images_change_the_tokens(model_dir, reference) -> None:
    engine = make_engine(model_dir, num_blocks=32)
    red, green = (image_spec(engine, None, 1, ["the fox ", im, " is quick"]) for im in (RED, GREEN))
    ids = engine.image_prompts.encode(red)[0]
    assert ids == engine.image_prompts.encode(green)[0]
    assert reference.greedy(ids, [RED], 8) != reference.greedy(ids, [GREEN], 8)


def test_images_batched_with_text_only_requests(model_dir, reference) -> None:
    run = scenarios.mixed_batch(model_dir)
    assert mismatches(run, reference) == [] and run.encodes == [2, 1]
    run.driver.assert_idle()


def test_chunked_prefill_cuts_inside_images(model_dir, reference) -> None:
    def after_first_chunk(run) -> None:
        state = run.engine.requests[20]
        assert state.images.spans[0].start < 11 < state.images.spans[0].stop  # the first chunk cut WIDE
        assert state.num_computed == 11 and state.images.features is not None

    run = scenarios.chunked_prefill(model_dir, then=after_first_chunk)
    assert mismatches(run, reference) == [] and run.encodes == [2]
    run.driver.assert_idle()


def test_prefix_retention_is_keyed_by_the_image(model_dir, reference) -> None:
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
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
    assert hits[0] == len(ids) - 1  # the same image: everything but the last prompt token
    assert images.spans[0].start - 4 < hits[1] <= images.spans[0].start  # another image: the blocks before it
    assert calls == [1, 1]
    scenarios_run = scenarios.ScenarioRun(engine, driver, [first, again, other])
    assert mismatches(scenarios_run, reference) == []
    driver.assert_idle()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(model_dir, reference, mode) -> None:
    run = scenarios.preemption(model_dir, mode)
    assert run.engine.stats.preemptions[mode] > 0, run.engine.stats.preemptions
    assert mismatches(run, reference) == []
    if mode == "recompute":
        assert len(run.encodes) > 3, run.encodes
    else:
        assert run.encodes == [1, 1, 1], run.encodes
    run.driver.assert_idle()


def test_router_reservation_short_of_the_shards_count_is_refused(model_dir) -> None:
    """Stock's router budgets Idefics3 with its own hardcoded S = 169: a reservation smaller than the shard's
    own count is INVALID_ARGUMENT for that request, nothing registered."""
    engine = make_engine(model_dir, num_blocks=64)
    router_warmup(engine, 256)
    blocks = RouterBlocks(engine)
    spec = image_spec(engine, None, 70, ["the fox ", RED], 4)
    n = len(engine.image_prompts.encode(spec)[0])
    got = blocks.allocate(n - 10 + 4 - 1)
    assert got is not None
    short = RequestSpec(**{**{k: getattr(spec, k) for k in ("id", "text", "truncate", "chunks", "stopping")},
                           "blocks": got[0], "slots": got[1]})  # fmt: skip
    with pytest.raises(InvalidRequestError, match="router and shard tokenizers may disagree"):
        engine.prefill(BatchSpec(id=9, requests=(short,)), None)
    assert engine.requests == {}


def test_idefics2_without_image_splitting(tmp_path) -> None:
    """One crop per image (``do_image_splitting`` off): 4 latents, still token-exact."""
    path = write_idefics_model(tmp_path / "idefics2", "idefics2", splitting=False)
    run = scenarios.single(path)
    ids, images = run.engine.image_prompts.encode(run.specs[0])
    assert images is not None and len(images.positions[0]) == 4
    assert mismatches(run, IdeficsReference(path)) == []


def test_warmup_image_gets_the_most_placeholders(model_dir) -> None:
    from tgi_paged_backend.vision.activation_peak import largest_image

    engine = make_engine(model_dir, num_blocks=32)
    encoder = engine.runner.image_encoder
    image = largest_image(encoder)
    sizes = [(h, w) for h in range(8, 300, 23) for w in range(8, 300, 29)]
    assert encoder.token_count(image) == max(encoder.token_count(image.resize((w, h))) for h, w in sizes)
