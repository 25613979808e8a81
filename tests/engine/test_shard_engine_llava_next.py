"""LLaVA-NeXT served end to end (issue 40): a tiny random checkpoint (CLIP tower, Llama language model)
through the shard engine, token for token against HF ``generate`` with the same images as
``pixel_values``: one image, images batched with text-only requests, chunked prefill cutting inside an
image, prefix retention keyed by the image bytes, recompute and swap preemption, and a bad image refused
alone. The family matrix is text-only by construction, so this file is LLaVA-NeXT's exactness row."""

from __future__ import annotations

import pytest

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, make_text, router_warmup
from tests.helpers.llava_next_models import LlavaNextReference, png_bytes, write_llava_next_model
from tgi_paged_backend.engine.types import BatchSpec, ImageInput, InvalidRequestError, RequestSpec, StoppingParams

RED, GREEN, WIDE = png_bytes(40, 24, 1), png_bytes(40, 24, 2), png_bytes(24, 64, 3)
"""Two images of the same size (the same placeholders, other pixels) and one of another shape."""


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return write_llava_next_model(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def reference(llava_dir) -> LlavaNextReference:
    return LlavaNextReference(llava_dir)


def image_spec(engine, blocks, rid: int, parts, max_new: int = 8, **kw) -> RequestSpec:
    """A router-style request whose chunks are ``parts`` (text, or PNG bytes for an image)."""
    chunks = tuple(ImageInput(p, "image/png") if isinstance(p, bytes) else p for p in parts)
    text = "".join(c for c in chunks if isinstance(c, str))
    spec = RequestSpec(
        id=rid,
        text=text,
        truncate=10_000,
        chunks=chunks if any(isinstance(c, ImageInput) for c in chunks) else (),
        stopping=StoppingParams(max_new_tokens=max_new, ignore_eos_token=True),
        **kw,
    )
    if blocks is None:
        return spec
    n = len(engine.image_prompts.encode(spec)[0])
    got = blocks.allocate(n + max_new - 1)
    assert got is not None, "router virtual pool exhausted"
    return RequestSpec(**{**_fields(spec), "blocks": got[0], "slots": got[1]})


def _fields(spec: RequestSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def expect_reference(engine, reference, driver, specs) -> None:
    for spec in specs:
        ids, _ = engine.image_prompts.encode(spec)
        images = [c.data for c in spec.chunks if isinstance(c, ImageInput)]
        want = reference.greedy(ids, images, spec.stopping.max_new_tokens)
        assert driver.tokens[spec.id] == want, f"request {spec.id}"


def counting_encodes(engine) -> list[int]:
    """Count the engine's image encodes (one entry per call: the images encoded)."""
    encoder = engine.runner.image_encoder
    calls: list[int] = []
    plain = encoder.encode

    def encode(images):
        calls.append(len(images))
        return plain(images)

    encoder.encode = encode
    return calls


def test_single_image_request(llava_dir, reference) -> None:
    engine = make_engine(llava_dir, num_blocks=32)
    calls = counting_encodes(engine)
    driver = RouterDriver(engine)
    spec = image_spec(engine, None, 1, ["the fox ", RED, " is quick"])
    ids, images = engine.image_prompts.encode(spec)
    assert images is not None and len(images.spans[0]) == sum(
        1 for t in ids if t == engine.image_prompts.image_token_id
    )
    driver.run(BatchSpec(id=1, requests=(spec,)))
    expect_reference(engine, reference, driver, [spec])
    assert calls == [1]
    driver.assert_idle()


def test_images_change_the_tokens(llava_dir, reference) -> None:
    """The fixture's images matter: the same placeholders with other pixels give other tokens."""
    engine = make_engine(llava_dir, num_blocks=32)
    red, green = (image_spec(engine, None, 1, ["the fox ", im, " is quick"]) for im in (RED, GREEN))
    ids = engine.image_prompts.encode(red)[0]
    assert ids == engine.image_prompts.encode(green)[0]
    assert reference.greedy(ids, [RED], 8) != reference.greedy(ids, [GREEN], 8)


def test_images_batched_with_text_only_requests(llava_dir, reference) -> None:
    engine = make_engine(llava_dir, num_blocks=64)
    router_warmup(engine, 256)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    specs = [
        image_spec(engine, blocks, 10, [make_text(10, 6)], 10),
        image_spec(engine, blocks, 11, ["look: ", WIDE, " and ", RED, make_text(11, 3)], 10),
        image_spec(engine, blocks, 12, [make_text(12, 4)], 6),
        image_spec(engine, blocks, 13, [GREEN, " what is it?"], 9),
    ]
    assert engine.requests == {}
    driver.run(BatchSpec(id=2, requests=tuple(specs)))
    expect_reference(engine, reference, driver, specs)
    driver.assert_idle()


def test_chunked_prefill_cuts_inside_images(llava_dir, reference) -> None:
    engine = make_engine(llava_dir, num_blocks=64)
    router_warmup(engine, 256)
    calls = counting_encodes(engine)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    spec = image_spec(engine, blocks, 20, ["the fox ", WIDE, RED, " is quick"], 6, chunk_len=11)
    ids, images = engine.image_prompts.encode(spec)
    assert images is not None and images.spans[0].start < 11 < images.spans[0].stop  # the first chunk cuts WIDE
    batch = driver.prefill(BatchSpec(id=3, requests=(spec,)))
    assert engine.requests[20].num_computed == 11 and not driver.tokens[20]
    assert engine.requests[20].images.features is not None  # held across the prefill's chunks
    driver.drain(batch)
    expect_reference(engine, reference, driver, [spec])
    assert calls == [2]  # encoded once for every chunk
    driver.assert_idle()


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


SQUARE = png_bytes(32, 32, 4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(llava_dir, reference, mode) -> None:
    # The four prompts fill the pool exactly in the first step, so every block an older request needs while
    # decoding comes from a younger one.
    parts = [[make_text(40, 2), RED], [make_text(41, 9)], [GREEN, make_text(42, 2)], ["a ", SQUARE, "."]]
    sizer = make_engine(llava_dir, num_blocks=8)
    lengths = [len(sizer.image_prompts.encode(image_spec(sizer, None, 0, p))[0]) for p in parts]
    prompt_blocks = sum(-(-n // 8) for n in lengths)
    engine = make_engine(llava_dir, num_blocks=prompt_blocks + 1, block_size=8, preemption=mode,
                         TGI_PAGED_OVERCOMMIT="3", PREFIX_CACHING="0")  # fmt: skip
    router_warmup(engine, prompt_blocks * 8)
    calls = counting_encodes(engine)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    specs = [image_spec(engine, blocks, 40 + i, p, 16) for i, p in enumerate(parts)]
    batch = driver.prefill(BatchSpec(id=5, requests=tuple(specs)))
    assert engine.kv.num_free_blocks == 0 and calls == [1, 1, 1]
    driver.drain(batch)
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    expect_reference(engine, reference, driver, specs)
    if mode == "recompute":  # a preempted image request re-encoded its image from the bytes
        assert len(calls) > 3, calls
    else:  # swap keeps the KV: nothing is encoded again
        assert len(calls) == 3, calls
    driver.assert_idle()


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
    from tgi_paged_backend.engine.image_prompts import MAX_IMAGES_PER_REQUEST
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
    held = MAX_IMAGES_PER_REQUEST * encoder.token_count(image) * engine.runner.spec.hidden_size * 4  # fp32
    assert engine.runner.activation_peak_bytes >= text_peak + held
