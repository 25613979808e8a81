"""The shape facts of a loaded model that the KV pool and the kernels need.

:class:`ModelSpec` is derived once from the transformers config. Nothing else in the runner reads
the HF config for sizes, so model-family quirks (``head_dim`` missing, sliding windows declared but
unused, logit soft-capping) are resolved here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tgi_paged_backend.memory.layer_groups import LayerGroups

_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map ``CacheConfig.kv_cache_dtype`` to a torch dtype (``auto`` = the model dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return _KV_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is invalid: allowed ('auto', {', '.join(map(repr, _KV_DTYPES))})"
        ) from None


def _sliding_window(config: Any) -> int | None:
    """The attention window, or ``None`` when no layer of the model really uses one.

    Qwen2-style configs carry a ``sliding_window`` value even when ``use_sliding_window`` is off;
    transformers >= 4.53 configs list per-layer ``layer_types``.
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


EVERY_LAYER_WINDOWED = frozenset({"mistral", "mixtral", "phi3", "starcoder2"})
"""Model types without ``layer_types`` whose every attention layer passes ``config.sliding_window``
(checked against the modeling code by ``tests/runner/test_family_matrix.py``)."""


def _reclaim_window(config: Any) -> int | None:
    """The window of *every* attention layer, or ``None`` when some layer reads the whole history.

    Blocks behind it are given back to the pool (``KVCacheManager(reclaim_window=...)``), so this
    errs on ``None``: per-layer ``layer_types`` decide when present, otherwise only the model types
    of :data:`EVERY_LAYER_WINDOWED`.
    """
    window = _sliding_window(config)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if all(t == "sliding_attention" for t in layer_types) else None
    return window if str(config.model_type) in EVERY_LAYER_WINDOWED else None


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each attention layer's window (``None``: full attention), from ``layer_types`` when present, else
    the model's window for every layer of :data:`EVERY_LAYER_WINDOWED` types; full otherwise (errs on the
    side that keeps memory)."""
    num_layers = int(config.num_hidden_layers)
    window = _sliding_window(config)
    if window is None:
        return (None,) * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return ((window if str(config.model_type) in EVERY_LAYER_WINDOWED else None),) * num_layers


def num_kv_heads_of(config: Any) -> int:
    """KV heads per layer. Falcon names them its own way: ``num_kv_heads`` in its new decoder architecture;
    in the old one a single KV head with ``multi_query``, else one per query head."""
    num_q_heads = int(config.num_attention_heads)
    if str(config.model_type) == "falcon":
        if config.new_decoder_architecture:
            return int(config.num_kv_heads)
        return 1 if config.multi_query else num_q_heads
    return int(getattr(config, "num_key_value_heads", None) or num_q_heads)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Sizes of a decoder-only causal LM, as the KV pool and the attention kernels see them."""

    model_type: str
    """``config.model_type`` (``llama``, ``mistral``, ``qwen2``, ...)."""
    num_layers: int
    """Decoder layers; one K and one V cache tensor each."""
    num_q_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (``< num_q_heads`` for grouped-query attention)."""
    head_dim: int
    """Channels per head."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """MLP width (used for activation-memory estimates)."""
    vocab_size: int
    """Rows of the LM head; logits have this many columns."""
    max_position_embeddings: int
    """Longest sequence the model was configured for."""
    sliding_window: int | None
    """Attention window in tokens when any layer uses one, else ``None``."""
    reclaim_window: int | None = None
    """The window when every attention layer uses it (blocks behind it can be given back), else ``None``."""
    layer_windows: tuple[int | None, ...] = ()
    """Each attention layer's window (``None``: full attention); ``()``: every layer full."""
    softcap: float
    """Attention logit soft-cap (Gemma 2); ``0.0`` means none."""
    dtype: torch.dtype
    """Dtype of the weights and activations."""
    latent_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3, ``kv_lora_rank``): the compressed KV's width, else 0. The pool
    then holds ONE tensor per layer, ``[blocks, block_size, 1, head_dim]`` with ``head_dim = latent_rank +
    qk_rope_head_dim`` (the latent, then the shared RoPE key), and the value cache is the view of its first
    ``latent_rank`` columns (:mod:`tgi_paged_backend.runner.families.mla`)."""

    @property
    def v_head_dim(self) -> int:
        """Channels of a value row in the pool (the latent's width under MLA, else :attr:`head_dim`)."""
        return self.latent_rank or self.head_dim

    @property
    def kv_tensors_per_layer(self) -> int:
        """Pool tensors that own memory per layer: K and V, or the one latent tensor under MLA."""
        return 1 if self.latent_rank else 2

    @property
    def hidden(self) -> int:
        """Alias of :attr:`hidden_size`."""
        return self.hidden_size

    @property
    def vocab(self) -> int:
        """Alias of :attr:`vocab_size`."""
        return self.vocab_size

    @classmethod
    def from_hf_config(cls, config: Any, dtype: torch.dtype) -> ModelSpec:
        """Read the sizes from a ``transformers.PretrainedConfig``."""
        config = getattr(config, "text_config", None) or config
        num_q_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
        latent_rank = int(getattr(config, "kv_lora_rank", None) or 0)
        if latent_rank:  # MLA: one entry per token and layer, [latent ; RoPE key], read by every query head
            head_dim = latent_rank + int(config.qk_rope_head_dim)
        return cls(
            model_type=str(config.model_type),
            num_layers=int(config.num_hidden_layers),
            num_q_heads=num_q_heads,
            num_kv_heads=1 if latent_rank else num_kv_heads_of(config),
            head_dim=int(head_dim),
            latent_rank=latent_rank,
            hidden_size=int(config.hidden_size),
            intermediate_size=int(
                getattr(config, "intermediate_size", None)
                or getattr(config, "ffn_hidden_size", None)  # Falcon
                or 4 * config.hidden_size
            ),
            vocab_size=int(config.vocab_size),
            # MPT names its limit max_seq_len; 0: none named (Bloom)
            max_position_embeddings=int(
                getattr(config, "max_position_embeddings", 0) or getattr(config, "max_seq_len", 0)
            ),
            sliding_window=_sliding_window(config),
            reclaim_window=_reclaim_window(config),
            layer_windows=_layer_windows(config),
            softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            dtype=dtype,
        )

    @property
    def kv_groups(self) -> LayerGroups:
        """The layers' KV groups (``memory.layer_groups``): one group unless full and windowed layers mix."""
        if not self.layer_windows:
            return LayerGroups.uniform(self.num_layers, self.reclaim_window)
        return LayerGroups.from_layer_windows(self.layer_windows)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token position over all layers (MLA: ``(kv_lora_rank + qk_rope_head_dim)
        x layers x itemsize``, the latent counted once)."""
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        return self.kv_tensors_per_layer * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes of one physical block (K and V, all layers); ``kv_dtype`` defaults to :attr:`dtype`."""
        return block_size * self.kv_bytes_per_token(kv_dtype or self.dtype)
