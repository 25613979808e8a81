"""Two tensor-parallel ranks (gloo, CPU) spawned exactly as the launcher does for ``--num-shard 2``,
driven by the v3 router replay.

- Greedy output under forced preemption is token-identical to a single-rank shard and to HF
  transformers; each request is reported exactly once (only rank 0 sends generations).
- ServiceDiscovery lists both sockets, both ranks answer Warmup the same, and their page maps never
  diverge: every rank logs (DEBUG) a digest of its requests, block tables and pool before each step,
  and the ranks also compare those digests over the group.
- SIGKILL of rank 1 (idle, or in the middle of a generation) makes rank 0 exit with code 1 and one
  clear error instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration.launcher_spawn import LaunchedShards, LauncherOptions, LogRecord  # noqa: E402
from integration.net import free_port  # noqa: E402
from integration.router_replay import GenerateParameters, Router  # noqa: E402
from integration.router_replay.client import ShardClient, build_liveness_batch  # noqa: E402
from tests.distributed.tp_helpers import PROMPTS  # noqa: E402
from tests.helpers.shard_driving import hf_greedy, run_requests  # noqa: E402
from tests.helpers.tiny_models import write_tiny_model  # noqa: E402
from tgi_paged_backend.server.pb import generate_pb2 as pb  # noqa: E402

MAX_NEW = 24
STEP_LOG = re.compile(r"tensor parallel step (\d+): batch ([0-9a-f]{16}) state ([0-9a-f]{16})")
# 12 blocks x 8 tokens = 88 usable physical tokens per rank; six requests reserve ~6 x 40 virtual tokens.
# One torch thread per shard: on a small, busy CI box spinning OpenMP threads of several processes
# otherwise slow every step (and every collective) down by an order of magnitude.
POOL_ENV = {
    "TGI_PAGED_NUM_BLOCKS": "12",
    "TGI_PAGED_BLOCK_SIZE": "8",
    "TGI_PAGED_OVERCOMMIT": "4",
    "TGI_PAGED_SWAP_SPACE_GB": "0.01",
    "PREFIX_CACHING": "0",
    "OMP_NUM_THREADS": "1",
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 query heads / 2 KV heads / MLP 128: divisible by 2.
    return write_tiny_model("llama", tmp_path_factory.mktemp("tp-llama"), seed=3)


def options(tmp_path: Path, num_shard: int, log_level: str = "INFO", **env: str) -> LauncherOptions:
    return LauncherOptions(
        num_shard=num_shard,
        uds_path=str(tmp_path / f"shard{num_shard}"),
        log_level=log_level,
        master_addr="127.0.0.1",
        master_port=free_port(),
        env={**POOL_ENV, **env},
        max_input_tokens=64,
        max_total_tokens=88,
        graceful_termination_timeout=20,
    )


def texts(logs: list[LogRecord], rank: int) -> list[str]:
    return [r.text for r in logs if r.rank == rank]


def step_digests(logs: list[LogRecord], rank: int) -> dict[int, tuple[str, str]]:
    out = {}
    for text in texts(logs, rank):
        if m := STEP_LOG.search(text):
            out[int(m.group(1))] = (m.group(2), m.group(3))
    return out


async def liveness_on_each_rank(paths: list[str]) -> list[pb.PrefillResponse]:
    """The router's liveness Prefill sent straight to every rank (all at once: the step is a collective)."""
    clients = [await ShardClient.connect_uds(p) for p in paths]
    try:
        request = pb.PrefillRequest(batch=build_liveness_batch())
        return list(await asyncio.gather(*(c.call("Prefill", request) for c in clients)))
    finally:
        for c in clients:
            await c.close()


def serve_and_generate(model: Path, opts: LauncherOptions) -> tuple[list[list[int]], list[LogRecord], dict, tuple]:
    async def scenario():
        router = await Router.connect(opts.uds_path, str(model), max_batch_prefill_tokens=64)
        try:
            assert router.info.max_batch_total_tokens == 88 * 4  # physical tokens x overcommit, per rank
            outputs = await run_requests(router, PROMPTS, MAX_NEW)
            await router.health()
            return outputs, router.stats.concurrency_peak, router.info.shard_urls
        finally:
            await router.close()

    with LaunchedShards(str(model), opts, ready_timeout=120) as shards:
        outputs, peak, urls = asyncio.run(asyncio.wait_for(scenario(), 240))
        answers = asyncio.run(asyncio.wait_for(liveness_on_each_rank(shards.socket_paths), 60))
        shards.terminate()
        assert set(shards.exit_codes.values()) == {0}, shards.stderr
        assert not any(os.path.exists(p) for p in shards.socket_paths)
        return outputs, list(shards.logs), {"peak": peak, "urls": urls}, tuple(len(a.generations) for a in answers)


