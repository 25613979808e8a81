"""KV-cache events for llm-d's KV-cache indexer, in vLLM's wire format (opt-in).

The shard tells a prefix-aware router which blocks it holds: ``BlockStored`` when a full, committed block
becomes retainable (registered in the prefix cache), ``BlockRemoved`` when its entry goes (evicted or
dropped), ``AllBlocksCleared`` when the whole pool is rebuilt (Warmup). The stream mirrors the prefix
cache's registry exactly, so a subscriber that applies it holds the same set of blocks.

Wire format (vLLM's ``vllm/distributed/kv_events.py``, the positional encoding llm-d's decoder reads):

- a ZMQ PUB socket (binds endpoints on a wildcard host -- ``*``, ``0.0.0.0``, ``::`` -- and ipc/inproc ones,
  connects to others, and warns when nothing accepts that connection) sends multipart messages
  ``[topic, 8-byte big-endian sequence number, msgpack(batch)]``, one batch per engine step with events;
- ``batch = [timestamp, [event, ...], data_parallel_rank]``;
- ``["BlockStored", [block_hash], parent_block_hash | None, token_ids, block_size, lora_id | None, medium,
  lora_name | None]`` (one event per block: its hash is our chain hash, its parent the previous block's, or
  ``None`` for a first block, whose chain starts at the adapter's own root);
  ``["BlockRemoved", [block_hash], medium]``; ``["AllBlocksCleared"]``;
- ``medium`` names the tier that holds the block: ``"GPU"`` for the device pool on every device (vLLM's
  block pool sends its ``MEDIUM_GPU`` on CPU builds too, and llm-d keys an index entry by pod and medium,
  so the pool must not share a name with the host tier), ``"CPU"`` for the host tier (vLLM's offloading
  medium), ``"DISK"`` for the disk tier. A tier's ``BlockStored`` carries the block's tokens and parent
  like the pool's (the form of vLLM's newer offloading events, which llm-d keys by tokens); the same
  block may be stored in several media at once, and each medium's ``BlockRemoved`` drops only its copy;
- an optional ROUTER replay socket: a request ``[client, b"", start_seq (8 bytes)]`` gets every buffered
  batch from ``start_seq`` on, ``[client, b"", seq, payload]``, then ``[client, b"", -1 (8 bytes), b""]``.

Never stalls a step: events go to a queue bounded in batches and in bytes that a background thread sends; a
full queue, or a sender thread that has stopped, drops the batch and counts it
(:attr:`KVEventPublisher.num_dropped`); the PUB socket drops at its high-water mark. The replay socket takes
requests of at most :data:`MAX_REPLAY_REQUEST_BYTES` (a larger frame disconnects its sender).

The stream carries users' token ids (every ``BlockStored`` holds a block's tokens): bind it only where the
indexer alone can reach it (``integration/DEPLOY.md``, "KV events").
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from loguru import logger

try:  # optional (the `serve` extra): only TGI_PAGED_KV_EVENTS_ENDPOINT needs them, and build_kv_events says so
    import msgpack
    import zmq
    import zmq.utils.monitor
except ImportError:
    msgpack = zmq = None  # type: ignore[assignment]

from tgi_paged_backend.memory.prefix_tiers import TierObserver

if TYPE_CHECKING:
    import torch

    from tgi_paged_backend.config import BackendConfig
    from tgi_paged_backend.memory.block_keys import TierBlock

POOL_MEDIUM = "GPU"
"""The device pool's medium (vLLM's ``MEDIUM_GPU``, whatever the device)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end marker."""
MAX_REPLAY_REQUEST_BYTES = 64
"""ZMQ_MAXMSGSIZE of the replay socket: a request frame is an 8-byte sequence number."""
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """``TGI_PAGED_KV_EVENTS_*``, read once with the other settings."""

    endpoint: str
    """PUB endpoint, e.g. ``tcp://*:5557`` (bound) or ``tcp://indexer:5557`` (connected)."""
    topic: str
    """First frame of every message (llm-d parses ``kv@<pod>@<model>``)."""
    replay_endpoint: str | None = None
    """ROUTER endpoint serving missed batches (``None``: no replay)."""
    buffer_batches: int = 10_000
    """Batches kept for replay."""
    max_queue: int = 100_000
    """Batches waiting for the sender thread before new ones are dropped."""
    max_queue_bytes: int = 64 * 1024**2
    """Bytes of batches waiting for the sender thread before new ones are dropped."""
    connect_warn_s: float = 10.0
    """A connected PUB endpoint that nothing accepted after this long gets a warning."""


