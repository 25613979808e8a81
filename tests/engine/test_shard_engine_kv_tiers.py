"""KV tiers end to end (issue 42): prefix blocks the pool evicts live on in host RAM and on disk.

Conversations visited round-robin on a pool that holds about one of them: with the host tier the next
visit loads its prefix instead of recomputing it, with the same greedy tokens as the tier off; blocks the
host tier evicts spill to disk and a fresh engine over the same directory loads them after a "restart";
a corrupt or foreign file is ignored and counted, never served.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import RouterDriver, make_engine, make_text, spec
from tgi_paged_backend.engine.types import BatchSpec

BLOCK_SIZE = 8
NUM_BLOCKS = 24


def _engine(model_dir: Path, host_blocks: int, **env: str):
    probe = make_engine(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    block_bytes = probe.runner.pool.block_bytes
    probe.close()
    gb = host_blocks * block_bytes / 2**30 * 1.0001
    return make_engine(
        model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, TGI_PAGED_HOST_CACHE_GB=f"{gb:.12f}", **env
    )


def _visit(engine, texts: list[str], rounds: int, first_id: int = 1) -> dict[int, list[int]]:
    """Each text in turn, ``rounds`` times, one request at a time; returns tokens by (round, index) id."""
    out: dict[int, list[int]] = {}
    rid = first_id
    for _ in range(rounds):
        for text in texts:
            driver = RouterDriver(engine)
            driver.run(BatchSpec(id=rid, requests=(spec(rid, text, 4),)))
            out[rid] = driver.tokens[rid]
            rid += 1
    return out


TEXTS = [make_text(400 + i, 40) for i in range(3)]


def test_host_tier_loads_evicted_prefixes_with_the_same_tokens(tiny_llama_dir):
    off = _engine(tiny_llama_dir, 0)
    want = _visit(off, TEXTS, rounds=2)
    hits_off = off.stats.prefix_hit_tokens
    on = _engine(tiny_llama_dir, 64)
    got = _visit(on, TEXTS, rounds=2)
    assert got == want
    tiers = on.kv.tiers
    assert tiers is not None and tiers.counters.offloaded_blocks > 0 and tiers.counters.loaded_blocks > 0
    assert on.stats.prefix_hit_tokens > hits_off + tiers.counters.loaded_blocks * BLOCK_SIZE // 2
    assert on.tier_io.traffic.load_bytes > 0 and on.tier_io.traffic.offload_bytes > 0
    on.kv.check_invariants()


def test_a_full_host_tier_evicts_instead_of_failing(tiny_llama_dir):
    off = _engine(tiny_llama_dir, 0)
    want = _visit(off, TEXTS, rounds=2)
    on = _engine(tiny_llama_dir, 6)  # far less than the working set
    assert _visit(on, TEXTS, rounds=2) == want
    assert on.kv.tiers is not None and on.kv.tiers.host.num_evicted > 0
    on.kv.check_invariants()


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_host_tier_under_preemption(tiny_llama_dir, preemption):
    """Several conversations at once on the small pool: preemption and tier traffic in the same steps."""
    batch = lambda rid: BatchSpec(id=rid, requests=tuple(spec(rid + i, t, 12) for i, t in enumerate(TEXTS)))  # noqa: E731
    off = make_engine(tiny_llama_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, preemption=preemption)
    want = [RouterDriver(off).run(batch(rid)) and None for rid in (10, 20)]
    del want
    results = {}
    for name, engine in (("off", off), ("on", _engine(tiny_llama_dir, 64, TGI_PAGED_PREEMPTION=preemption))):
        tokens = {}
        for rid in (100, 200):
            driver = RouterDriver(engine)
            driver.run(batch(rid))
            tokens.update(driver.tokens)
        results[name] = tokens
        engine.kv.check_invariants()
    assert results["on"] == results["off"]


def test_swap_preemption_leaves_host_held_prefixes_in_the_host_tier(tiny_llama_dir):
    """Conversations visited one at a time (the host tier ends up holding their prefixes), then all at once
    on the small pool: the requests load their prefixes from the host tier, swap preemption leaves those
    blocks there instead of copying them to swap space, and swap-in loads them back; same tokens."""
    # the youngest request (the swap victim) is the conversation visited first: its prefix is in the host tier
    batch = BatchSpec(id=300, requests=tuple(spec(300 + i, t, 16) for i, t in enumerate(reversed(TEXTS))))
    results = {}
    engines = {"off": _engine(tiny_llama_dir, 0, TGI_PAGED_PREEMPTION="swap")}
    engines["on"] = _engine(tiny_llama_dir, 64, TGI_PAGED_PREEMPTION="swap")
    for name, engine in engines.items():
        _visit(engine, TEXTS, rounds=1)
        driver = RouterDriver(engine)
        driver.run(batch)
        results[name] = driver.tokens
        engine.kv.check_invariants()
    assert results["on"] == results["off"]
    on = engines["on"]
    tiers = on.kv.tiers
    assert tiers is not None and tiers.counters.loaded_blocks > 0
    assert tiers.counters.swap_kept_rows > 0, "no swapped block was left in the host tier"
    assert not tiers.host._pinned, "a finished request left host entries pinned"


def test_disk_tier_survives_a_restart(tiny_llama_dir, tmp_path):
    off = _engine(tiny_llama_dir, 0)
    want = _visit(off, TEXTS, rounds=1)
    first = _engine(tiny_llama_dir, 4, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    assert _visit(first, TEXTS, rounds=1) == want
    first.close()  # flushes the writer
    assert list(tmp_path.glob("rank-0/*.kv")), "the host tier spilled nothing to disk"
    second = _engine(tiny_llama_dir, 64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    assert _visit(second, TEXTS, rounds=1) == want
    assert second.stats.disk_hit_tokens > 0
    second.kv.check_invariants()


def test_a_corrupt_disk_file_is_ignored_and_counted(tiny_llama_dir, tmp_path):
    off = _engine(tiny_llama_dir, 0)
    want = _visit(off, TEXTS, rounds=1)
    first = _engine(tiny_llama_dir, 4, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    _visit(first, TEXTS, rounds=1)
    first.close()
    files = sorted(tmp_path.glob("rank-0/*.kv"))
    for path in files:  # flip a byte near the end of every payload
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    second = _engine(tiny_llama_dir, 64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    assert _visit(second, TEXTS, rounds=1) == want
    assert second.stats.disk_hit_tokens == 0
    assert second._disk is not None and second._disk.stats().ignored_files > 0
