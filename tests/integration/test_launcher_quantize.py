"""The launcher derives ``--quantize`` from ``quantization_config.quant_method``; the shard's CLI accepts
the values it serves and refuses every other value TGI's launcher can send, naming what is supported.

The served formats then load token-exact (``tests/engine/test_shard_engine_quantized.py``).
"""

from __future__ import annotations

import json

import pytest

from integration.launcher_spawn import QUANTIZATIONS, LauncherOptions, effective_quantize, serve_argv
from tgi_paged_backend.cli import _check_supported
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.runner.quant.methods import SUPPORTED_QUANTIZE


@pytest.mark.parametrize("method", QUANTIZATIONS)
def test_quant_method_becomes_the_flag_and_only_served_ones_pass(tmp_path, method):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": method}})
    )
    quantize = effective_quantize(str(tmp_path), LauncherOptions())
    assert quantize == method
    argv = serve_argv(str(tmp_path), LauncherOptions(), quantize)
    assert argv[argv.index("--quantize") + 1] == method
    config = build_config({"model_id": str(tmp_path), "quantize": quantize}, {})
    if method in SUPPORTED_QUANTIZE:
        _check_supported(config)
    else:
        with pytest.raises(
            ConfigError,
            match=f"--quantize {method} is not supported by tgi-paged-backend: "
            "supported fp8, compressed-tensors, gptq, awq",
        ):
            _check_supported(config)


def test_explicit_flag_wins_over_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    assert effective_quantize(str(tmp_path), LauncherOptions(quantize="fp8")) == "fp8"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert effective_quantize(str(tmp_path), LauncherOptions()) is None
