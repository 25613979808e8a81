"""Qwen2-VL through the real shard CLI, spawned as the stock launcher does and driven by the v3 router
replay with markdown images (issue 40): the router budgets ``input_length`` with stock's formula
(``h*w/patch**2`` pads, Debug-quoted: several times the real count), sends ``Image`` chunks and reserves
blocks for that budget; the shard counts its own placeholders and M-RoPE positions, and greedy output equals
HF ``generate`` with the same images. (The budget over-reserves, so the router never lets this pool fill:
preemption with images is covered by ``tests/engine/test_shard_engine_qwen2_vl.py``.)"""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import pytest
import transformers
from PIL import Image

from integration.launcher_spawn import LaunchedShards, LauncherOptions
from integration.router_replay import Router
from tests.helpers.qwen2_vl_models import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    Qwen2VlReference,
    png_bytes,
    write_qwen2_vl_model,
)
from tests.helpers.shard_driving import run_requests

MAX_NEW = 12
IMAGES = [png_bytes(40, 24, 1), png_bytes(24, 64, 3), png_bytes(32, 32, 4)]
PARTS = [
    ["the fox ", 0, " is quick"],
    ["hello world, hello there"],
    [2, " and ", 1, " the dog"],
    ["look: ", 0],
]
"""Prompts: text, and indexes into :data:`IMAGES`."""


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_model(tmp_path_factory.mktemp(f"e2e-{request.param}"), request.param)


def _markdown(parts: list) -> str:
    return "".join(
        p if isinstance(p, str) else f"![](data:image/png;base64,{base64.b64encode(IMAGES[p]).decode()})" for p in parts
    )


def _references(model_dir: Path) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    reference = Qwen2VlReference(model_dir)
    grids = reference.processor([Image.open(io.BytesIO(i)).convert("RGB") for i in IMAGES])["image_grid_thw"]
    counts = [int(t * h * w) // 4 for t, h, w in grids]
    out = []
    for parts in PARTS:
        text = "".join(p if isinstance(p, str) else VISION_START + IMAGE_PAD * counts[p] + VISION_END for p in parts)
        images = [IMAGES[p] for p in parts if not isinstance(p, str)]
        out.append(reference.greedy(tokenizer(text).input_ids, images, MAX_NEW))
    return out


def test_router_replay_serves_images_token_exact(qwen_dir: Path, tmp_path: Path) -> None:
    # the router reserves for its budgets (~25-180 tokens a request); the shard writes ~15-50 prompt tokens each
    opts = LauncherOptions(
        uds_path=str(tmp_path / "shard"),
        log_level="INFO",
        env={
            "TGI_PAGED_NUM_BLOCKS": "28",
            "TGI_PAGED_BLOCK_SIZE": "8",
            "PREFIX_CACHING": "1",
        },
        max_input_tokens=200,
        max_total_tokens=212,
        inherit=("PATH", "HOME", "PYTHONPATH"),  # PYTHONPATH: a worktree's copy of the shard, when set
    )

    async def scenario() -> list[list[int]]:
        router = await Router.connect(opts.uds_path, str(qwen_dir), max_batch_prefill_tokens=800)
        try:
            return await run_requests(router, [_markdown(p) for p in PARTS], MAX_NEW)
        finally:
            await router.close()

    with LaunchedShards(str(qwen_dir), opts, ready_timeout=120) as shards:
        outputs = asyncio.run(asyncio.wait_for(scenario(), 300))
        shards.terminate()
        assert shards.exit_codes == {0: 0}, shards.stderr
    assert outputs == _references(qwen_dir)
