"""PEFT LoRA checkpoints: find them without network, read them, check them against the base model.

A checkpoint is a directory with ``adapter_config.json`` (``peft_type: LORA``) and
``adapter_model.safetensors`` (or ``adapter_model.bin``), keys
``base_model.model.<module path>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``),
where ``<module path>`` is the module's name in the transformers model. Each module's delta is
``scaling * B(A(x))`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``), ``r`` and
``alpha`` from ``rank_pattern`` / ``alpha_pattern`` when a pattern matches the module, as PEFT does.

What is refused, with the entry and the reason (every other adapter would be silently wrong): DoRA,
``modules_to_save``, trained biases, ``fan_in_fan_out``, LoRA on embeddings or on the LM head, and any
target that is not a linear layer of the base model with the adapter's shapes. Files are data from
outside: a config or weight file of the wrong type, a non-finite ``lora_alpha``, a rank above
``TGI_PAGED_MAX_LORA_RANK`` (one high-rank adapter would pad every slot's stacks to its rank) and a
``rank_pattern`` / ``alpha_pattern`` key that is too long or too slow to match (:data:`PATTERN_TIMEOUT_S`;
they are regular expressions) are refused too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import regex
import torch
from torch import nn

from tgi_paged_backend.config import DEFAULT_MAX_LORA_RANK, ConfigError
from tgi_paged_backend.lora.sources import AdapterSource

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_PATTERN_CHARS = 512
PATTERN_TIMEOUT_S = 0.1
"""Time one ``rank_pattern`` / ``alpha_pattern`` key may take to match one module name (a catastrophic
pattern would otherwise hang start-up)."""
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


@dataclass(frozen=True, slots=True)
class LoraModuleWeights:
    """One adapted linear layer: ``delta(x) = scaling * (x @ a.T) @ b.T``."""

    a: torch.Tensor
    """``[r, in_features]``."""
    b: torch.Tensor
    """``[out_features, r]``."""
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter: its name, index (1-based; 0 is the base model) and weights per module path."""

    name: str
    index: int
    directory: Path
    modules: dict[str, LoraModuleWeights]

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.modules.values())).a.dtype

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.modules.values())

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.modules.values() for t in (w.a, w.b))


def adapter_directory(source: AdapterSource) -> Path:
    """The local directory of ``source``: its path, or its snapshot in the local hub cache (no network)."""
    if source.path is not None:
        if not source.path.is_dir():
            raise ConfigError(f"LORA_ADAPTERS entry {str(source)!r}: {source.path} is not a directory")
        return source.path
    local = Path(source.name)
    if local.is_dir():  # a bare local path, as the stock server also accepts
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source.name, revision=source.revision, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any hub failure: name the entry and the way out
        raise ConfigError(
            f"LORA_ADAPTERS entry {str(source)!r}: not in the local hub cache ({type(e).__name__}); "
            "the launcher downloads hub adapters before starting the shard, or give name=/local/path"
        ) from None


