"""Which static decode step a :class:`~tgi_paged_backend.runner.model_runner.ModelRunner` sets up, and how: CUDA
graphs per ``CUDA_GRAPHS`` bucket on CUDA, one compiled graph with dynamic rows under ``TGI_PAGED_COMPILE`` on CPU,
else none (decode stays eager). The runner owns the step (:attr:`ModelRunner.static_decode`); these functions
decide and build it from the runner's model, pool and config."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from loguru import logger

from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.runner.static.cuda_graphs import measure_decode_graph_bytes
from tgi_paged_backend.runner.static.decode_step import CPU_COMPILE_BUCKETS, StaticDecodeStep, blocks_per_request

if TYPE_CHECKING:
    import torch

    from tgi_paged_backend.runner.model_runner import ModelRunner


def compiles_decode(runner: ModelRunner) -> bool:
    """``TGI_PAGED_COMPILE`` on a CPU runner: decode through the compiled static step."""
    return runner.device.type == "cpu" and runner.model_config.compile_decode and runner.static_decode_supported


def graph_buckets(runner: ModelRunner) -> tuple[int, ...]:
    """The ``CUDA_GRAPHS`` batch sizes the runner captures (none off CUDA)."""
    if runner.device.type != "cuda" or not runner.static_decode_supported:
        return ()
    return runner.model_config.cuda_graphs


def static_step(
    runner: ModelRunner,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    *,
    max_seq_len: int,
    buckets: Sequence[int],
    fixed_width: bool = True,
    groups: LayerGroups | None = None,
) -> StaticDecodeStep:
    """The static step over ``k_caches``/``v_caches`` laid out for ``groups`` (default: the runner's pool's)."""
    groups = runner.pool_groups if groups is None else groups
    layer_groups = tuple(groups.layer_group(layer) for layer in range(runner.spec.num_layers))
    max_blocks = blocks_per_request(max_seq_len, runner.block_size)
    return StaticDecodeStep(
        runner.model, k_caches, v_caches, runner.k_scale, runner.v_scale, buckets, max_blocks, fixed_width,
        layer_groups=layer_groups if groups.num_groups > 1 else None,
    )  # fmt: skip


def decode_graph_bytes(runner: ModelRunner, max_seq_len: int) -> tuple[int, bool]:
    """Device bytes the decode CUDA graphs will take (0 off CUDA or without ``CUDA_GRAPHS``), captured against a
    temporary pool before the real one is sized, and whether the capture failed (then graphs go off)."""
    buckets = graph_buckets(runner)
    if not buckets:
        return 0, False
    # Before the pool exists: the step the engine's (grouped) pool will get.
    make = partial(static_step, runner, max_seq_len=max_seq_len, buckets=buckets, groups=runner.kv_groups)
    try:
        return measure_decode_graph_bytes(make, runner.pool.new_caches, runner.spec.num_layers, runner.device), False
    except Exception as e:  # a family whose forward syncs or branches on values: serve it eagerly
        logger.warning("decode CUDA graphs off: capture failed ({}: {})", type(e).__name__, e)
        return 0, True


def prepared_static_decode(
    runner: ModelRunner,
    max_seq_len: int,
    mode: str | None,
    buckets: Sequence[int] | None,
    fixed_width: bool | None,
    compile_options: dict[str, Any],
) -> StaticDecodeStep | None:
    """The static step :meth:`ModelRunner.prepare_static_decode` describes, prepared over the runner's pool, or
    ``None`` (nothing to set up, or a failed capture or compile, logged by :meth:`.StaticDecodeStep.prepare`)."""
    chosen = tuple(buckets) if buckets is not None else runner.model_config.cuda_graphs
    if mode is None and graph_buckets(runner):
        mode, chosen = "graphs", graph_buckets(runner)
    elif mode is None and compiles_decode(runner):  # one graph, rows dynamic: no per-size compile
        mode, chosen, compile_options = "compile", CPU_COMPILE_BUCKETS, {"dynamic_rows": True, **compile_options}
    if mode is None or not chosen:
        return None
    fixed = mode == "graphs" if fixed_width is None else fixed_width
    step = static_step(
        runner, runner.k_caches, runner.v_caches, max_seq_len=max_seq_len, buckets=chosen, fixed_width=fixed
    )
    return step if step.prepare(mode, **compile_options) else None
