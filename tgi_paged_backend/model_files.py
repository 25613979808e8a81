"""Where a model's files are on local disk, found the way the stock server finds its weights.

Stock (``utils/hub.py::weight_files``): a ``model_id`` that is a local directory is used as is and
``WEIGHTS_CACHE_OVERRIDE`` is not consulted; for a hub id the weights are read from
``WEIGHTS_CACHE_OVERRIDE`` when it is set (``File ... not found in ...`` otherwise), else from the hub
cache that ``download-weights`` filled. The loader here reads config, tokenizer and weights from one
directory, so with the override that directory must hold all three (as an Inference Endpoints
``/repository`` does); stock would take config and tokenizer from the hub cache instead.

Nothing here reads the environment: the override comes from ``ModelConfig`` (``envs.py``) and the hub
cache location is huggingface_hub's own (``HF_HOME`` / ``HUGGINGFACE_HUB_CACHE``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tgi_paged_backend.config import BackendConfig, ConfigError, ModelConfig


def with_local_model(config: BackendConfig) -> BackendConfig:
    """``config`` with ``model.model_id`` replaced by :func:`local_model_dir` (``serve`` does this once), and
    a Medusa checkpoint resolved to its base model (:func:`resolve_medusa`)."""
    model = dataclasses.replace(config.model, model_id=local_model_dir(config.model))
    model = resolve_medusa(model)
    return config if model == config.model else dataclasses.replace(config, model=model)


def resolve_medusa(model: ModelConfig) -> ModelConfig:
    """When ``model.model_id`` is a Medusa checkpoint, serve its base model with its heads, as stock does:
    ``model_id`` becomes the base model's directory, ``medusa_dir`` the checkpoint, and ``speculate`` the
    head count unless ``--speculate`` asked for fewer (more is refused).

    Raises:
        ConfigError: the checkpoint is malformed, ``--speculate`` exceeds its heads, or its base model is
            not on local disk.
    """
    from tgi_paged_backend.runner.model.medusa import MedusaLoadError, read_medusa_config

    path = Path(model.model_id)
    try:
        medusa = read_medusa_config(path) if path.is_dir() else None
    except MedusaLoadError as err:
        raise ConfigError(str(err)) from None
    if medusa is None:
        return model
    if model.speculate is not None and model.speculate > medusa.num_heads:
        raise ConfigError(
            f"--speculate={model.speculate} is invalid for {path}: the Medusa checkpoint has "
            f"{medusa.num_heads} heads; allowed 0..{medusa.num_heads}"
        )
    base = local_model_dir(
        dataclasses.replace(model, model_id=medusa.base_model, revision=None, weights_cache_override=None)
    )
    if not Path(base).is_dir():
        raise ConfigError(
            f"{path} is a Medusa checkpoint of base model {medusa.base_model!r}, which is not on local disk: "
            "download it first (text-generation-server download-weights) or set base_model_name_or_path in "
            "its config.json to a local directory"
        )
    speculate = medusa.num_heads if model.speculate is None else model.speculate
    return dataclasses.replace(model, model_id=base, medusa_dir=str(path), speculate=speculate)


def local_model_dir(model: ModelConfig) -> str:
    """The directory to load ``model.model_id`` from.

    A hub id that is neither overridden nor in the hub cache comes back unchanged, so the loader's
    "not a local directory; run download-weights first" error reports it.

    Raises:
        ConfigError: ``WEIGHTS_CACHE_OVERRIDE`` is set for a hub id but is not a directory holding
            ``*.safetensors`` and ``config.json``.
    """
    path = Path(model.model_id).expanduser()
    if path.is_dir():
        return str(path)
    if model.weights_cache_override is not None:
        return str(override_dir(model.weights_cache_override, model.model_id))
    cached = _hub_cache_snapshot(model.model_id, model.revision)
    return model.model_id if cached is None else cached


def override_dir(raw: str, model_id: str) -> Path:
    """``WEIGHTS_CACHE_OVERRIDE`` checked for serving ``model_id`` from it."""
    override = Path(raw).expanduser()
    allowed = f"an existing directory with {model_id}'s *.safetensors and config.json"
    if not override.is_dir():
        raise ConfigError(f"WEIGHTS_CACHE_OVERRIDE={raw!r} is invalid: not a directory; allowed {allowed}")
    if not any(override.glob("*.safetensors")):
        raise ConfigError(f"WEIGHTS_CACHE_OVERRIDE={raw!r} is invalid: no *.safetensors in it; allowed {allowed}")
    if not (override / "config.json").is_file():
        raise ConfigError(
            f"WEIGHTS_CACHE_OVERRIDE={raw!r} is invalid: no config.json in it (this backend reads "
            f"config, tokenizer and weights from that one directory); allowed {allowed}"
        )
    return override


def _hub_cache_snapshot(model_id: str, revision: str | None) -> str | None:
    """The hub cache's snapshot folder of ``model_id`` at ``revision``, without any network access."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=model_id, revision=revision, local_files_only=True)
    except (OSError, ValueError):  # LocalEntryNotFoundError (not cached), HFValidationError (not a repo id)
        return None