class KVEventSink(Protocol):
    """What the prefix cache, the KV tiers (:class:`TierObserver`) and the engine call."""

    def block_stored(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], adapter: int
    ) -> None: ...

    def block_removed(self, block_hash: int) -> None: ...

    def all_cleared(self) -> None: ...

    def tier_stored(self, medium: str, block: TierBlock) -> None: ...

    def tier_removed(self, medium: str, block: TierBlock) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullKVEvents(TierObserver):
    """No publisher (the default)."""

    def block_stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], adapter: int) -> None:
        pass

    def block_removed(self, block_hash: int) -> None:
        pass

    def all_cleared(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class KVEventPublisher(TierObserver):
    """Collects a step's events (:meth:`flush` ends the step's batch) and sends them from a thread."""

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        block_size: int,
        medium: str = POOL_MEDIUM,
        adapter_names: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.medium = medium
        self.adapter_names = adapter_names
        self.num_dropped = 0
        """Batches dropped because the queue was full (a slow sender; the stream then has a gap)."""
        self._events: list[list[Any]] = []
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue)
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._closed = False
        self._context = zmq.Context()
        try:  # the sockets move to the sender thread when it starts, and are used there only
            self._pub = self._context.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._monitor = None if _attach(self._pub, config.endpoint) else self._pub.get_monitor_socket()
            self._replay = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST_BYTES)
                self._replay.bind(config.replay_endpoint)
        except Exception:
            self._context.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # -- the sink ---------------------------------------------------------------------------------
    def block_stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], adapter: int) -> None:
        self._stored(self.medium, block_hash, parent_hash, token_ids, adapter)

    def block_removed(self, block_hash: int) -> None:
        self._events.append(["BlockRemoved", [block_hash], self.medium])

    def tier_stored(self, medium: str, block: TierBlock) -> None:
        """A tier below the pool (``"CPU"``, ``"DISK"``) holds ``block`` now."""
        self._stored(medium, block.chain_hash, block.parent_chain_hash, block.token_ids, block.namespace)

    def tier_removed(self, medium: str, block: TierBlock) -> None:
        self._events.append(["BlockRemoved", [block.chain_hash], medium])

    def _stored(
        self, medium: str, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], adapter: int
    ) -> None:
        name = self.adapter_names[adapter - 1] if 0 < adapter <= len(self.adapter_names) else None
        self._events.append(
            [
                "BlockStored",
                [block_hash],
                parent_hash,
                list(token_ids),
                self.block_size,
                adapter or None,
                medium,
                name,
            ]
        )

    def all_cleared(self) -> None:
        self._events.append(["AllBlocksCleared"])

    def flush(self) -> None:
        """End the current batch: queue it for sending (nothing when it is empty)."""
        if not self._events:
            return
        payload = msgpack.packb([time.time(), self._events, 0], use_bin_type=True)
        self._events = []
        with self._bytes_lock:
            fits = self._queued_bytes + len(payload) <= self.config.max_queue_bytes
            if fits:
                self._queued_bytes += len(payload)
        try:
            if not (fits and self._thread.is_alive()):  # a stopped sender would never drain the queue
                raise queue.Full
            self._queue.put_nowait(payload)
        except queue.Full:
            if fits:
                self._sent(len(payload))
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:  # an index missing blocks must be visible
                logger.warning(
                    "KV events: {} batches dropped so far (the sender is behind; subscribers can replay)",
                    self.num_dropped,
                )

    def _sent(self, num_bytes: int) -> None:
        with self._bytes_lock:
            self._queued_bytes -= num_bytes

    def close(self) -> None:
        """Send what is queued, stop the thread (it closes the sockets), end the ZMQ context. Idempotent;
        a sender thread that already stopped leaves only the context to end."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self.flush()
            try:
                self._queue.put(None, timeout=5)
            except queue.Full:  # the sender is stuck: it is a daemon thread, the process may end without it
                logger.warning("KV events: the sender thread did not drain its queue; events are lost")
                return
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._context.term()

    # -- the sender thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._send_loop()
        except Exception as e:  # noqa: BLE001 - never silent: the stream stops, serving goes on
            logger.opt(exception=e).error("KV events: the sender thread stopped: {}", e)
        finally:
            self._stop_monitor()
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send_loop(self) -> None:
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_batches)
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        seq = 0
        connect_deadline = time.monotonic() + self.config.connect_warn_s if self._monitor is not None else None
        while True:
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                payload = b""
            if payload is None:
                return
            connect_deadline = self._watch_connection(connect_deadline)
            if payload:
                self._sent(len(payload))
                seq_bytes = seq.to_bytes(8, "big")
                try:
                    self._pub.send_multipart([topic, seq_bytes, payload], flags=zmq.NOBLOCK)
                except zmq.Again:  # at the high-water mark: the subscriber is too slow, it can replay
                    pass
                buffer.append((seq, payload))
                seq += 1
            if self._replay is not None and poller.poll(0):
                self._serve_replay(buffer)

    def _watch_connection(self, deadline: float | None) -> float | None:
        """Until a connected endpoint is accepted: its monitor's events; a warning once ``deadline`` passes
        (events published meanwhile went nowhere). Returns the deadline still to watch, ``None`` when done."""
        if deadline is None or self._monitor is None:
            return None
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                logger.info("KV events: connected to {}", self.config.endpoint)
                self._stop_monitor()
                return None
        if time.monotonic() < deadline:
            return deadline
        self._stop_monitor()
        logger.warning(
            "KV events: nothing accepted the connection to {} after {:.0f} s, so events are dropped until "
            "something does; to listen on that port instead, use a wildcard host (tcp://*:PORT)",
            self.config.endpoint,
            self.config.connect_warn_s,
        )
        return None

    def _stop_monitor(self) -> None:
        """Read what the monitor queued, then detach it: unread, its events (one per reconnect attempt while the
        peer is away) fill its queue, and then libzmq stalls the socket's I/O, and ``disable_monitor`` with it."""
        if self._monitor is None:
            return
        while self._monitor.poll(0):
            self._monitor.recv_multipart()
        self._pub.disable_monitor()
        self._monitor.close(linger=0)
        self._monitor = None

    def _serve_replay(self, buffer: deque[tuple[int, bytes]]) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])


