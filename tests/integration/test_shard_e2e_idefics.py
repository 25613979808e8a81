"""Idefics3 through the real shard CLI, driven by the v3 router replay with markdown images (issue 40). Stock's
router counts Idefics3 images with SmolVLM's hardcoded rule (every image 1456 px on its longest edge, 364 px
tiles, 169 tokens each: thousands of tokens per image), while the tiny checkpoint's own count is 20 or fewer:
the router's ``input_length`` and its slots are a budget, the shard places the images by its own count, and
the output equals HF ``generate`` with the same images."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import transformers

from integration.launcher_spawn import LaunchedShards, LauncherOptions
from integration.router_replay import Router
from tests.helpers.idefics_models import IdeficsReference, png_bytes, write_idefics_model
from tests.helpers.shard_driving import run_requests
from tgi_paged_backend.vision.idefics_encoder import Idefics3Encoder

MAX_NEW = 8
IMAGES = [png_bytes(40, 24, 1), png_bytes(24, 64, 3)]
PARTS = [["the fox ", 0, " is quick"], ["hello world, hello there"], [1, " and ", 0, " the dog"]]
"""Prompts: text, and indexes into :data:`IMAGES`."""


@pytest.fixture(scope="module")
def idefics_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_idefics_model(tmp_path_factory.mktemp("e2e-idefics3"), "idefics3", max_positions=8192)


def _markdown(parts: list) -> str:
    return "".join(
        p if isinstance(p, str) else f"![](data:image/png;base64,{base64.b64encode(IMAGES[p]).decode()})" for p in parts
    )


def _references(model_dir: Path) -> list[list[int]]:
    import io

    from PIL import Image

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir)
    encoder = Idefics3Encoder(model, transformers.AutoImageProcessor.from_pretrained(model_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    reference = IdeficsReference(model_dir)
    pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in IMAGES]
    out = []
    for parts in PARTS:
        text = "".join(p if isinstance(p, str) else encoder.placeholder_text(pil[p], "<image>") for p in parts)
        images = [IMAGES[p] for p in parts if not isinstance(p, str)]
        out.append(reference.greedy(tokenizer(text).input_ids, images, MAX_NEW))
    return out


def test_router_budget_larger_than_the_shards_count(idefics_dir: Path, tmp_path: Path) -> None:
    opts = LauncherOptions(
        uds_path=str(tmp_path / "shard"),
        log_level="INFO",
        env={"TGI_PAGED_NUM_BLOCKS": "2048", "TGI_PAGED_BLOCK_SIZE": "8", "PREFIX_CACHING": "1"},
        max_input_tokens=8000,
        max_total_tokens=8100,
        inherit=("PATH", "HOME", "PYTHONPATH"),
    )

    async def scenario() -> list[list[int]]:
        router = await Router.connect(opts.uds_path, str(idefics_dir), max_batch_prefill_tokens=16000)
        try:
            return await run_requests(router, [_markdown(p) for p in PARTS], MAX_NEW)
        finally:
            await router.close()

    with LaunchedShards(str(idefics_dir), opts, ready_timeout=120) as shards:
        outputs = asyncio.run(asyncio.wait_for(scenario(), 300))
        shards.terminate()
        assert shards.exit_codes == {0: 0}, shards.stderr
    assert outputs == _references(idefics_dir)
