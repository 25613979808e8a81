"""The real shard CLI spawned exactly as the stock launcher does, driven by the v3 router replay.

These are the product's acceptance tests on CPU: worst-case virtual reservations from the router,
a physical pool far smaller than those reservations (so the shard must preempt), greedy output
token-identical to HF transformers, no leak, graceful SIGTERM.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest

from integration.launcher_spawn import LaunchedShards, LauncherOptions
from integration.net import free_port
from integration.router_replay import Router
from tests.helpers.shard_driving import hf_greedy, run_requests
from tests.helpers.tiny_models import write_tiny_model

PROMPTS = [
    "hello world this is a test",
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven",
    "a",
    "some more text here",
    "paged attention splits the cache into blocks",
    "stock routers reserve the worst case",
    "every request completes",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("llama", tmp_path_factory.mktemp("e2e-llama"), seed=3)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_launcher_spawn_router_replay_greedy_with_preemption(tiny_llama: Path, tmp_path: Path, preemption: str) -> None:
    # 4x overload: 9 blocks x 8 tokens = 64 usable physical tokens (block 0 is scratch) for eight
    # requests of ~45 tokens each (~360 tokens); the router's virtual pool is 4 x 64.
    metrics_port = free_port()
    opts = LauncherOptions(
        uds_path=str(tmp_path / "shard"),
        log_level="INFO",
        env={
            "TGI_PAGED_NUM_BLOCKS": "9",
            "TGI_PAGED_BLOCK_SIZE": "8",
            "TGI_PAGED_OVERCOMMIT": "4",
            "TGI_PAGED_PREEMPTION": preemption,
            "TGI_PAGED_SWAP_SPACE_GB": "0.01",
            "PREFIX_CACHING": "0",
            "TGI_PAGED_METRICS_PORT": str(metrics_port),
        },
        max_input_tokens=32,
        max_total_tokens=64,
    )

    async def scenario() -> tuple[list[list[int]], dict]:
        router = await Router.connect(opts.uds_path, str(tiny_llama), max_batch_prefill_tokens=64)
        try:
            assert router.info.max_batch_total_tokens == 64 * 4  # physical tokens x overcommit
            outputs = await run_requests(router, PROMPTS, MAX_NEW)
            # The shard still serves after the burst (and the liveness path works).
            again = await run_requests(router, PROMPTS[:1], MAX_NEW)
            assert again[0] == outputs[0]
            await router.health()
            return outputs, router.stats
        finally:
            await router.close()

    with LaunchedShards(str(tiny_llama), opts, ready_timeout=120) as shards:
        outputs, stats = asyncio.run(asyncio.wait_for(scenario(), 300))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        logs = [r.text for r in shards.logs]
        shards.terminate()
        assert shards.exit_codes == {0: 0}, shards.stderr
        assert not Path(opts.uds_path + "-0").exists()
    assert outputs == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    # Preemption really happened (the shard logs a summary), and the router admitted more
    # requests at once than the physical pool could hold under worst-case reservations.
    assert any("preempt" in line.lower() for line in logs), logs[-20:]
    assert stats.concurrency_peak >= 4
    # Memory returned: no physical block is held once every request has finished.
    assert 'tgi_paged_kv_blocks{state="used"} 0.0' in metrics, metrics
    assert f'tgi_paged_preemptions_total{{mode="{preemption}"}}' in metrics