def binds(endpoint: str) -> bool:
    """Whether ``endpoint`` is bound (ipc, inproc, or a tcp endpoint on a wildcard host) or connected to."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.partition("://")[2].rpartition(":")[0]
    return host in WILDCARD_HOSTS or "*" in host


def _attach(socket: Any, endpoint: str) -> bool:
    """Bind or connect ``socket`` to ``endpoint`` (:func:`binds`); ``True`` when bound."""
    if binds(endpoint):
        socket.bind(endpoint)
        return True
    socket.connect(endpoint)
    return False


def build_kv_events(
    config: BackendConfig, block_size: int, device: torch.device, adapter_names: tuple[str, ...]
) -> KVEventSink:
    """The publisher ``config`` asks for (rank 0 only: every rank holds the same blocks), else a no-op."""
    telemetry = config.telemetry
    if telemetry.kv_events_endpoint is None or config.server.rank != 0:
        return NullKVEvents()
    if zmq is None or msgpack is None:
        from tgi_paged_backend.config import ConfigError

        raise ConfigError(
            f"TGI_PAGED_KV_EVENTS_ENDPOINT={telemetry.kv_events_endpoint!r} needs pyzmq and msgpack: "
            "pip install pyzmq msgpack (or this package's `serve` extra)"
        )
    events = KVEventsConfig(
        endpoint=telemetry.kv_events_endpoint,
        topic=telemetry.kv_events_topic,
        replay_endpoint=telemetry.kv_events_replay_endpoint,
    )
    try:  # the pool's medium is "GPU" on every device (POOL_MEDIUM; ``device`` is not consulted)
        return KVEventPublisher(events, block_size=block_size, adapter_names=adapter_names)
    except zmq.ZMQError as err:
        from tgi_paged_backend.config import ConfigError

        raise ConfigError(f"KV events: cannot open {events.endpoint} / {events.replay_endpoint}: {err}") from None
