"""LLaVA-NeXT through the real shard CLI, spawned as the stock launcher does and driven by the v3 router
replay with markdown images (issue 40): the router counts ``input_length`` with stock's placeholder rule and
sends ``Image`` chunks, its Warmup carries stock's 20x20 image, and greedy output equals HF ``generate``
with the same images, under preemption."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import transformers

from integration.launcher_spawn import LaunchedShards, LauncherOptions
from integration.router_replay import Router
from tests.helpers.llava_next_models import IMAGE_TOKEN, LlavaNextReference, png_bytes, write_llava_next_model
from tests.helpers.shard_driving import run_requests
from tgi_paged_backend.vision.llava_next_tokens import LlavaNextGeometry, image_token_count

MAX_NEW = 12
IMAGES = [png_bytes(40, 24, 1), png_bytes(24, 64, 3), png_bytes(32, 32, 4)]
PARTS = [
    ["the fox ", 0, " is quick"],
    ["hello world, hello there"],
    [2, " and ", 1, " the dog"],
    ["look: ", 0],
]
"""Prompts: text, and indexes into :data:`IMAGES`."""


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llava_next_model(tmp_path_factory.mktemp("e2e-llava"))


def _markdown(parts: list) -> str:
    return "".join(
        p if isinstance(p, str) else f"![](data:image/png;base64,{base64.b64encode(IMAGES[p]).decode()})" for p in parts
    )


def _references(model_dir: Path) -> list[list[int]]:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    geometry = LlavaNextGeometry.from_config(config)
    counts = {i: image_token_count(40 if i == 0 else (24 if i == 1 else 32), 24 if i == 0 else (64 if i == 1 else 32),
                                   geometry) for i in range(3)}  # fmt: skip
    reference = LlavaNextReference(model_dir)
    out = []
    for parts in PARTS:
        text = "".join(p if isinstance(p, str) else IMAGE_TOKEN * counts[p] for p in parts)
        images = [IMAGES[p] for p in parts if not isinstance(p, str)]
        out.append(reference.greedy(tokenizer(text).input_ids, images, MAX_NEW))
    return out


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_router_replay_serves_images_token_exact(llava_dir: Path, tmp_path: Path, preemption: str) -> None:
    # 17 blocks x 8 tokens = 128 physical tokens for four requests of ~15-130 prompt tokens + 12 new.
    opts = LauncherOptions(
        uds_path=str(tmp_path / "shard"),
        log_level="INFO",
        env={
            "TGI_PAGED_NUM_BLOCKS": "17",
            "TGI_PAGED_BLOCK_SIZE": "8",
            "TGI_PAGED_OVERCOMMIT": "4",
            "TGI_PAGED_PREEMPTION": preemption,
            "TGI_PAGED_SWAP_SPACE_GB": "0.01",
            "PREFIX_CACHING": "1",
        },
        max_input_tokens=160,
        max_total_tokens=200,
        inherit=("PATH", "HOME", "PYTHONPATH"),  # PYTHONPATH: a worktree's copy of the shard, when set
    )

    async def scenario() -> list[list[int]]:
        router = await Router.connect(opts.uds_path, str(llava_dir), max_batch_prefill_tokens=160)
        try:
            return await run_requests(router, [_markdown(p) for p in PARTS], MAX_NEW)
        finally:
            await router.close()

    with LaunchedShards(str(llava_dir), opts, ready_timeout=120) as shards:
        outputs = asyncio.run(asyncio.wait_for(scenario(), 300))
        logs = [r.text for r in shards.logs]
        shards.terminate()
        assert shards.exit_codes == {0: 0}, shards.stderr
    assert outputs == _references(llava_dir)
    assert any("preempt" in line.lower() for line in logs), logs[-20:]
