"""``model_files``: which directory a model is served from, as stock's ``utils/hub.py::weight_files`` decides."""

from __future__ import annotations

from pathlib import Path

import pytest

from tgi_paged_backend.config import ConfigError, ModelConfig
from tgi_paged_backend.model_files import local_model_dir


def model_dir(path: Path, *, weights: bool = True, config: bool = True) -> Path:
    path.mkdir(parents=True)
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    if config:
        (path / "config.json").write_text("{}")
    return path


def test_a_local_directory_wins_even_over_a_broken_override(tmp_path: Path) -> None:
    local = model_dir(tmp_path / "local")
    got = local_model_dir(ModelConfig(model_id=str(local), weights_cache_override=str(tmp_path / "missing")))
    assert got == str(local)


def test_a_hub_id_is_served_from_the_override(tmp_path: Path) -> None:
    override = model_dir(tmp_path / "repository")
    assert local_model_dir(ModelConfig(model_id="org/model", weights_cache_override=str(override))) == str(override)


@pytest.mark.parametrize(
    ("weights", "config", "why"),
    [(None, None, "not a directory"), (False, True, "no *.safetensors"), (True, False, "no config.json")],
)
def test_an_unusable_override_names_the_variable_and_the_value(tmp_path: Path, weights, config, why) -> None:
    override = tmp_path / "repository"
    if weights is not None:
        model_dir(override, weights=weights, config=config)
    with pytest.raises(ConfigError) as err:
        local_model_dir(ModelConfig(model_id="org/model", weights_cache_override=str(override)))
    message = str(err.value)
    assert f"WEIGHTS_CACHE_OVERRIDE={str(override)!r} is invalid" in message and why in message
    assert "allowed an existing directory with org/model's *.safetensors and config.json" in message


def test_a_downloaded_hub_id_is_served_from_the_hub_cache(tmp_path: Path, monkeypatch) -> None:
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--model"
    snapshot = model_dir(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert Path(local_model_dir(ModelConfig(model_id="org/model"))) == snapshot
    assert local_model_dir(ModelConfig(model_id="org/other")) == "org/other"  # the loader reports it
