"""KV tiers (issue 42): the order of the host tier's copies. The manager issues moves (offload, load)
that run with the next step's copies, in issue order; anything that touches host rows out of that order
must not break a move issued before it:

- a disk fetch at admission writes host rows at once: it must not reuse the rows of an entry an earlier
  request of the same batch is about to load (the load would read the fetched bytes), nor rows a pending
  offload is about to write (the offload would overwrite the fetched bytes);
- an entry is landed (loadable, written through to disk) only once the step that ran its offload has
  run: an offload issued but not yet taken into a step is not landed by that step.
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
