"""Disk tier of the KV cache: one file per retained prefix block, named ``<key.hex()>.kv``::

    magic      8 bytes   b"TGIPKV01" (the last two characters are the format version)
    hlen       4 bytes   little-endian length of the header that follows
    hdigest   16 bytes   blake2b-128 of the header bytes
    header    hlen bytes UTF-8 JSON: fingerprint digest, key, parent, token_ids, namespace, group_mask,
                         payload dtype (``dtype.str``), shape, byte count and blake2b-128 checksum;
                         padded with spaces so the payload starts at a multiple of 64 bytes
    payload   the array's bytes, C order

Guarantees: a file is written under a temporary name (``.<key hex>.<nonce>.tmp``) in the same
directory, flushed, fsynced, then renamed; a key enters the index (``contains``, ``get``) only after
the rename, so a crash or a failed write never leaves a file that loads, and a store opening the
directory removes the temporary files of an interrupted run. ``get`` checks magic, header digest, our
fingerprint, the key against the name, token count, payload size, shape, dtype and checksum; a file
that fails is counted, deleted and forgotten. The files (header included) never add up to more than
``max_bytes``: the writer deletes the least recently used (by last get or put; mtime across restarts)
before it writes. One daemon thread writes; ``put`` only queues; disk errors are counted and logged
once, never raised. One store per directory (a second process would remove our temporary files).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import threading
import time
from dataclasses import astuple, dataclass, replace
from pathlib import Path

import numpy as np
from loguru import logger

MAGIC = b"TGIPKV01"
SUFFIX = ".kv"
_PREFIX_LEN = len(MAGIC) + 4 + 16
_ALIGN = 64
_NAME = re.compile(r"^([0-9a-f]{32})\.kv$")
_TEMP = re.compile(r"^\.[0-9a-f]{32}\.[0-9a-z.]+\.tmp$")
_KEY_BYTES = 16


def _blake(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def temp_file_name(key: bytes, nonce: str) -> str:
    """The name a write of ``key`` uses until its rename (``nonce``: lowercase letters, digits, dots)."""
    return f".{key.hex()}.{nonce}.tmp"


@dataclass(frozen=True, slots=True)
class DiskFingerprint:
    """What a stored block depends on besides its tokens; files of another fingerprint never load."""

    model: str
    revision: str
    kv_dtype: str
    block_size: int
    row_shape: tuple[int, ...]
    layout: str
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        object.__setattr__(self, "row_shape", tuple(int(n) for n in self.row_shape))
        object.__setattr__(self, "adapters", tuple(str(a) for a in self.adapters))

    def digest(self) -> bytes:
        """16-byte blake2b of a canonical JSON encoding (stable across processes and versions)."""
        fields = ["tgi-paged-kv-fingerprint/1", *astuple(self)]  # tuples encode as lists
        return _blake(json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode())


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What a file holds besides the payload."""

    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    namespace: int
    group_mask: tuple[bool, ...]


@dataclass(slots=True)
class DiskStoreStats:
    num_files: int = 0
    num_bytes: int = 0
    max_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    ignored_files: int = 0
    """Files that failed validation (or could not be read) at :meth:`DiskStore.get`; deleted."""
    dropped_writes: int = 0
    """Puts refused because the queue was full, and writes larger than ``max_bytes``."""
    evicted_files: int = 0
    write_errors: int = 0
    """Writes that failed with an OS error (disk full, permissions); nothing of them stays on disk."""
    duplicate_puts: int = 0
    """Puts refused because the key was already stored or queued (not counted as dropped)."""
    removed_temp_files: int = 0
    queued_bytes: int = 0


@dataclass(slots=True)
class _Entry:
    size: int


def _encode_header(record: BlockRecord, payload: np.ndarray, fingerprint: bytes) -> bytes:
    flat = payload.reshape(-1).view(np.uint8)
    header = {
        "fingerprint": fingerprint.hex(),
        "key": record.key.hex(),
        "parent": record.parent.hex(),
        "token_ids": [int(t) for t in record.token_ids],
        "namespace": int(record.namespace),
        "group_mask": [bool(g) for g in record.group_mask],
        "dtype": payload.dtype.str,
        "shape": list(payload.shape),
        "nbytes": int(flat.size),
        "checksum": _blake(flat.data).hex(),
    }
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    return raw + b" " * (-(_PREFIX_LEN + len(raw)) % _ALIGN)


class _Invalid(Exception):
    """A file that must not load."""


