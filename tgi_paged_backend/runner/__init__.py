"""Model loading (transformers + safetensors), the paged attention hook and per-step input metadata.

- :mod:`.model_loader`: load a local causal LM with our attention, its tokenizer and stop tokens.
- :mod:`.model_spec`: :class:`ModelSpec`, the sizes the KV pool and kernels need.
- :mod:`.attention`: the attention function registered with transformers (``"tgi_paged"``).
- :mod:`.input_batch`: :class:`ForwardBatch`, one step's packed tokens and paged metadata.
- :mod:`.model_runner`: :class:`ModelRunner`, model + KV pool: forward, copy, swap, profiling.

Names are imported lazily so that ``input_batch`` users do not pay for importing transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ForwardBatch": "input_batch",
    "RequestChunk": "input_batch",
    "build_forward_batch": "input_batch",
    "ModelSpec": "model_spec",
    "resolve_kv_dtype": "model_spec",
    "ModelRunner": "model_runner",
    "LoadedModel": "model_loader",
    "ModelLoadError": "model_loader",
    "load_model": "model_loader",
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
