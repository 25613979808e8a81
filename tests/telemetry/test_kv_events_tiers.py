"""KV events of the KV tiers (issue 42): each medium's stream rebuilds what that tier holds.

An engine with a small host tier and a small disk tier runs conversations round-robin on a pool that holds
about one of them, so blocks go pool -> host -> disk and each tier evicts. The whole history, read back
over the replay socket and decoded positionally (vLLM's array layout, as llm-d's decoder reads it), is
applied to one index per medium: ``GPU`` equals the pool's registry, ``CPU`` the host tier's entries,
``DISK`` the files on disk; a tier's block carries the tokens and parent the pool announced for it.
"""

from __future__ import annotations

import pytest

from integration.net import free_port
from tests.engine.conftest import RouterDriver, make_engine, make_text, spec
from tests.telemetry.test_kv_events import _replay
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.telemetry.tier_stats import collect_tier_stats

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

BLOCK_SIZE = 8
NUM_BLOCKS = 24
MEDIA = ("GPU", "CPU", "DISK")


class TieredIndexer:
    """block hash -> (parent, tokens, lora name) per medium, from the events alone."""

    def __init__(self) -> None:
        self.media: dict[str, dict[int, tuple[int | None, tuple[int, ...], str | None]]] = {m: {} for m in MEDIA}
        self.stored = {m: 0 for m in MEDIA}
        self.removed = {m: 0 for m in MEDIA}
        self.first_seen: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        for event in events:
            if event[0] == "BlockStored":
                assert len(event) == 8, "vLLM's BlockStored: tag + 7 fields, positional"
                _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = event
                assert isinstance(hashes, list) and len(hashes) == 1 and isinstance(hashes[0], int)
                assert block_size == BLOCK_SIZE == len(tokens) and lora_id is None and lora_name is None
                assert medium in MEDIA
                index = self.media[medium]
                assert hashes[0] not in index, f"{medium}: stored twice without a removal"
                assert parent is None or parent in self.first_seen, "a block arrives after its parent"
                seen = self.first_seen.setdefault(hashes[0], (parent, tuple(tokens)))
                assert seen == (parent, tuple(tokens)), "a tier names the block with other tokens/parent"
                index[hashes[0]] = (parent, tuple(tokens), lora_name)
                self.stored[medium] += 1
            elif event[0] == "BlockRemoved":
                assert len(event) == 3, "vLLM's BlockRemoved: tag, block_hashes, medium"
                _, (block_hash,), medium = event
                del self.media[medium][block_hash]  # KeyError: removed what that medium never held
                self.removed[medium] += 1
            else:
                assert event == ["AllBlocksCleared"]
                for index in self.media.values():
                    index.clear()