def _is_linear(module: nn.Module | None) -> bool:
    """``nn.Linear`` or one of the quantized linears (:mod:`tgi_paged_backend.runner.quant`): any module
    with integer ``in_features`` and ``out_features`` (an embedding has neither)."""
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int
    )


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: a pattern key (a regex) matches a module whose name is the key or ends with ``.<key>``;
    the first matching key wins. Keys are matched with a time limit (ValueError when one is too long, too
    slow or not a regular expression)."""
    for key, value in pattern.items():
        if not isinstance(key, str) or len(key) > MAX_PATTERN_CHARS:
            raise ValueError(f"pattern key {str(key)[:40]!r}... is not a string of at most {MAX_PATTERN_CHARS} chars")
        try:
            hit = regex.match(rf"(.*\.)?({key})$", module, timeout=PATTERN_TIMEOUT_S)
        except TimeoutError:
            raise ValueError(f"pattern key {key!r} takes more than {PATTERN_TIMEOUT_S} s to match {module!r}") from None
        except regex.error as e:
            raise ValueError(f"pattern key {key!r} is not a regular expression ({e})") from None
        if hit:
            return value
    return default


def _read_config(directory: Path, entry: str) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: no {CONFIG_FILE} in {directory}")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"LORA_ADAPTERS entry {entry!r}: {CONFIG_FILE} holds a {type(config).__name__}, not an object"
        )
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: {name} in {CONFIG_FILE} is not an object")
    refusals = (  # (refused, what): each is read as "<what> is not supported"
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA)"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (bool(config.get("modules_to_save")), "modules_to_save (fully trained layers)"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r})"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D layers)"),
    )
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: {what} is not supported")
    return config


def _read_weights(directory: Path, entry: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
            ):
                raise ConfigError(
                    f"LORA_ADAPTERS entry {entry!r}: {name} holds a {type(loaded).__name__}, "
                    "not a mapping of names to tensors"
                )
            return loaded
    raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: no {' or '.join(WEIGHT_FILES)} in {directory}")


def load_adapter(
    source: AdapterSource,
    index: int,
    model: nn.Module,
    dtype: torch.dtype,
    max_rank: int = DEFAULT_MAX_LORA_RANK,
    keep_bf16: bool = False,
) -> LoraAdapter:
    """Read ``source`` and check every module against ``model`` (the unsharded base model); ranks above
    ``max_rank`` are refused. A and B are cast to ``dtype`` (the model's), except with ``keep_bf16`` (CPU) an
    adapter saved entirely in bf16 for an fp32 model: it stays bf16, half the bytes, the kernels widening each value
    exactly (:func:`.layers.attach_adapters`)."""
    entry = str(source)
    directory = adapter_directory(source)
    config = _read_config(directory, entry)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(directory, entry).items():
        match = _KEY.match(key)
        if match is None:
            raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: weight {key!r} is not a LoRA A/B matrix of a linear")
        pairs.setdefault(match["module"], {})[match["part"]] = tensor
    if not pairs:
        raise ConfigError(f"LORA_ADAPTERS entry {entry!r}: the checkpoint holds no LoRA weights")
    modules = dict(model.named_modules())
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weights: dict[str, LoraModuleWeights] = {}
    for path, parts in sorted(pairs.items()):
        where = f"LORA_ADAPTERS entry {entry!r}, module {path!r}"
        if set(parts) != {"A", "B"}:
            raise ConfigError(f"{where}: has lora_{''.join(parts)} without its pair")
        base = modules.get(path)
        if base is None or not _is_linear(base):
            found = "absent" if base is None else type(base).__name__
            raise ConfigError(f"{where}: the base model has no linear layer there ({found})")
        if ".experts." in f".{path}.":  # called on the tokens routed to the expert only, not on every row
            raise ConfigError(f"{where}: LoRA on MoE experts is not supported")
        if head is not None and base is head:  # it sees only the rows whose logits are kept, not every token
            raise ConfigError(f"{where}: LoRA on the LM head is not supported (only layers inside the model)")
        in_features, out_features = int(cast(int, base.in_features)), int(cast(int, base.out_features))
        a, b = parts["A"], parts["B"]
        rank = int(a.shape[0]) if a.ndim == 2 else 0
        if rank < 1:
            raise ConfigError(f"{where}: lora_A {tuple(a.shape)} has no rank")
        if rank > max_rank:
            raise ConfigError(
                f"{where}: rank {rank} is above TGI_PAGED_MAX_LORA_RANK={max_rank} (every adapter slot is padded "
                "to the highest rank loaded; raise the limit to serve it)"
            )
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
            raise ConfigError(
                f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base layer "
                f"({in_features} -> {out_features}) with rank {rank}"
            )
        try:
            expected_rank = _pattern_value(config.get("rank_pattern") or {}, path, config.get("r", rank))
            alpha = float(_pattern_value(config.get("alpha_pattern") or {}, path, config.get("lora_alpha", rank)))
            expected_rank = int(expected_rank)
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigError(
                f"{where}: bad r / lora_alpha / rank_pattern / alpha_pattern in {CONFIG_FILE}: {e}"
            ) from None
        if not math.isfinite(alpha):
            raise ConfigError(f"{where}: lora_alpha {alpha} is not finite")
        if expected_rank != rank:
            raise ConfigError(f"{where}: rank {rank} in the weights, {expected_rank} in {CONFIG_FILE}")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ConfigError(f"{where}: the weights hold NaN or infinity")
        weights[path] = LoraModuleWeights(a.contiguous(), b.contiguous(), scaling)
    stored = {t.dtype for w in weights.values() for t in (w.a, w.b)}
    if not (keep_bf16 and dtype == torch.float32 and stored == {torch.bfloat16}):
        weights = {path: LoraModuleWeights(w.a.to(dtype), w.b.to(dtype), w.scaling) for path, w in weights.items()}
    return LoraAdapter(source.name, index, directory, weights)


def load_adapters(
    sources: tuple[AdapterSource, ...],
    model: nn.Module,
    dtype: torch.dtype,
    max_rank: int = DEFAULT_MAX_LORA_RANK,
    keep_bf16: bool = False,
) -> tuple[LoraAdapter, ...]:
    """Every adapter of ``LORA_ADAPTERS`` in index order (1, 2, ...) (``keep_bf16``: :func:`load_adapter`'s)."""
    return tuple(load_adapter(source, i + 1, model, dtype, max_rank, keep_bf16) for i, source in enumerate(sources))
