"""Requests, the scheduler (with preemption), the model step, sampling and detokenization.

``build_engine(config)`` is what ``text-generation-server serve`` calls once the config is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tgi_paged_backend.config import BackendConfig
    from tgi_paged_backend.engine.shard_engine import PagedShardEngine


def build_engine(config: BackendConfig) -> PagedShardEngine:
    """Load the model on the best device and wrap it in the paged shard engine."""
    import torch

    from tgi_paged_backend.engine.shard_engine import PagedShardEngine
    from tgi_paged_backend.runner.model_runner import ModelRunner

    device = torch.device(f"cuda:{config.server.rank % torch.cuda.device_count()}"
                          if torch.cuda.is_available() else "cpu")
    runner = ModelRunner(config.model, config.cache, device)
    return PagedShardEngine(config, runner)