def _tiered_engine(model_dir, tmp_path, pub: int, replay: int, host_blocks: int = 6, disk_files: int = 10):
    probe = make_engine(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    block_bytes = probe.runner.pool.block_bytes
    probe.close()
    return make_engine(
        model_dir,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        TGI_PAGED_HOST_CACHE_GB=f"{host_blocks * block_bytes / 2**30 * 1.0001:.12f}",
        TGI_PAGED_DISK_CACHE_DIR=str(tmp_path),
        TGI_PAGED_DISK_CACHE_GB=f"{disk_files * (block_bytes + 4096) / 2**30:.12f}",  # about that many files
        TGI_PAGED_KV_EVENTS_ENDPOINT=f"tcp://*:{pub}",
        TGI_PAGED_KV_EVENTS_REPLAY_ENDPOINT=f"tcp://127.0.0.1:{replay}",
        TGI_PAGED_KV_EVENTS_TOPIC="kv@pod-a@tiny",
    )


TEXTS = [make_text(400 + i, 40) for i in range(3)]


def _run(engine, replay: int, rounds: int) -> TieredIndexer:
    """The conversations round-robin, one request at a time; then the whole event history, applied."""
    rid = 1
    for _ in range(rounds):
        for text in TEXTS:
            RouterDriver(engine).run(BatchSpec(id=rid, requests=(spec(rid, text, 4),)))
            rid += 1
    assert engine._disk is not None and engine.kv.tiers is not None
    assert engine._disk.flush(timeout=30)
    engine._publish_disk_events()  # the writes that landed after the last step
    engine.kv_events.flush()
    indexer = TieredIndexer()
    for _, payload in _replay(f"tcp://127.0.0.1:{replay}", 0):
        indexer.apply(payload)
    return indexer


def test_each_medium_rebuilds_its_tier(tiny_llama_dir, tmp_path) -> None:
    replay = free_port()
    engine = _tiered_engine(tiny_llama_dir, tmp_path, free_port(), replay)
    try:
        indexer = _run(engine, replay, rounds=2)

        assert {e.chain_hash for e in engine.kv._prefix._by_block.values()} == set(indexer.media["GPU"])
        host = engine.kv.tiers.host
        assert {e.block.chain_hash for e in host._entries.values()} == set(indexer.media["CPU"])
        stats = engine._disk.stats()
        assert stats.num_files == len(indexer.media["DISK"]) == len(list(tmp_path.glob("rank-0/*.kv")))
        for medium in MEDIA:  # every tier stored and evicted, or the test would prove little
            assert indexer.stored[medium] > 0 and indexer.removed[medium] > 0, (medium, indexer.removed)
        assert indexer.removed["DISK"] == stats.evicted_files
        assert host.num_evicted == indexer.removed["CPU"]
        tiers = engine.last_step.tiers  # the telemetry snapshot of the same run's last step
        assert tiers is not None and sum(tiers.hit_tokens.values()) == engine.stats.prefix_hit_tokens
        # a disk write may land after the last step's snapshot (the writer runs beside the steps; _run flushed it)
        assert tiers.moved_bytes["offload"] > 0 and 0 < tiers.moved_bytes["spill"] <= stats.write_bytes
        assert tiers.host_rows_total == host.num_rows and tiers.host_evicted_blocks == host.num_evicted
        flushed = collect_tier_stats(  # the same snapshot taken now, after the flush: every write counted
            engine.kv, engine.tier_io, engine._disk,
            prefix_hit_tokens=engine.stats.prefix_hit_tokens, disk_hit_tokens=engine.stats.disk_hit_tokens,
        )  # fmt: skip
        assert flushed.moved_bytes["spill"] == stats.write_bytes
    finally:
        engine.close()


def test_blocks_read_back_from_disk_are_announced_in_the_host_tier(tiny_llama_dir, tmp_path) -> None:
    """A restart: the new process reads the old one's files into its host tier (CPU events); the files
    themselves it did not write, so it announces only those it writes as DISK blocks."""
    first = _tiered_engine(tiny_llama_dir, tmp_path, free_port(), free_port(), host_blocks=4, disk_files=100)
    for rid, text in enumerate(TEXTS, 1):
        RouterDriver(first).run(BatchSpec(id=rid, requests=(spec(rid, text, 4),)))
    first.close()
    replay = free_port()
    second = _tiered_engine(tiny_llama_dir, tmp_path, free_port(), replay, host_blocks=64, disk_files=100)
    try:
        indexer = _run(second, replay, rounds=1)
        assert second.stats.disk_hit_tokens > 0, "nothing was read from disk: the test would prove nothing"
        assert second.kv.tiers is not None
        assert {e.block.chain_hash for e in second.kv.tiers.host._entries.values()} == set(indexer.media["CPU"])
        assert indexer.stored["CPU"] >= second.stats.disk_hit_tokens // BLOCK_SIZE
        assert {e.chain_hash for e in second.kv._prefix._by_block.values()} == set(indexer.media["GPU"])
        stats = second._disk.stats()  # the files it wrote itself are DISK blocks; the old ones are not
        assert len(indexer.media["DISK"]) == stats.writes < stats.num_files and not indexer.removed["DISK"]
        tiers = second.last_step.tiers
        assert tiers is not None and tiers.hit_tokens["disk"] == second.stats.disk_hit_tokens
        assert sum(tiers.hit_tokens.values()) == second.stats.prefix_hit_tokens and tiers.moved_bytes["fetch"] > 0
        assert tiers.moved_bytes["load"] > 0 and tiers.hit_tokens["pool"] < second.stats.prefix_hit_tokens
    finally:
        second.close()
