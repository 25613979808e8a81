"""KV tiers (issue 42): the order of the host tier's copies. The manager issues moves (offload, load)
that run with the next step's copies, in issue order; anything that touches host rows out of that order
must not break a move issued before it:

- a disk fetch at admission writes host rows at once: it must not reuse the rows of an entry an earlier
  request of the same batch is about to load (the load would read the fetched bytes), nor rows a pending
  offload is about to write (the offload would overwrite the fetched bytes), nor the rows of the prompt's
  own chain head (the fetched tail would hang from nothing);
- a swap-out in the step that loads the swapped request's prefix copies the loaded blocks after the
  loads;
- an entry is landed (loadable, written through to disk) only once the step that ran its offload has
  run: an offload issued but not yet taken into a step is not landed by that step
  (tests/memory/test_memory_prefix_tiers_ordering.py).
"""

from __future__ import annotations

from tests.engine.conftest import RouterDriver, make_text, spec
from tests.engine.test_shard_engine_kv_tiers_matrix import build, counters
from tgi_paged_backend.engine.types import BatchSpec

BS = 8


def _full_blocks(engine, text: str) -> int:
    return (len(engine.prompt_tokenizer.encode(text, 10_000, True)) - 1) // BS


def _texts(engine) -> tuple[str, str]:
    """Two prompts whose length is not a multiple of the block size (one new token completes no block)."""
    texts = (make_text(900 + i, 20) for i in range(40))
    picked = [t for t in texts if len(engine.prompt_tokenizer.encode(t, 10_000, True)) % BS not in (0, 1)]
    return picked[0], picked[1]


def _batch(bid: int, texts, max_new: int) -> BatchSpec:
    return BatchSpec(id=bid, requests=tuple(spec(bid + i, t, max_new) for i, t in enumerate(texts)))


def test_a_disk_fetch_never_overwrites_rows_an_earlier_load_of_the_batch_reads(tiny_llama_dir, tmp_path):
    off = build(tiny_llama_dir)
    x, y = _texts(off)
    driver = RouterDriver(off)
    driver.run(_batch(100, (x, y), 4))
    want = dict(driver.tokens)
    writer = build(tiny_llama_dir, host_rows=64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    for rid, text in enumerate((x, y), start=1):
        RouterDriver(writer).run(_batch(rid * 10, (text,), 1))
    writer.close()  # both chains on disk
    n_x = _full_blocks(off, x)
    engine = build(tiny_llama_dir, host_rows=n_x, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    RouterDriver(engine).run(_batch(30, (x,), 1))  # x: disk -> host (every row) -> pool
    assert engine.stats.disk_hit_tokens == n_x * BS
    tiers = engine.kv.tiers
    assert tiers.evict_retained(10_000) > 0 and not engine.kv.take_tier_moves()  # held already: no copies
    assert tiers.host.num_entries == n_x
    loaded = counters(engine).loaded_blocks
    driver = RouterDriver(engine)
    driver.run(_batch(100, (x, y), 4))  # x loads from the host rows; y's fetch needs rows: evicts x's entries
    assert counters(engine).loaded_blocks >= loaded + n_x
    assert engine.stats.disk_hit_tokens > n_x * BS, "y should come from disk"
    assert dict(driver.tokens) == want
    tiers.host.check_invariants()


def test_a_swap_out_never_copies_a_block_before_its_load(tiny_llama_dir):
    """A batch [fresh, a, b] where a and b load their prefixes from the host tier at admission and the
    fresh request's prefill needs b's blocks: b is swapped out in the same step. The swap-out copies b's
    blocks, so the loads into them (issued earlier, at admission) must run before it."""
    pool = dict(num_blocks=40, TGI_PAGED_PREEMPTION="swap", TGI_PAGED_SWAP_SPACE_GB="0.05")
    off = build(tiny_llama_dir, **pool)
    fresh, a, b = (make_text(950 + i, 34) for i in range(3))
    batch = _batch(100, (fresh, a, b), 3)
    driver = RouterDriver(off)
    driver.run(batch)
    want = dict(driver.tokens)
    engine = build(tiny_llama_dir, host_rows=64, **pool)
    for rid, text in enumerate((a, b), start=1):
        RouterDriver(engine).run(_batch(rid * 10, (text,), 1))
    tiers = engine.kv.tiers
    tiers.evict_retained(10_000)
    engine.tier_io.flush(engine.kv)
    assert engine.kv.num_retained_blocks == 0
    loaded = counters(engine).loaded_blocks
    kinds: list[list[str]] = []
    plan = engine.scheduler.plan

    def recording(*args, **kwargs):
        result = plan(*args, **kwargs)
        kinds.append([kind for kind, _, _ in result.copy_ops])
        return result

    engine.scheduler.plan = recording
    driver = RouterDriver(engine)
    driver.run(batch)
    assert counters(engine).loaded_blocks > loaded
    assert any("load" in k and "out" in k for k in kinds), kinds  # the step this test is about
    assert all(k.index("out") > max(i for i, x in enumerate(k) if x == "load") for k in kinds if "out" in k)
    assert engine.stats.preemptions.get("swap", 0) > 0, engine.stats.preemptions
    assert dict(driver.tokens) == want


def test_a_disk_fetch_never_evicts_the_head_of_its_own_chain(tiny_llama_dir, tmp_path):
    """The prompt's first blocks are in the host tier, the rest on disk, and the tier is one row short: the
    fetch stops short instead of evicting the chain's head (which would leave nothing loadable)."""
    off = build(tiny_llama_dir)
    words = make_text(950, 40).split()
    full = " ".join(words)
    ids = off.prompt_tokenizer.encode(full, 10_000, True)
    heads = (" ".join(words[:w]) for w in range(1, len(words)))
    head = next(  # a prompt whose tokens start full's and cover exactly its first 2 blocks
        h
        for h in heads
        if _full_blocks(off, h) == 2 and (t := off.prompt_tokenizer.encode(h, 10_000, True)) == ids[: len(t)]
    )
    driver = RouterDriver(off)
    driver.run(_batch(100, (full,), 4))
    want = dict(driver.tokens)
    n = _full_blocks(off, full)
    assert n >= 4 and _full_blocks(off, head) == 2
    writer = build(tiny_llama_dir, host_rows=64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    RouterDriver(writer).run(_batch(10, (full,), 1))
    writer.close()  # full's chain on disk
    engine = build(tiny_llama_dir, host_rows=n - 1, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    RouterDriver(engine).run(_batch(20, (head,), 1))  # the head: disk -> host -> pool
    tiers = engine.kv.tiers
    assert tiers.evict_retained(10_000) > 0 and tiers.host.num_entries == 2  # only the host tier holds it now
    hits = engine.stats.prefix_hit_tokens
    driver = RouterDriver(engine)
    driver.run(_batch(100, (full,), 4))
    assert dict(driver.tokens) == want
    assert engine.stats.prefix_hit_tokens - hits >= (n - 1) * BS, "the chain's head was evicted by its own fetch"
    tiers.host.check_invariants()
