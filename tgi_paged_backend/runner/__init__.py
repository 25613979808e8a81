"""Run a transformers model over the paged KV pool: one folder per concern.

- :mod:`.model_runner`: :class:`ModelRunner`, model + KV pool: forward, copy, swap, profiling.
- :mod:`.attention`: the attention function registered with transformers (``"tgi_paged"``).
- :mod:`.input_batch`: :class:`ForwardBatch`, one step's packed tokens and paged metadata.
- :mod:`.model`: load a checkpoint with our attention (:mod:`.model.loader`), its sizes
  (:mod:`.model.spec`), which families are served, RoPE scaling, Medusa heads.
- :mod:`.quant`: quantized weights (``--quantize``, compressed-tensors, GPTQ, AWQ).
- :mod:`.cpu`: the CPU load-time rewrites (fused blocks, native C++ layers, packed linears).
- :mod:`.parallel`: tensor parallelism (process group, slicing, the per-rank runner).
- :mod:`.static`: the static decode step and its CUDA graphs.

Names are imported lazily so that ``input_batch`` users do not pay for importing transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ForwardBatch": "input_batch",
    "RequestChunk": "input_batch",
    "build_forward_batch": "input_batch",
    "ModelSpec": "model.spec",
    "resolve_kv_dtype": "model.spec",
    "ModelRunner": "model_runner",
    "LoadedModel": "model.loader",
    "ModelLoadError": "model.loader",
    "load_model": "model.loader",
    "ATTENTION_NAME": "attention",
    "METADATA_KWARG": "attention",
    "PagedAttentionMetadata": "attention",
    "register_attention": "attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)