def _decode(buf: np.ndarray, key: bytes, fingerprint: bytes, block_size: int) -> tuple[BlockRecord, np.ndarray]:
    raw = buf.data
    if len(raw) < _PREFIX_LEN or bytes(raw[:8]) != MAGIC:
        raise _Invalid("bad magic")
    hlen = int.from_bytes(raw[8:12], "little")
    start = _PREFIX_LEN + hlen
    if start > len(raw) or _blake(raw[_PREFIX_LEN:start]) != bytes(raw[12:_PREFIX_LEN]):
        raise _Invalid("header digest")
    try:
        h = json.loads(bytes(raw[_PREFIX_LEN:start]))
        if bytes.fromhex(h["fingerprint"]) != fingerprint:
            raise _Invalid("foreign fingerprint")
        if bytes.fromhex(h["key"]) != key:
            raise _Invalid("key does not match the name")
        tokens, mask = tuple(int(t) for t in h["token_ids"]), tuple(bool(g) for g in h["group_mask"])
        record = BlockRecord(key, bytes.fromhex(h["parent"]), tokens, int(h["namespace"]), mask)
        dtype = np.dtype(h["dtype"])
        shape = tuple(int(n) for n in h["shape"])
        nbytes = int(h["nbytes"])
        checksum = bytes.fromhex(h["checksum"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _Invalid(f"header: {exc!r}") from exc
    if len(record.parent) != _KEY_BYTES or len(record.token_ids) != block_size or dtype.hasobject:
        raise _Invalid("header fields")
    if any(n < 0 for n in shape) or nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise _Invalid("shape, dtype and byte count disagree")
    if len(raw) - start != nbytes:
        raise _Invalid("payload length")
    data = buf[start:]
    if _blake(data.data) != checksum:
        raise _Invalid("payload checksum")
    return record, (data.view(dtype) if nbytes else np.empty(0, dtype)).reshape(shape)


class DiskStore:
    """Files of KV blocks in one directory, capped at ``max_bytes``, written by one background thread."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        fingerprint: DiskFingerprint,
        *,
        max_queued_bytes: int = 256 * 2**20,
    ) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self._digest = fingerprint.digest()
        self._max_queued_bytes = max_queued_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._index: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # LRU first
        self._queue: collections.deque[tuple[BlockRecord, np.ndarray, object]] = collections.deque()
        self._changes: list[tuple[bool, bytes, object]] = []  # since take_changes: (written?, key, put's tag)
        self._queued_keys: set[bytes] = set()
        self._pending = 0  # queued + in flight
        self._closing = False
        self._warned: set[str] = set()
        self._nonce = itertools.count()
        self._stats = DiskStoreStats(max_bytes=max_bytes)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def put(self, record: BlockRecord, payload: np.ndarray, tag: object = None) -> bool:
        """Queue ``payload`` (not modified by the caller afterwards) for writing; False when refused.
        ``tag``: handed back with the key by :meth:`take_changes` once the file is written."""
        if len(record.key) != _KEY_BYTES or len(record.parent) != _KEY_BYTES or payload.dtype.hasobject:
            raise ValueError("key and parent must be 16-byte digests, the payload a plain array")
        if len(record.token_ids) != self.fingerprint.block_size:
            raise ValueError(f"a block holds {self.fingerprint.block_size} tokens, got {len(record.token_ids)}")
        payload = np.ascontiguousarray(payload)
        with self._lock:
            if self._closing:
                return False
            if record.key in self._index or record.key in self._queued_keys:
                if record.key in self._index:
                    self._index.move_to_end(record.key)
                self._stats.duplicate_puts += 1
                return False
            if self._stats.queued_bytes + payload.nbytes > self._max_queued_bytes:
                self._stats.dropped_writes += 1
                return False
            self._queue.append((record, payload, tag))
            self._queued_keys.add(record.key)
            self._stats.queued_bytes += payload.nbytes
            self._pending += 1
            self._wake.notify_all()
        return True

    def get(self, key: bytes) -> tuple[BlockRecord, np.ndarray] | None:
        """Read and validate ``key``'s file; None (and the file deleted) if it is missing or invalid."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return None
        path = self._path(key)
        start = time.perf_counter()
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = np.empty(size, np.uint8)
                if f.readinto(buf.data) != size:
                    raise _Invalid("short read")
            result = _decode(buf, key, self._digest, self.fingerprint.block_size)
        except (OSError, _Invalid) as exc:
            self._forget_invalid(key, entry, exc)
            return None
        elapsed = time.perf_counter() - start
        with self._lock:
            if self._index.get(key) is entry:
                self._index.move_to_end(key)
            self._stats.reads += 1
            self._stats.read_bytes += size
            self._stats.read_seconds += elapsed
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order a restart reads
        return result

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (on disk or failed); False if ``timeout`` ran out."""
        with self._wake:
            return self._wake.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued writes and stop the writer; later puts are refused (gets still work)."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self._writer.join(timeout)

    def take_changes(self) -> list[tuple[bool, bytes, object]]:
        """What changed since the last call, in order (for KV events): ``(True, key, put's tag)`` for a file
        written, ``(False, key, None)`` for a file deleted (evicted for room, or ignored as invalid;
        files an earlier process wrote too, which no tag names)."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def stats(self) -> DiskStoreStats:
        with self._lock:
            return replace(self._stats)

    def _path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("KV disk store {}: {} (later ones are only counted)", self.directory, message)

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if _TEMP.match(entry.name):
                try:
                    os.unlink(entry.path)
                    self._stats.removed_temp_files += 1
                except OSError as exc:
                    self._warn_once("temp", f"cannot remove {entry.name}: {exc}")
                continue
            m = _NAME.match(entry.name)
            if m and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, bytes.fromhex(m.group(1)), st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = _Entry(size)
            self._stats.num_bytes += size
        self._stats.num_files = len(self._index)
        with self._lock:
            self._evict_locked(0)

    def _evict_locked(self, incoming: int) -> None:
        """Delete LRU files until ``incoming`` more bytes fit under ``max_bytes`` (lock held)."""
        while self._index and self._stats.num_bytes + incoming > self._stats.max_bytes:
            key, entry = self._index.popitem(last=False)
            self._stats.evicted_files += 1
            self._changes.append((False, key, None))
            self._delete_locked(key, entry)

    def _delete_locked(self, key: bytes, entry: _Entry) -> None:
        """Delete the file of ``key``, already taken out of the index (lock held)."""
        self._stats.num_bytes -= entry.size
        self._stats.num_files -= 1
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn_once("delete", f"cannot delete {key.hex()}{SUFFIX}: {exc}")

    def _forget_invalid(self, key: bytes, entry: _Entry, exc: BaseException) -> None:
        with self._lock:
            if self._index.get(key) is not entry:
                return  # evicted (or replaced) while we read: nothing wrong with the file we looked for
            del self._index[key]
            self._stats.ignored_files += 1
            self._changes.append((False, key, None))
            self._delete_locked(key, entry)
            self._warn_once("invalid", f"ignored {key.hex()}{SUFFIX}: {exc}")

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                record, payload, tag = self._queue.popleft()
            try:
                self._write(record, payload, tag)
            except Exception as exc:  # the writer must outlive any one write
                with self._lock:
                    self._stats.write_errors += 1
                    self._warn_once("write", f"write failed: {exc!r}")
            finally:
                with self._wake:
                    self._queued_keys.discard(record.key)
                    self._stats.queued_bytes -= payload.nbytes
                    self._pending -= 1
                    self._wake.notify_all()

    def _write(self, record: BlockRecord, payload: np.ndarray, tag: object) -> None:
        start = time.perf_counter()
        key = record.key
        header = _encode_header(record, payload, self._digest)
        prefix = MAGIC + len(header).to_bytes(4, "little") + _blake(header)
        size = len(prefix) + len(header) + payload.nbytes
        with self._lock:
            if size > self._stats.max_bytes:
                self._stats.dropped_writes += 1
                return
            self._evict_locked(size)
        tmp = self.directory / temp_file_name(key, f"{os.getpid()}.{next(self._nonce)}")
        committed = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                f.write(prefix)
                f.write(header)
                f.write(payload.reshape(-1).view(np.uint8).data)
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                os.replace(tmp, self._path(key))
                committed = True
                self._index[key] = _Entry(size)
                self._stats.num_bytes += size
                self._stats.num_files += 1
                self._stats.writes += 1
                self._stats.write_bytes += size
                self._stats.write_seconds += time.perf_counter() - start
                self._changes.append((True, key, tag))
        except OSError as exc:
            with self._lock:
                self._stats.write_errors += 1
            kind = "disk full" if exc.errno == errno.ENOSPC else "write failed"
            self._warn_once(kind, f"{kind}: {exc}")
        finally:
            if not committed:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
