"""The disk KV store: round trips, restarts, every way a file can be wrong, crashes mid-write, the size cap,
the write queue and the writer's error handling."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tgi_paged_backend.offload import disk_store
from tgi_paged_backend.offload.disk_store import BlockRecord, DiskFingerprint, DiskStore

BLOCK = 4
FP = DiskFingerprint(
    model="org/tiny",
    revision="abc123",
    kv_dtype="float32",
    block_size=BLOCK,
    row_shape=(2, 8),
    layout="groups=1;slots=k,v",
)


def key_of(i: int) -> bytes:
    return bytes([i]) * 16


def record(i: int, parent: int = 0) -> BlockRecord:
    return BlockRecord(
        key=key_of(i),
        parent=key_of(parent),
        token_ids=tuple(range(i, i + BLOCK)),
        namespace=i % 3,
        group_mask=(True, i % 2 == 0),
    )


def payload(i: int, shape: tuple[int, ...] = (2, 2, 8), dtype: str = "float32") -> np.ndarray:
    return (np.arange(np.prod(shape)).reshape(shape) * (i + 1)).astype(dtype)


@pytest.fixture
def store(tmp_path: Path):
    s = DiskStore(tmp_path / "kv", max_bytes=2**20, fingerprint=FP)
    yield s
    s.close()


class GatedFsync:
    """Holds the writer inside ``os.fsync`` of its temporary file until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real = os.fsync

        def fsync(fd: int) -> None:
            if threading.current_thread().name == "kv-disk-writer":
                self.entered.set()
                assert self.release.wait(30)
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_round_trip_of_several_dtypes_and_uint8_views(store: DiskStore) -> None:
    bf16_like = payload(7, dtype="float16").view(np.uint8)  # how callers hand over bf16 / fp8
    cases = {
        1: payload(1),
        2: payload(2, dtype="float16"),
        3: payload(3, dtype="int8"),
        4: bf16_like,
        5: payload(5, shape=(8, 2, 2)).transpose(2, 1, 0),  # not contiguous: stored in C order
        6: payload(6, shape=(0, 2, 8)),
    }
    for i, arr in cases.items():
        assert store.put(record(i), arr)
    assert store.flush(30)
    for i, arr in cases.items():
        assert store.contains(key_of(i))
        got = store.get(key_of(i))
        assert got is not None
        rec, out = got
        assert rec == record(i)
        assert out.dtype == arr.dtype and out.shape == arr.shape
        np.testing.assert_array_equal(out, arr)
        assert out.flags.writeable and out.flags.c_contiguous and out.flags.aligned
    s = store.stats()
    assert s.writes == s.num_files == s.reads == len(cases)
    assert s.num_bytes == s.write_bytes == sum(p.stat().st_size for p in store.directory.iterdir())
    assert s.ignored_files == s.dropped_writes == s.write_errors == 0
    assert s.queued_bytes == 0


def test_files_and_directory_are_private(store: DiskStore) -> None:
    store.put(record(1), payload(1))
    store.flush(30)
    assert store.directory.stat().st_mode & 0o777 == 0o700
    assert (store.directory / (key_of(1).hex() + ".kv")).stat().st_mode & 0o777 == 0o600


def test_a_new_store_over_the_same_directory_finds_the_files(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, 2**20, FP)
    for i in (1, 2, 3):
        first.put(record(i), payload(i))
    first.close()
    before = first.stats()

    second = DiskStore(tmp_path, 2**20, FP)
    try:
        s = second.stats()
        assert (s.num_files, s.num_bytes) == (3, before.num_bytes)
        assert all(second.contains(key_of(i)) for i in (1, 2, 3))
        got = second.get(key_of(2))
        assert got is not None and got[0] == record(2)
        np.testing.assert_array_equal(got[1], payload(2))
        assert not second.put(record(2), payload(2))  # already on disk
    finally:
        second.close()


def _break_file(store: DiskStore, key: bytes, how: str) -> None:
    path = store.directory / (key.hex() + ".kv")
    data = bytearray(path.read_bytes())
    if how == "payload byte":
        data[-1] ^= 0x01
    elif how == "truncated":
        data = data[:-3]
    elif how == "header byte":  # a token id digit: caught by the header digest, not only by parsing
        at = data.index(b'"token_ids":[') + len(b'"token_ids":[')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
    elif how == "magic":
        data[:8] = b"TGIPKV99"
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["payload byte", "truncated", "header byte", "magic", "empty"])
def test_a_damaged_file_is_ignored_counted_and_deleted(store: DiskStore, how: str) -> None:
    store.put(record(1), payload(1))
    store.put(record(2), payload(2))
    store.flush(30)
    _break_file(store, key_of(1), how)

    assert store.get(key_of(1)) is None
    s = store.stats()
    assert s.ignored_files == 1 and s.reads == 0
    assert not store.contains(key_of(1))
    assert files(store.directory) == [key_of(2).hex() + ".kv"]
    assert (s.num_files, s.num_bytes) == (1, (store.directory / (key_of(2).hex() + ".kv")).stat().st_size)
    assert store.get(key_of(2)) is not None  # the neighbour is untouched
    assert store.put(record(1), payload(1))  # and the key can be stored again
    store.flush(30)
    assert store.get(key_of(1)) is not None


