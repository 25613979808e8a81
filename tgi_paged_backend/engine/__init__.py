"""Requests, the scheduler (with preemption), the model step, sampling and detokenization.

``build_engine(config)`` is what ``text-generation-server serve`` calls once the config is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tgi_paged_backend.config import BackendConfig
    from tgi_paged_backend.engine.shard_engine import PagedShardEngine


def build_engine(config: BackendConfig) -> PagedShardEngine:
    """Load the model on the best device and wrap it in the paged shard engine (a tensor-parallel
    rank of the group when ``WORLD_SIZE > 1``)."""
    import torch

    from tgi_paged_backend.engine.shard_engine import PagedShardEngine
    from tgi_paged_backend.runner.model_runner import ModelRunner
    from tgi_paged_backend.telemetry.sinks import build_shard_telemetry

    device = torch.device(
        f"cuda:{config.server.rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    cap_device_memory(device, config.cache.cuda_memory_fraction)
    if config.server.world_size > 1:  # --num-shard N: one tensor-parallel rank per process
        from tgi_paged_backend.engine.tp_engine import build_tensor_parallel_engine

        return build_tensor_parallel_engine(config, device)
    runner = ModelRunner(config.model, config.cache, device)
    # The engine reports to one observer; the sinks listening to it are chosen here, from the config.
    names = runner.lora.names if runner.lora is not None else ()
    return PagedShardEngine(config, runner, build_shard_telemetry(config, device=device, adapter_names=names))


def cap_device_memory(device: torch.device, fraction: float) -> None:
    """``CUDA_MEMORY_FRACTION`` as stock applies it (``utils/dist.py``): this process may allocate at most
    ``fraction`` of the CUDA device (``torch.cuda.set_per_process_memory_fraction``). No-op on CPU and at 1."""
    if device.type != "cuda" or fraction >= 1.0:
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, device)
