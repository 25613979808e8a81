"""Start-up refusal of what the paged path does not serve (``runner/model/family_support.py``): the
kinds refused from the config alone (encoder-decoder, multimodal, state-space layers), and the
generic probe that refuses attention code bypassing transformers' attention interface even
without a per-family reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from tests.helpers.family_matrix import start_error
from tests.helpers.family_models import FAMILY_BY_NAME, write_family_model
from tgi_paged_backend.runner.families import falcon
from tgi_paged_backend.runner.model import family_support, loader


def _config_only_dir(tmp_path: Path, config: transformers.PretrainedConfig) -> Path:
    """A model directory the loader accepts up to the config check (the weights are a stand-in)."""
    config.architectures = config.architectures or [f"{type(config).__name__.removesuffix('Config')}Model"]
    config.save_pretrained(tmp_path)
    safetensors.torch.save_file({"stand_in": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    "model_type, phrase",
    [
        ("t5", "encoder-decoder"),
        ("llava", "multimodal"),
        ("mamba", "state-space"),
        ("jamba", "state-space"),
        ("falcon_h1", "state-space"),
    ],
)
def test_unserved_kinds_are_refused_from_the_config(model_type, phrase, tmp_path):
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = transformers.AutoConfig.for_model(model_type)
    error = start_error(_config_only_dir(tmp_path, config))
    assert error is not None and phrase in error and repr(model_type) in error, error


@pytest.mark.parametrize(
    "name, phrase",
    [("Bloom", "no layer called the paged attention"), ("Falcon", "bypasses transformers' attention interface")],
)
def test_generic_checks_catch_attention_that_bypasses_the_interface(name, phrase, tmp_path, monkeypatch):
    # Without the per-family reasons, the loader still refuses: Bloom without its ALiBi modules swapped in runs
    # its own attention (the probe forward sees no call: served as is it gives wrong tokens), Falcon has no
    # class for our name (when it is not given its own attention module, runner/families/falcon.py).
    monkeypatch.setattr(family_support, "unsupported_reason", lambda config: None)
    monkeypatch.setattr(loader, "install_alibi_attention", lambda model: 0)
    monkeypatch.setattr(falcon, "MODEL_TYPE", "not-falcon")
    error = start_error(write_family_model(FAMILY_BY_NAME[name], tmp_path))
    assert error is not None and phrase in error, error


def test_attention_call_check():
    assert family_support.check_attention_calls(3, [0, 1, 2]) is None
    assert "no layer" in family_support.check_attention_calls(3, [])
    assert "layers [0, 2]" in family_support.check_attention_calls(3, [0, 2])  # e.g. Jamba's mamba layers
    assert "layers [0, 0, 1]" in family_support.check_attention_calls(2, [0, 1, 0])  # shared KV
