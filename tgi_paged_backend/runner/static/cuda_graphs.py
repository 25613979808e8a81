"""CUDA graphs of the static decode step: one per bucket, captured at Warmup, replayed per decode step.

:func:`capture_decode_graphs` captures every bucket of a :class:`~runner.static.decode_step.StaticDecodeStep`
into one shared graph memory pool, largest bucket first (the smaller ones then fit in memory the
larger one's capture freed), and points the step's per-bucket callables at the replays. A replay's
logits live in the pool, where another bucket's replay may later write: the step copies the rows it
returns (``StaticDecodeStep.run``) before anything else replays.

Graphs hold the addresses of the pool and the buffers they were captured with, so the runner
captures after the KV pool is allocated and drops them whenever the pool is replaced. Their memory
must be known before the pool is sized: :func:`measure_decode_graph_bytes` captures them once
against a one-block temporary pool and returns what that took on the device.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

if TYPE_CHECKING:  # decode_step imports this module when it captures: no import back at run time
    from tgi_paged_backend.runner.static.decode_step import StaticDecodeStep


def _replay(graph: torch.cuda.CUDAGraph, logits: torch.Tensor, *views: torch.Tensor) -> torch.Tensor:
    """A bucket's run: the graph reads the buffers it was captured on, so the views passed are unused."""
    graph.replay()
    return logits


def _warm_up(forward: Callable[[], torch.Tensor], device: torch.device) -> None:
    """One eager run on a side stream: kernels compile and libraries allocate their workspaces
    outside the capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        forward()
    torch.cuda.current_stream(device).wait_stream(side)


def _capture(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The graph of ``forward`` (allocating from ``pool``) and the output tensor its replays rewrite."""
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        logits = forward()
    return graph, logits


def capture_decode_graphs(step: StaticDecodeStep) -> None:
    """Capture one CUDA graph per bucket of ``step`` (its pool and buffers on a CUDA device) in one
    shared memory pool and make ``step.runs`` replay them. Raises what a failed capture raises (a
    forward that synchronises or branches on values cannot be captured); ``step.runs`` is then unchanged."""
    pool = torch.cuda.graph_pool_handle()
    replays: dict[int, Callable[..., torch.Tensor]] = {}
    for bucket in reversed(step.buckets):
        step.inputs.pad(bucket, step.inputs.max_blocks)
        forward = partial(step.forward, bucket)
        _warm_up(forward, step.device)
        graph, logits = _capture(forward, pool)
        replays[bucket] = partial(_replay, graph, logits)
    torch.cuda.synchronize(step.device)
    step.runs.update(replays)


def measure_decode_graph_bytes(
    make_step: Callable[[list[torch.Tensor], list[torch.Tensor]], StaticDecodeStep],
    new_caches: Callable[[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]],
    num_layers: int,
    device: torch.device,
) -> int:
    """Device bytes the decode graphs take: ``make_step(k_caches, v_caches)`` is built over a
    temporary one-block pool (``new_caches(1, num_layers)``: the pool's layout, MLA's value views included)
    and captured, and the drop in free device memory is measured (buffers, the graphs' pool, workspaces), less
    the temporary pool. Everything is freed again before returning."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    k_tmp, v_tmp = new_caches(1, num_layers)
    step = make_step(k_tmp, v_tmp)
    capture_decode_graphs(step)
    free_after = torch.cuda.mem_get_info(device)[0]
    storages: dict[int, int] = {}
    for tensor in k_tmp + v_tmp:  # a value view shares its key's storage: counted once
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    tmp_bytes = sum(storages.values())
    del step, k_tmp, v_tmp
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    used = max(0, free_before - free_after - tmp_bytes)
    logger.info("decode CUDA graphs: {:.1f} MiB measured against a temporary pool", used / 2**20)
    return int(used)
