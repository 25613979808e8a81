"""The served VLMs' language models decode through the native CPU layers (fp32), their vision towers do not
take part (``native_layers.wrap_native_layers`` walks ``vlm_loading.text_model`` only): Qwen2-VL's text layers are
Qwen2's once transformers has merged M-RoPE's sections into the rotary tables. Token-exactness with images is
``tests/engine/test_shard_engine_qwen2_vl.py``'s (it runs these layers)."""

from __future__ import annotations

import pytest

from tests.helpers.qwen2_vl_models import write_qwen2_vl_model
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model.vlm_loading import text_model
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_kernels import native_kernels


@pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler: no native layers")
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_text_layers_are_native_and_the_tower_is_not_a_candidate(tmp_path, model_type) -> None:
    path = write_qwen2_vl_model(tmp_path / model_type, model_type)
    runner = ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=4), "cpu")
    report = runner.rewrites.get("native")
    layers = runner.model.config.get_text_config().num_hidden_layers
    assert report.wrapped == layers and report.kept == ()
    assert text_model(runner.model) is runner.model.model.language_model


@pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler: no native layers")
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_text_layers_decode_as_one_stack(tmp_path, model_type) -> None:
    """Every text layer takes the same M-RoPE tables: Warmup proves the stack (one call per decode step)."""
    path = write_qwen2_vl_model(tmp_path / model_type, model_type)
    runner = ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=4), "cpu")
    runner.allocate_kv_cache(8)
    runner.warm_decode()
    (stack,) = runner.native_layers.stacks
    assert stack.enabled, stack.kept
