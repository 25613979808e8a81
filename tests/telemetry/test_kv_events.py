"""KV-cache events (issue 25): the published stream rebuilds exactly the blocks the shard's prefix cache holds.

A subscriber written from the wire format (vLLM's positional msgpack, as llm-d's decoder reads it) applies
every batch -- live over SUB, then the whole history again over the replay socket -- to its own index, and
after a multi-turn workload with evictions and preemption the index equals the prefix cache's registry.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from integration.net import free_port
from tests.engine.conftest import RouterDriver, make_engine, make_text, spec
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.telemetry.kv_events import END_SEQ, KVEventPublisher, KVEventsConfig

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")


class Indexer:
    """What a prefix-aware router keeps: block hash -> (parent hash, tokens, lora), from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...], str | None]] = {}
        self.seqs: list[int] = []
        self.cleared = 0
        self.removed = 0

    def apply(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        for event in events:
            kind = event[0]
            if kind == "BlockStored":
                (block_hash,), parent, tokens, block_size, lora_id, medium, lora_name = event[1:]
                assert len(tokens) == block_size and medium == "GPU"  # the pool, on every device
                assert parent is None or parent in self.blocks, "a block arrives after its parent"
                assert (lora_id is None) == (lora_name is None)
                self.blocks[block_hash] = (parent, tuple(tokens), lora_name)
            elif kind == "BlockRemoved":
                (block_hash,), medium = event[1:]
                assert medium == "GPU"
                del self.blocks[block_hash]
                self.removed += 1
            else:
                assert event == ["AllBlocksCleared"]
                self.blocks.clear()
                self.cleared += 1


def _subscribe(endpoint: str, topic: bytes, indexer: Indexer, stop: threading.Event) -> threading.Thread:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)

    def run() -> None:
        while not stop.is_set() or sub.poll(200):
            if sub.poll(50):
                got_topic, seq, payload = sub.recv_multipart()
                assert got_topic == topic
                indexer.apply(int.from_bytes(seq, "big"), payload)
        sub.close(0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(5000), "the replay socket did not answer"
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        out.append((int.from_bytes(seq, "big"), payload))
    dealer.close(0)
    return out


@pytest.mark.parametrize(
    ("model", "preemption"),
    [("tiny_llama_dir", "recompute"), ("tiny_llama_dir", "swap"), ("windowed_dir", "recompute")],
)
def test_the_event_stream_rebuilds_the_prefix_cache(request, model, preemption) -> None:
    """Evictions and preemption by recompute and by swap; and a sliding-window model whose requests give
    back the blocks behind the window (holes) while their chains go on."""
    pub, replay = free_port(), free_port()
    engine = make_engine(
        request.getfixturevalue(model),
        num_blocks=14,  # small: retained blocks get evicted, requests get preempted
        preemption=preemption,
        swap_gb=0.01,
        block_size=8,
        TGI_PAGED_KV_EVENTS_ENDPOINT=f"tcp://*:{pub}",
        TGI_PAGED_KV_EVENTS_REPLAY_ENDPOINT=f"tcp://127.0.0.1:{replay}",
        TGI_PAGED_KV_EVENTS_TOPIC="kv@pod-a@tiny",
    )
    live, stop = Indexer(), threading.Event()
    thread = _subscribe(f"tcp://127.0.0.1:{pub}", b"kv@pod-a@tiny", live, stop)
    time.sleep(0.3)  # PUB/SUB: a subscriber sees only what is sent after it joined
    try:
        driver = RouterDriver(engine)
        texts = [make_text(500 + i, 14) for i in range(4)]
        for turn in range(3):  # multi-turn: each turn re-sends the conversation so far
            batch = tuple(spec(10 * turn + i, texts[i], 12) for i in range(4))
            driver.run(BatchSpec(id=turn, requests=batch))
            texts = [t + driver.generations[10 * turn + i][-1].generated_text.text for i, t in enumerate(texts)]
        engine.kv_events.flush()
        time.sleep(0.5)
        held = {entry.chain_hash for entry in engine.kv._prefix._by_block.values()}
        assert held, "the workload retained nothing: the test would prove nothing"
        assert set(live.blocks) == held
        assert live.removed > 0, "no block was evicted: the pool was too large for the test to mean much"
        assert engine.stats.preemptions[preemption] > 0, "no preemption: the test would not cover it"
        # The replay socket serves the whole history again, in order, from any sequence number.
        history = _replay(f"tcp://127.0.0.1:{replay}", 0)
        assert [seq for seq, _ in history] == list(range(len(history))) and len(history) >= len(live.seqs)
        rebuilt = Indexer()
        for seq, payload in history:
            rebuilt.apply(seq, payload)
        assert set(rebuilt.blocks) == held
        tail = _replay(f"tcp://127.0.0.1:{replay}", len(history) - 1)
        assert [seq for seq, _ in tail] == [len(history) - 1]
    finally:
        stop.set()
        thread.join(5)
        engine.close()


@pytest.fixture
def windowed_dir(tiny_model_factory):
    """A tiny Mistral whose every layer attends over 8 tokens: blocks behind the window are given back."""
    return tiny_model_factory("mistral", sliding_window=8)


def test_a_full_queue_drops_batches_and_counts_them(tmp_path) -> None:
    """A step never waits for the sender: with the queue full, the batch is dropped and counted."""
    import queue

    class Full(queue.Queue):
        def put_nowait(self, item):
            raise queue.Full

    config = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", topic="t")
    publisher = KVEventPublisher(config, block_size=4, medium="CPU")
    real = publisher._queue
    publisher._queue = Full()
    try:
        publisher.block_stored(1, None, (1, 2, 3, 4), 0)
        publisher.flush()
        publisher.flush()  # nothing new: nothing queued, nothing dropped
        assert publisher.num_dropped == 1
    finally:
        publisher._queue = real
        publisher.close()


def test_events_name_the_adapter_of_a_block(tmp_path) -> None:
    config = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", topic="t", replay_endpoint=f"ipc://{tmp_path}/replay")
    publisher = KVEventPublisher(config, block_size=2, medium="GPU", adapter_names=("sql", "chat"))
    try:
        publisher.block_stored(11, None, (1, 2), 2)
        publisher.block_stored(12, 11, (3, 4), 2)
        publisher.block_stored(13, None, (1, 2), 0)
        publisher.block_removed(12)
        publisher.flush()
        time.sleep(0.2)
        ((seq, payload),) = _replay(f"ipc://{tmp_path}/replay", 0)
        _, events, _ = msgpack.unpackb(payload, raw=False)
        assert seq == 0 and events == [
            ["BlockStored", [11], None, [1, 2], 2, 2, "GPU", "chat"],
            ["BlockStored", [12], 11, [3, 4], 2, 2, "GPU", "chat"],
            ["BlockStored", [13], None, [1, 2], 2, None, "GPU", None],
            ["BlockRemoved", [12], "GPU"],
        ]
    finally:
        publisher.close()


def test_only_rank_zero_publishes(tmp_path) -> None:
    """Under tensor parallelism every rank holds the same blocks: rank 0 alone publishes them."""
    import torch

    from tgi_paged_backend.envs import build_config
    from tgi_paged_backend.telemetry.kv_events import NullKVEvents, build_kv_events

    env = {"TGI_PAGED_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/pub", "WORLD_SIZE": "2", "MASTER_PORT": "29511"}
    rank1 = build_config({"model_id": "/m", "sharded": True}, {**env, "RANK": "1"})
    assert isinstance(build_kv_events(rank1, 16, torch.device("cpu"), ()), NullKVEvents)
    rank0 = build_kv_events(
        build_config({"model_id": "/m", "sharded": True}, {**env, "RANK": "0"}), 16, torch.device("cpu"), ()
    )
    try:
        assert isinstance(rank0, KVEventPublisher) and rank0.config.topic == f"kv@{socket.gethostname()}@/m"
    finally:
        rank0.close()


def _published(publisher: KVEventPublisher, endpoint: str) -> bool:
    """Whether a subscriber of ``endpoint`` receives what ``publisher`` sends (the PUB side is bound there)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        for _ in range(40):  # a slow joiner misses the first batches: keep publishing until one arrives
            publisher.block_removed(7)
            publisher.flush()
            if sub.poll(100):
                return True
        return False
    finally:
        sub.close(0)


@pytest.mark.parametrize("host", ["*", "0.0.0.0"])
def test_an_endpoint_on_a_wildcard_host_is_bound(host: str) -> None:
    port = free_port()
    publisher = KVEventPublisher(KVEventsConfig(endpoint=f"tcp://{host}:{port}", topic="t"), block_size=2, medium="CPU")
    try:
        assert _published(publisher, f"tcp://127.0.0.1:{port}")
    finally:
        publisher.close()


def test_a_connection_nothing_accepts_is_reported() -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", topic="t", connect_warn_s=0.2)
    publisher = KVEventPublisher(config, block_size=2, medium="CPU")
    try:
        deadline = time.monotonic() + 10
        while not any("nothing accepted the connection" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(f"tcp://127.0.0.1:{config.endpoint.rsplit(':', 1)[1]}" in line for line in lines), lines
    finally:
        publisher.close()
        logger.remove(sink)


def test_a_stopped_sender_queues_nothing_and_close_ends_the_context(tmp_path) -> None:
    publisher = KVEventPublisher(
        KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", topic="t"), block_size=2, medium="CPU"
    )
    publisher._queue.put(None)  # the sender thread ends as if it had died
    publisher._thread.join(5)
    for _ in range(3):
        publisher.block_removed(1)
        publisher.flush()
    assert publisher.num_dropped == 3 and publisher._queue.qsize() == 0
    publisher.close()
    assert publisher._context.closed


def test_the_queue_is_bounded_in_bytes(tmp_path) -> None:
    config = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", topic="t", max_queue_bytes=1000)
    publisher = KVEventPublisher(config, block_size=2, medium="CPU")
    try:
        with publisher._bytes_lock:  # hold the sender back: what it would dequeue stays counted
            publisher._queued_bytes = 900
        publisher.block_stored(1, None, tuple(range(200)), 0)  # one batch of well over 100 bytes
        publisher.flush()
        assert publisher.num_dropped == 1
    finally:
        with publisher._bytes_lock:
            publisher._queued_bytes = 0
        publisher.close()


def test_an_oversized_replay_request_is_cut_off_and_replay_goes_on(tmp_path) -> None:
    config = KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", topic="t", replay_endpoint=f"ipc://{tmp_path}/replay")
    publisher = KVEventPublisher(config, block_size=2, medium="CPU")
    try:
        publisher.block_removed(3)
        publisher.flush()
        import zmq.utils.monitor

        big = zmq.Context.instance().socket(zmq.DEALER)
        monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big.connect(config.replay_endpoint)
        big.send_multipart([b"", b"x" * 1_000_000])  # the shard hangs up instead of taking a megabyte
        assert monitor.poll(5000), "the replay socket kept a sender of an oversized frame"
        assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert not big.poll(200), "an oversized request got an answer"
        big.disable_monitor()
        monitor.close(0)
        big.close(0)
        batches = _replay(config.replay_endpoint, 0)
        assert [seq for seq, _ in batches] == [0]
    finally:
        publisher.close()


def test_a_late_indexer_gets_the_stream_and_the_monitor_is_let_go() -> None:
    """After the connection watch ends (here: nothing accepted within the limit), the monitor is read out and
    detached: left unread, its reconnect events would stall the socket for good (and ``close`` with it). An
    indexer that binds later then receives the events."""
    port = free_port()
    config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", topic="t", connect_warn_s=0.2)
    publisher = KVEventPublisher(config, block_size=2, medium="CPU")
    try:
        deadline = time.monotonic() + 10
        while publisher._monitor is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert publisher._monitor is None, "the monitor is still attached after the watch ended"
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{port}")  # the indexer binds; the shard connects
        try:
            received = False
            for _ in range(100):
                publisher.block_removed(7)
                publisher.flush()
                if sub.poll(100):
                    received = True
                    break
            assert received, "a late indexer got nothing"
        finally:
            sub.close(0)
    finally:
        started = time.monotonic()
        publisher.close()
        assert time.monotonic() - started < 10
