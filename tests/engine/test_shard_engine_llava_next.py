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
    assert images is not None and len(images.spans[0]) == sum(1 for t in ids if t == engine.image_prompts.image_token_id)
    driver.run(BatchSpec(id=1, requests=(spec,)))
    expect_reference(engine, reference, driver, [spec])
    assert calls == [1]
    driver.assert_idle()
