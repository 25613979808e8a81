"""A compressed-tensors FP8 checkpoint through the real stack: the launcher derives ``--quantize`` from
``quantization_config.quant_method`` (no flag given), the real shard CLI loads the fp8 bytes, the v3
router replay drives it into preemption, greedy output equals HF on the dequantized weights, and
``tgi_paged_weights_bytes`` exports the quantized bytes (what Warmup subtracted from the KV budget)."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import torch

from integration.launcher_spawn import LaunchedShards, LauncherOptions, effective_quantize
from integration.net import free_port
from integration.router_replay import Router
from tests.helpers.fixtures import SERVING_PACK_MIN_ELEMENTS
from tests.helpers.quant_models import dequantized_reference, write_compressed_fp8
from tests.helpers.shard_driving import run_requests
from tests.helpers.tiny_models import write_tiny_model
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu import fast_layers
from tgi_paged_backend.runner.model_runner import ModelRunner

PROMPTS = [
    "hello world this is a test",
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven",
    "paged attention splits the cache into blocks",
]
MAX_NEW = 24


def test_launcher_derived_compressed_tensors_serves_token_exact(tmp_path: Path, monkeypatch) -> None:
    src = write_tiny_model("llama", tmp_path / "src", seed=3)
    ckpt = write_compressed_fp8(src, tmp_path / "ckpt", "channel")
    opts = LauncherOptions(
        uds_path=str(tmp_path / "shard"),
        log_level="INFO",
        env={
            "TGI_PAGED_NUM_BLOCKS": "9",
            "TGI_PAGED_BLOCK_SIZE": "8",
            "TGI_PAGED_OVERCOMMIT": "4",
            "TGI_PAGED_PREEMPTION": "recompute",
            "PREFIX_CACHING": "0",
            "TGI_PAGED_METRICS_PORT": str(metrics_port := free_port()),
        },
        max_input_tokens=32,
        max_total_tokens=64,
    )
    assert opts.quantize is None and effective_quantize(str(ckpt), opts) == "compressed-tensors"

    async def scenario() -> list[list[int]]:
        router = await Router.connect(opts.uds_path, str(ckpt), max_batch_prefill_tokens=64)
        try:
            return await run_requests(router, PROMPTS, MAX_NEW)
        finally:
            await router.close()

    with LaunchedShards(str(ckpt), opts, ready_timeout=120) as shards:
        outputs = asyncio.run(asyncio.wait_for(scenario(), 300))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        shards.terminate()
        assert shards.exit_codes == {0: 0}, shards.stderr

    # The spawned shard packs with the serving threshold (small weights keep a plain copy for decode rows):
    # build the in-process runner the same way, so the weight bytes compare.
    monkeypatch.setattr(fast_layers, "PACK_MIN_ELEMENTS", SERVING_PACK_MIN_ELEMENTS)
    served = ModelRunner(
        ModelConfig(model_id=str(ckpt), quantize="compressed-tensors"), CacheConfig(block_size=8), "cpu"
    )
    reference = dequantized_reference(src)
    for text, got in zip(PROMPTS, outputs):
        ids = served.tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
        assert got == want[0, ids.shape[1] :].tolist(), text
    (preempted,) = re.findall(r'^tgi_paged_preemptions_total\{mode="recompute"[^}]*\} (\S+)$', metrics, re.M)
    assert float(preempted) > 0, metrics
    (exported,) = re.findall(r"^tgi_paged_weights_bytes(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    assert float(exported) == served.weights_bytes  # the fp8 bytes, not the fp32 model's
