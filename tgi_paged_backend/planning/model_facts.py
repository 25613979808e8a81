"""What the planner knows about the model: its config (a preset or a local directory), its parameters
(counted from safetensors headers or estimated), the runner's activation and RAM figures, and the sizes
one rank serves and the KV layer groups it pages by, each with the shard's own arithmetic."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.planning.param_counts import param_counts
from tgi_paged_backend.planning.presets import PRESETS


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the planner knows about the model."""

    name: str
    spec: Any
    """A :class:`~tgi_paged_backend.runner.model.spec.ModelSpec`."""
    num_params: int
    params_exact: bool
    """``True`` when counted from safetensors headers, ``False`` when estimated from the config."""
    tie_word_embeddings: bool
    config: dict[str, Any] = field(default_factory=dict)
    """The ``config.json`` fields (text config merged) the sizes came from."""


def _read_config(model: str) -> tuple[str, dict[str, Any]]:
    if model in PRESETS:
        return model, dict(PRESETS[model])
    path = Path(model)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(
            f"--model {model!r}: not a preset ({', '.join(PRESETS)}) nor a model directory with config.json"
        )
    raw = json.loads(config_file.read_text())
    text = raw.pop("text_config", None)  # a multimodal config: its text model's fields win (ModelSpec reads them)
    return str(path), _with_layer_types({**raw, **text} if isinstance(text, dict) else raw)


def _with_layer_types(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the per-layer ``layer_types`` transformers derives when a windowed config lists none.

    Gemma 2 and 3 and Cohere 2 checkpoints often predate ``layer_types`` (Gemma 3: ``sliding_window_pattern``);
    the shard reads the list transformers' config class fills in (``ModelSpec.layer_windows``), so the
    planner asks the same class. Left as is when the list is there, no window is set, or transformers does
    not know the model type.
    """
    if cfg.get("layer_types") is not None or not cfg.get("sliding_window") or "model_type" not in cfg:
        return cfg
    import transformers

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "text_config", "vision_config")}
    try:
        layer_types = getattr(transformers.AutoConfig.for_model(str(cfg["model_type"]), **fields), "layer_types", None)
    except (ValueError, TypeError, KeyError):  # an unknown model type, or fields its class refuses
        return cfg
    return cfg if layer_types is None else {**cfg, "layer_types": list(layer_types)}


def count_safetensors_params(model_dir: str | Path) -> int | None:
    """Parameters listed in the safetensors headers of ``model_dir`` (``None`` without files)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in entry["shape"]:
                n *= int(dim)
            total += n
    return total


def estimate_params(cfg: dict[str, Any]) -> int:
    """Parameters from config fields (attention, dense or MoE MLP, norms, embeddings):
    :func:`~tgi_paged_backend.planning.param_counts.param_counts` on one shard."""
    return param_counts(cfg).held


def load_model_facts(model: str, dtype: Any) -> ModelFacts:
    """Model sizes from a preset name or a local directory (``dtype``: the serving torch dtype)."""
    from tgi_paged_backend.runner.model.spec import ModelSpec

    name, cfg = _read_config(model)
    spec = ModelSpec.from_hf_config(SimpleNamespace(**cfg), dtype)
    counted = None if model in PRESETS else count_safetensors_params(model)
    num_params = counted if counted is not None else estimate_params(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    return ModelFacts(name, spec, int(num_params), counted is not None, tied, cfg)


def activation_peak_bytes(spec: Any, dtype: Any, num_tokens: int) -> int:
    """The runner's CPU activation estimate for a prefill of ``num_tokens`` (one logits row).

    The runner's own formula (:func:`~tgi_paged_backend.runner.memory_budget.estimate_prefill_bytes`), so
    the planner cannot drift from the shard.
    """
    from tgi_paged_backend.runner.memory_budget import estimate_prefill_bytes

    return estimate_prefill_bytes(spec, dtype, num_tokens, 1)


def cpu_available_bytes() -> int:
    """Available RAM now, as the runner reads it."""
    from tgi_paged_backend.runner.memory_budget import cpu_available_bytes as runner_available_bytes

    return runner_available_bytes()


def kv_groups(spec: Any, layer_groups: bool = True) -> LayerGroups:
    """The KV layer groups the shard pages ``spec``'s model by (``ModelRunner.kv_groups``): the model's
    groups, or one group of every layer when full and sliding layers mix and ``layer_groups`` is off."""
    groups: LayerGroups = spec.kv_groups
    return LayerGroups.uniform(spec.num_layers) if groups.is_hybrid and not layer_groups else groups


def group_block_bytes(spec: Any, groups: LayerGroups, block_size: int, kv_dtype: Any) -> int:
    """Bytes of one block of a pool laid out for ``groups`` (``ModelRunner.block_bytes_for``): the K/V of
    ``layers_per_block`` layers."""
    return int(spec.kv_bytes_per_block(block_size, kv_dtype)) // spec.num_layers * groups.layers_per_block


def shard_spec(spec: Any, num_shard: int) -> Any:
    """The sizes one rank of ``--num-shard`` serves (raises the shard's divisibility error)."""
    from tgi_paged_backend.runner.parallel.slicing import ShardLayout, check_divisible, local_spec

    if num_shard < 1:
        raise ValueError(f"--num-shard {num_shard} is invalid: at least 1")
    if num_shard == 1:
        return spec
    try:
        check_divisible(spec, num_shard)
    except RuntimeError as err:  # ModelLoadError: the shard's own message
        raise ValueError(str(err)) from None
    layout = ShardLayout(
        rank=0,
        world_size=num_shard,
        num_q_heads=spec.num_q_heads // num_shard,
        num_kv_heads=max(spec.num_kv_heads // num_shard, 1),
        intermediate_size=spec.intermediate_size // num_shard,
        num_layers=spec.num_layers,
    )
    return local_spec(spec, layout)