@pytest.mark.parametrize(
    "change",
    [
        {"model": "org/other"},
        {"revision": "def456"},
        {"kv_dtype": "bfloat16"},
        {"layout": "groups=2;slots=k,v"},
        {"row_shape": (2, 4)},
        {"adapters": ("lora-a",)},
    ],
)
def test_a_file_of_another_fingerprint_is_ignored(tmp_path: Path, change: dict) -> None:
    fields = {f: getattr(FP, f) for f in DiskFingerprint.__dataclass_fields__}
    foreign_fp = DiskFingerprint(**{**fields, **change})
    assert foreign_fp.digest() != FP.digest()
    foreign = DiskStore(tmp_path, 2**20, foreign_fp)
    foreign.put(record(1), payload(1))
    foreign.close()

    ours = DiskStore(tmp_path, 2**20, FP)
    try:
        assert ours.contains(key_of(1))  # names are all the scan reads
        assert ours.get(key_of(1)) is None
        assert ours.stats().ignored_files == 1 and files(tmp_path) == []
    finally:
        ours.close()


def test_a_file_under_another_keys_name_is_ignored(store: DiskStore) -> None:
    store.put(record(1), payload(1))
    store.close()
    os.rename(store.directory / (key_of(1).hex() + ".kv"), store.directory / (key_of(9).hex() + ".kv"))
    again = DiskStore(store.directory, 2**20, FP)
    try:
        assert again.get(key_of(9)) is None and again.stats().ignored_files == 1
    finally:
        again.close()


def test_a_file_of_another_block_size_is_ignored(tmp_path: Path) -> None:
    small = DiskFingerprint(FP.model, FP.revision, FP.kv_dtype, 2, FP.row_shape, FP.layout)
    assert small.digest() != FP.digest()
    s = DiskStore(tmp_path, 2**20, small)
    s.put(BlockRecord(key_of(1), key_of(0), (1, 2), 0, (True,)), payload(1))
    s.close()
    ours = DiskStore(tmp_path, 2**20, FP)
    try:
        assert ours.get(key_of(1)) is None and ours.stats().ignored_files == 1
    finally:
        ours.close()


def test_a_write_is_invisible_until_its_rename_and_a_crash_leaves_nothing_that_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = GatedFsync(monkeypatch)
    store = DiskStore(tmp_path, 2**20, FP)
    assert store.put(record(1), payload(1))
    assert gate.entered.wait(30)
    # Mid-write: the whole temporary file is there, yet the key is neither indexed nor loadable.
    (temp,) = files(tmp_path)
    assert temp.startswith("." + key_of(1).hex()) and temp.endswith(".tmp")
    assert not store.contains(key_of(1)) and store.get(key_of(1)) is None
    assert not store.flush(timeout=0.01)

    # "Crash": a copy of the half-written file survives under another writer's temporary name.
    crashed = tmp_path / disk_store.temp_file_name(key_of(2), "4242.0")
    crashed.write_bytes((tmp_path / temp).read_bytes())
    gate.release.set()
    assert store.flush(30)
    store.close()
    assert store.contains(key_of(1)) and not store.contains(key_of(2))

    reopened = DiskStore(tmp_path, 2**20, FP)
    try:
        assert reopened.stats().removed_temp_files == 1
        assert files(tmp_path) == [key_of(1).hex() + ".kv"]
        assert not reopened.contains(key_of(2)) and reopened.get(key_of(2)) is None
        assert reopened.get(key_of(1)) is not None
    finally:
        reopened.close()