def test_two_ranks_match_one_rank_and_hf_under_preemption(tiny_llama: Path, tmp_path: Path) -> None:
    single, _, _, single_liveness = serve_and_generate(tiny_llama, options(tmp_path, 1, TGI_PAGED_PREEMPTION="auto"))
    sharded, logs, info, liveness = serve_and_generate(
        tiny_llama, options(tmp_path, 2, "DEBUG", TGI_PAGED_PREEMPTION="auto")
    )

    assert sharded == single == hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    assert info["peak"] >= 4  # more concurrency than the physical pool holds under worst-case reservations
    # ServiceDiscovery on rank 0 listed both ranks' sockets (the router dialled both).
    assert info["urls"] == tuple(f"{tmp_path}/shard2-{r}" for r in range(2))
    # Exactly one Generation per request and step: rank 0 reports, rank 1 answers with none.
    assert single_liveness == (1,) and liveness == (1, 0)

    for rank in (0, 1):
        lines = texts(logs, rank)
        assert any("holds 2 of 4 query heads, 1 of 2 KV heads" in t for t in lines), lines[:20]
        assert any("preempt" in t.lower() for t in lines), lines[-20:]
        assert not any("diverged" in t or "different batches" in t for t in lines)
    warmups = [[t for t in texts(logs, r) if t.startswith("warmup:")] for r in (0, 1)]
    assert warmups[0] and warmups[0] == warmups[1]

    # The page maps never diverged: identical per-step digests on both ranks (a line can be lost to the
    # launcher's 32 KiB read chunks, so compare the steps both logged).
    d0, d1 = step_digests(logs, 0), step_digests(logs, 1)
    common = d0.keys() & d1.keys()
    assert len(common) >= 0.9 * max(len(d0), len(d1)) and len(common) > 50
    assert all(d0[s] == d1[s] for s in common)
    assert len({d0[s][1] for s in common}) > 10  # the digests do follow the state


def wait_for_exit(shards: LaunchedShards, rank: int, timeout: float) -> float:
    start = time.monotonic()
    while rank not in shards.crashed():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"rank {rank} still running {timeout} s after its peer died")
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.parametrize("when", ["idle", "in_flight"])
def test_killing_rank_1_makes_rank_0_exit_with_a_clear_error(tiny_llama: Path, tmp_path: Path, when: str) -> None:
    opts = options(tmp_path, 2, TGI_PAGED_PREEMPTION="recompute", TGI_PAGED_DIST_TIMEOUT_S="10")

    with LaunchedShards(str(tiny_llama), opts, ready_timeout=120) as shards:

        async def scenario() -> str:
            router = await Router.connect(opts.uds_path, str(tiny_llama), max_batch_prefill_tokens=64, strict=False)
            try:
                await run_requests(router, PROMPTS[:2], 8)  # the group works
                if when == "idle":
                    os.kill(shards.pid(1), signal.SIGKILL)
                    return "killed while idle"
                stream = await router.generate("a", GenerateParameters(max_new_tokens=60, ignore_eos_token=True))
                seen = 0
                try:
                    async for _ in stream:
                        seen += 1
                        if seen == 3:
                            os.kill(shards.pid(1), signal.SIGKILL)
                except Exception as err:  # noqa: BLE001 - the generation must fail, not hang
                    return f"stream failed after {seen} tokens: {type(err).__name__}"
                raise AssertionError("the generation finished although rank 1 was killed")
            finally:
                await router.close()

        outcome = asyncio.run(asyncio.wait_for(scenario(), 120))
        waited = wait_for_exit(shards, 0, 60)
        codes = shards.terminate()

    assert codes[1] == -signal.SIGKILL
    assert codes[0] == 1, (outcome, shards.stderr[0][-2000:])
    errors = [r.text for r in shards.logs if r.rank == 0 and r.level == "ERROR"]
    assert any(
        re.search(r"tensor-parallel rank 0/2: .* failed .*peer rank died.*exiting with code 1", t, re.S) for t in errors
    ), (outcome, errors)
    assert waited < 45, outcome
    assert not os.path.exists(shards.socket_paths[0])
