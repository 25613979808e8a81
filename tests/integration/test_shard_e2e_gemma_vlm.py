"""Gemma 3 and PaliGemma through the real shard CLI, driven by the v3 router replay with markdown images (issue 40).
The router counts stock's way: Gemma 3 images as 256 soft tokens (the tiny checkpoint places 16: a budget),
PaliGemma's text without the server-side ``<bos>`` + text + ``\\n`` wrap (the shard's prompt is longer than the
reservation by the wrap). The prompts are written here by hand as stock's server writes them, and the outputs
equal HF ``generate`` with the same images and the processors' ``token_type_ids``."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
import transformers

from integration.launcher_spawn import LaunchedShards, LauncherOptions
from integration.router_replay import Router
from tests.helpers.gemma_vlm_models import GemmaVlmReference, write_gemma_vlm_model
from tests.helpers.idefics_models import png_bytes
from tests.helpers.shard_driving import run_requests

MAX_NEW = 8
IMAGES = [png_bytes(40, 24, 1), png_bytes(24, 64, 3)]
PARTS = [[0, "caption en"], ["hello world, hello there"], [1, " and ", 0, " the dog"]]
"""Prompts: text, and indexes into :data:`IMAGES` (the last: two text chunks, each wrapped for PaliGemma)."""


@pytest.fixture(scope="module", params=["gemma3", "paligemma"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma_vlm_model(tmp_path_factory.mktemp(f"e2e-{request.param}"), request.param, max_positions=4096)


def _markdown(parts: list) -> str:
    return "".join(
        p if isinstance(p, str) else f"![](data:image/png;base64,{base64.b64encode(IMAGES[p]).decode()})" for p in parts
    )


def _stock_prompt(model_type: str, parts: list) -> str:
    """Stock's ``vlm_causal_lm.py`` text: Gemma 3's image sequence; PaliGemma's ``<image>`` run and wrapped text."""
    if model_type == "gemma3":
        image = "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"
        return "".join(p if isinstance(p, str) else image for p in parts)
    return "".join(f"<bos>{p}\n" if isinstance(p, str) else "<image>" * 16 for p in parts)


def _references(model_dir: Path) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    reference = GemmaVlmReference(model_dir)
    model_type = reference.model.config.model_type
    out = []
    for parts in PARTS:
        ids = tokenizer(_stock_prompt(model_type, parts), add_special_tokens=model_type == "gemma3").input_ids
        out.append(reference.greedy(ids, [IMAGES[p] for p in parts if not isinstance(p, str)], MAX_NEW))
    return out


def test_served_through_the_router_replay(model_dir: Path, tmp_path: Path) -> None:
    opts = LauncherOptions(
        uds_path=str(tmp_path / "shard"),
        log_level="INFO",
        env={"TGI_PAGED_NUM_BLOCKS": "512", "TGI_PAGED_BLOCK_SIZE": "8", "PREFIX_CACHING": "1"},
        max_input_tokens=1000,
        max_total_tokens=1100,
        inherit=("PATH", "HOME", "PYTHONPATH"),
    )

    async def scenario() -> list[list[int]]:
        router = await Router.connect(opts.uds_path, str(model_dir), max_batch_prefill_tokens=2048)
        try:
            return await run_requests(router, [_markdown(p) for p in PARTS], MAX_NEW)
        finally:
            await router.close()

    with LaunchedShards(str(model_dir), opts, ready_timeout=120) as shards:
        outputs = asyncio.run(asyncio.wait_for(scenario(), 300))
        shards.terminate()
        assert shards.exit_codes == {0: 0}, shards.stderr
    assert outputs == _references(model_dir)