def test_the_size_cap_evicts_the_least_recently_used(tmp_path: Path) -> None:
    probe = DiskStore(tmp_path / "probe", 2**20, FP)
    probe.put(record(1), payload(1))
    probe.close()
    size = probe.stats().num_bytes

    store = DiskStore(tmp_path / "kv", 3 * size + size // 2, FP)
    try:
        for i in (1, 2, 3):
            store.put(record(i), payload(i))
        store.flush(30)
        assert store.get(key_of(1)) is not None  # 1 is now the most recent; 2 the least
        assert not store.put(record(3), payload(3))  # a repeated put is a use too: 3 after 1
        store.put(record(4), payload(4))
        store.flush(30)
        assert [store.contains(key_of(i)) for i in (1, 2, 3, 4)] == [True, False, True, True]
        store.put(record(5), payload(5))
        store.flush(30)
        assert [store.contains(key_of(i)) for i in (1, 3, 4, 5)] == [False, True, True, True]
        s = store.stats()
        assert s.evicted_files == 2 and s.num_files == 3
        assert s.num_bytes == sum(p.stat().st_size for p in (tmp_path / "kv").iterdir()) <= s.max_bytes
    finally:
        store.close()


def test_a_restart_evicts_by_mtime_when_the_cap_shrank(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 2**20, FP)
    for i in (1, 2, 3):
        store.put(record(i), payload(i))
    store.close()
    size = store.stats().num_bytes // 3
    for age, i in enumerate((2, 3, 1)):  # 2 oldest, then 3, then 1
        os.utime(tmp_path / (key_of(i).hex() + ".kv"), (1_000_000 + age, 1_000_000 + age))
    smaller = DiskStore(tmp_path, 2 * size, FP)
    try:
        assert [smaller.contains(key_of(i)) for i in (1, 2, 3)] == [True, False, True]
        assert smaller.stats().evicted_files == 1 and len(files(tmp_path)) == 2
    finally:
        smaller.close()


def test_a_block_larger_than_the_cap_is_dropped(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 100, FP)
    try:
        assert store.put(record(1), payload(1))
        store.flush(30)
        s = store.stats()
        assert s.dropped_writes == 1 and s.writes == 0 and files(tmp_path) == []
    finally:
        store.close()


def test_a_full_queue_refuses_puts_and_counts_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = GatedFsync(monkeypatch)
    nbytes = payload(1).nbytes
    store = DiskStore(tmp_path, 2**20, FP, max_queued_bytes=2 * nbytes + nbytes // 2)
    try:
        assert store.put(record(1), payload(1))
        assert gate.entered.wait(30)  # 1 in flight still counts as queued until written
        assert store.put(record(2), payload(2))
        assert not store.put(record(3), payload(3))
        assert store.stats().dropped_writes == 1 and store.stats().queued_bytes == 2 * nbytes
        gate.release.set()
        assert store.flush(30)
        assert store.put(record(3), payload(3))  # room again
        store.flush(30)
        assert [store.contains(key_of(i)) for i in (1, 2, 3)] == [True, True, True]
    finally:
        gate.release.set()
        store.close()


def test_a_key_is_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = GatedFsync(monkeypatch)
    store = DiskStore(tmp_path, 2**20, FP)
    try:
        assert store.put(record(1), payload(1))
        assert not store.put(record(1), payload(1))  # queued
        gate.release.set()
        store.flush(30)
        assert not store.put(record(1), payload(1))  # stored
        store.flush(30)
        s = store.stats()
        assert (s.writes, s.duplicate_puts, s.dropped_writes, s.num_files) == (1, 2, 0, 1)
    finally:
        gate.release.set()
        store.close()


def test_close_writes_what_was_queued_and_refuses_later_puts(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 2**20, FP)
    for i in range(1, 9):
        assert store.put(record(i), payload(i))
    store.close()
    assert store.stats().writes == 8 and len(files(tmp_path)) == 8
    assert not store.put(record(20), payload(20))
    assert store.get(key_of(3)) is not None  # reads still work after close
    store.close()  # idempotent


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failing_disk_is_counted_never_raised_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    real = getattr(os, failing)

    def broken(*args, **kwargs):
        if threading.current_thread().name == "kv-disk-writer":
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    store = DiskStore(tmp_path, 2**20, FP)
    try:
        monkeypatch.setattr(os, failing, broken)
        assert store.put(record(1), payload(1))
        assert store.put(record(2), payload(2))
        assert store.flush(30)
        s = store.stats()
        assert (s.write_errors, s.writes, s.num_files, s.num_bytes) == (2, 0, 0, 0)
        assert files(tmp_path) == [] and not store.contains(key_of(1))
        monkeypatch.setattr(os, failing, real)
        assert store.put(record(1), payload(1))  # the writer lives on
        store.flush(30)
        assert store.get(key_of(1)) is not None
    finally:
        store.close()


def test_records_that_cannot_be_stored_are_refused_at_put(store: DiskStore) -> None:
    with pytest.raises(ValueError):
        store.put(BlockRecord(b"short", key_of(0), tuple(range(BLOCK)), 0, (True,)), payload(1))
    with pytest.raises(ValueError):
        store.put(BlockRecord(key_of(1), key_of(0), (1, 2), 0, (True,)), payload(1))
    with pytest.raises(ValueError):
        store.put(record(1), np.array([object()]))


def test_the_fingerprint_digest_is_stable_and_covers_every_field() -> None:
    assert FP.digest() == DiskFingerprint(**{f: getattr(FP, f) for f in DiskFingerprint.__dataclass_fields__}).digest()
    assert len(FP.digest()) == 16
    # Files outlive processes and upgrades: the encoding must not drift.
    assert FP.digest().hex() == GOLDEN_DIGEST
    assert DiskFingerprint("m", "r", "float32", 16, [4, 2], "l").row_shape == (4, 2)  # type: ignore[arg-type]
    seen = {FP.digest()}
    for change in ({"block_size": 8}, {"adapters": ("a", "b")}, {"adapters": ("a,b",)}, {"model": "org/tiny "}):
        fields = {f: getattr(FP, f) for f in DiskFingerprint.__dataclass_fields__}
        seen.add(DiskFingerprint(**{**fields, **change}).digest())
    assert len(seen) == 5


GOLDEN_DIGEST = "739c9cbd5a26c4255a0f51fa13afc1ce"


def test_the_module_does_not_import_torch() -> None:
    """The disk tier is numpy + stdlib: importing it must not pull torch in (a fresh interpreter)."""
    code = "import sys, tgi_paged_backend.offload.disk_store; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2], timeout=120)
