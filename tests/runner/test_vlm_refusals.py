"""Every vision-language family stock TGI 3.3 serves is refused at start with its own reason
(``family_support.VLM_FAMILIES``) until this backend serves it (issue 40, docs/vlm.md)."""

from __future__ import annotations

import pytest
import transformers

from tests.helpers.family_matrix import start_error
from tests.helpers.vlm_families import VLM_FAMILIES, write_config_only
from tgi_paged_backend.runner.model import family_support

STOCK_VLM_MODEL_TYPES = (
    "llava_next",
    "paligemma",
    "idefics2",
    "idefics3",
    "smolvlm",
    "qwen2_vl",
    "qwen2_5_vl",
    "gemma3",
    "llama4",
    "mllama",
    "idefics",
)
"""``model_type`` of the VLM configs stock TGI's router and server handle (SmolVLM's own type included)."""

PHRASES = {
    "qwen2_vl": "M-RoPE",
    "qwen2_5_vl": "M-RoPE",
    "mllama": "cross-attention",
    "idefics": "cross-attention",
    "paligemma": "prefix-LM",
    "gemma3": "bidirectional attention within each image",
    "llama4": "chunked local attention",
    "idefics2": "perceiver resampler",
    "idefics3": "image splitting",
    "smolvlm": "image splitting",
    "llava_next": "vision tower's embeddings are not merged",
}


def test_every_stock_vlm_has_a_reason() -> None:
    assert set(family_support.VLM_FAMILIES) == set(STOCK_VLM_MODEL_TYPES) == set(PHRASES)


@pytest.mark.parametrize("model_type", STOCK_VLM_MODEL_TYPES)
def test_vlm_config_is_refused_with_its_reason(model_type: str) -> None:
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    reason = family_support.unsupported_reason(transformers.AutoConfig.for_model(model_type))
    assert reason is not None and PHRASES[model_type] in reason, reason


@pytest.mark.parametrize("vlm", [v for v in VLM_FAMILIES if v.model_type in ("llava_next", "qwen2_vl", "mllama")])
def test_vlm_checkpoint_stops_the_start(vlm, tmp_path) -> None:
    error = start_error(write_config_only(vlm, tmp_path))
    assert error is not None and vlm.architecture in error and PHRASES[vlm.model_type] in error, error
    assert "TGI_BACKEND=stock" in error and vlm.phrase in error


def test_text_only_siblings_are_not_vlm_refused() -> None:
    for model_type in ("gemma3_text", "llama4_text", "qwen2"):
        if model_type in transformers.CONFIG_MAPPING:
            reason = family_support.unsupported_reason(transformers.AutoConfig.for_model(model_type))
            assert reason is None or "vision-language" not in reason, (model_type, reason)
