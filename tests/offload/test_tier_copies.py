"""The host tier's copy strategies (:mod:`tgi_paged_backend.offload.tier_copies`): on CUDA the copy-stream
moves leave the pool and the arena exactly as the inline copies do, under the step's access pattern
(an evicted block is offloaded and overwritten by the "forward" at once; a load's blocks are read at once;
rows are reused by later offloads before anything settles). :func:`check_stream_copies` is also run by the
GPU check (``integration/gpu_kernel_checks.py``)."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.offload.tier_copies import InlineTierCopies, StreamTierCopies, tier_copies_for
from tgi_paged_backend.runner.kv_pool import KVPool
from tgi_paged_backend.runner.model.spec import ModelSpec

NUM_BLOCKS, HOST_ROWS, BLOCK_SIZE = 24, 12, 16


def _pool(device: torch.device, dtype: torch.dtype = torch.float16) -> KVPool:
    spec = ModelSpec(
        model_type="llama",
        num_layers=3,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=512,
        max_position_embeddings=512,
        sliding_window=None,
        softcap=0.0,
        dtype=torch.float16,
    )
    pool = KVPool(spec, BLOCK_SIZE, dtype, device)
    pool.allocate(NUM_BLOCKS, LayerGroups.uniform(spec.num_layers))
    pool.allocate_host_tier(HOST_ROWS)
    for tensor in pool.host_tensors():
        tensor.zero_()
    return pool


def _script(seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
    """Steps of moves: offloads of evicted blocks (then overwritten), loads into fresh blocks, row reuse."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(20):
        blocks = torch.randperm(NUM_BLOCKS - 1, generator=gen)[:6].add(1).tolist()
        rows = torch.randperm(HOST_ROWS, generator=gen)[:6].tolist()
        steps.append(("offload", blocks[:3], rows[:3]))
        steps.append(("load", rows[3:5], blocks[3:5]))
    return steps


def _run(copies, pool: KVPool, script, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for n, (kind, src, dst) in enumerate(script):
        if kind == "offload":
            copies.offload(src, dst)
            for slot in pool.slot_tensors():  # the forward writes the evicted blocks right away
                noise = torch.randn((len(src), *slot.shape[1:]), generator=gen).to(slot.device, slot.dtype)
                slot[torch.tensor(src, device=slot.device)] = noise
        else:
            if n % 4 == 1:
                copies.settle()  # the step ended: entries land, loads may read their rows
            copies.load(src, dst)
            for slot in pool.slot_tensors():  # the forward reads them at once (and writes them here)
                index = torch.tensor(dst, device=slot.device)
                slot[index] = slot[index].float().add(1).to(slot.dtype)
    copies.settle()


def check_stream_copies(device: torch.device) -> None:
    """The copy stream's result equals the inline copies' (pool and arena, bit for bit; fp16 and fp8 KV)."""
    for dtype in (torch.float16, torch.float8_e4m3fn):
        script = _script()
        torch.manual_seed(0)
        reference, streamed = _pool(device, dtype), _pool(device, dtype)
        for a, b in zip(reference.slot_tensors(), streamed.slot_tensors()):
            a.copy_(torch.randn(a.shape).to(device, a.dtype))
            b.copy_(a)
        _run(InlineTierCopies(reference), reference, script)
        _run(StreamTierCopies(streamed), streamed, script)
        torch.cuda.synchronize(device)
        _assert_same(reference, streamed)


def _assert_same(reference: KVPool, streamed: KVPool) -> None:
    for a, b in zip(
        reference.slot_tensors() + reference.host_tensors(), streamed.slot_tensors() + streamed.host_tensors()
    ):
        assert torch.equal(a.cpu(), b.cpu()), "the copy stream's moves differ from the inline ones"


def test_cpu_pools_copy_inline():
    pool = _pool(torch.device("cpu"))
    copies = tier_copies_for(pool)
    assert isinstance(copies, InlineTierCopies)
    before = [t.clone() for t in pool.slot_tensors()]
    copies.offload([3, 5], [0, 7])
    assert copies.num_in_flight == 0
    for slot, old in zip(pool.host_tensors(), before):
        assert torch.equal(slot[[0, 7]], old[[3, 5]])
    copies.load([7], [9])
    for slot, old in zip(pool.slot_tensors(), before):
        assert torch.equal(slot[9], old[5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stream_copies_match_inline_copies_on_cuda():
    check_stream_copies(torch.device("cuda"))


class _FakeCuda:
    """Streams and events that do nothing: on CPU, every copy is done when issued."""

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

        def wait_event(self, event) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    @staticmethod
    def current_stream(device=None):
        return _FakeCuda.Stream()

    @staticmethod
    def stream(stream):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_stream_copies_data_flow_without_cuda(monkeypatch, dtype):
    """The copy-stream strategy's data flow (device gather, staged transfer, rows written at ``settle`` in
    issue order) with streams that do nothing, on CPU: same pool and arena as the inline copies. (The
    stream ordering itself needs CUDA: :func:`test_stream_copies_match_inline_copies_on_cuda`.)"""
    import types

    import tgi_paged_backend.offload.tier_copies as module

    real_empty = torch.empty
    fake_torch = types.SimpleNamespace(
        **{name: getattr(torch, name) for name in ("tensor", "int64", "index_select")},
        cuda=_FakeCuda,
        empty=lambda *a, pin_memory=False, **kw: real_empty(*a, **kw),
    )
    monkeypatch.setattr(module, "torch", fake_torch)
    monkeypatch.setattr(StreamTierCopies, "_used_on_copy_stream", lambda self, tensors: tensors)
    cpu = torch.device("cpu")
    script = _script(seed=3)
    reference, streamed = _pool(cpu, dtype), _pool(cpu, dtype)
    for a, b in zip(reference.slot_tensors(), streamed.slot_tensors()):
        a.copy_(torch.randn(a.shape).to(a.dtype))
        b.copy_(a)
    InlineTierCopies(reference).offload([1, 2], [0, 1])
    _run(InlineTierCopies(reference), reference, script)
    copies = object.__new__(StreamTierCopies)
    copies.pool, copies.stream, copies._in_flight = streamed, _FakeCuda.Stream(), []
    copies.offload([1, 2], [0, 1])
    assert copies.num_in_flight == 1
    assert not streamed.host_tensors()[0][[0, 1]].view(torch.uint8).any(), "rows written before settle"
    copies.settle()
    assert copies.num_in_flight == 0
    _run(copies, streamed, script)
    for a, b in zip(
        reference.slot_tensors() + reference.host_tensors(), streamed.slot_tensors() + streamed.host_tensors()
    ):
        assert torch.equal(a, b)
