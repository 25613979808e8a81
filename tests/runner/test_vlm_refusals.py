"""Every vision-language family stock TGI 3.3 serves is refused at start with its own reason
(``family_support.VLM_FAMILIES``) until this backend serves it (issue 40, docs/vlm.md); LLaVA-NeXT,
Idefics2/3, SmolVLM, Qwen2-VL, Qwen2.5-VL, Gemma 3 and PaliGemma are served
(``vlm_loading.SERVED_VLM_MODEL_TYPES``), except checkpoints outside their image-token rule."""

from __future__ import annotations

import pytest
import transformers

from tests.helpers.family_matrix import start_error
from tests.helpers.llava_next_models import write_llava_next_model
from tests.helpers.vlm_families import VLM_FAMILIES, write_config_only
from tgi_paged_backend.runner.model import family_support, vlm_loading

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
    "mllama": "cross-attention",
    "idefics": "cross-attention",
    "llama4": "chunked local attention",
}


def test_every_stock_vlm_has_a_reason() -> None:
    assert set(family_support.VLM_FAMILIES) == set(PHRASES)
    assert set(PHRASES) | vlm_loading.SERVED_VLM_MODEL_TYPES == set(STOCK_VLM_MODEL_TYPES)
    assert not set(PHRASES) & vlm_loading.SERVED_VLM_MODEL_TYPES


def test_served_vlm_is_judged_by_its_language_model() -> None:
    config = transformers.AutoConfig.for_model("llava_next")
    assert family_support.unsupported_reason(config) is None
    config.text_config.layer_types = ["full_attention", "linear_attention"]  # what the language model needs decides
    assert "layer types ['linear_attention'] are not served" in (family_support.unsupported_reason(config) or "")


@pytest.mark.parametrize(
    ("options", "phrase"),
    [(dict(crop=48), "crop size (48) differs from the vision tower's image_size (32)"),
     (dict(strategy="full"), "vision_feature_select_strategy='full' is not served")],
)  # fmt: skip
def test_llava_next_outside_the_token_rule_is_refused(tmp_path, options, phrase) -> None:
    error = start_error(write_llava_next_model(tmp_path / "llava", **options))
    assert error is not None and "LlavaNextForConditionalGeneration" in error and phrase in error, error


def test_idefics3_with_tiles_other_than_the_tower_input_is_refused(tmp_path) -> None:
    import json

    from tests.helpers.idefics_models import write_idefics_model

    path = write_idefics_model(tmp_path / "idefics3")
    file = path / vlm_loading.PREPROCESSOR_CONFIG
    file.write_text(json.dumps({**json.loads(file.read_text()), "max_image_size": {"longest_edge": 48}}))
    error = start_error(path)
    assert error is not None and "tile edge (max_image_size 48) differs" in error, error


def test_served_qwen2_vl_is_judged_by_its_language_model() -> None:
    for model_type in ("qwen2_vl", "qwen2_5_vl"):
        assert family_support.unsupported_reason(transformers.AutoConfig.for_model(model_type)) is None


def test_llava_next_without_image_processor_is_refused(tmp_path) -> None:
    path = write_llava_next_model(tmp_path / "llava")
    (path / vlm_loading.PREPROCESSOR_CONFIG).unlink()
    error = start_error(path)
    assert error is not None and "no preprocessor_config.json" in error, error


@pytest.mark.parametrize("model_type", sorted(PHRASES))
def test_vlm_config_is_refused_with_its_reason(model_type: str) -> None:
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    reason = family_support.unsupported_reason(transformers.AutoConfig.for_model(model_type))
    assert reason is not None and PHRASES[model_type] in reason, reason


@pytest.mark.parametrize("vlm", [v for v in VLM_FAMILIES if v.model_type in ("llama4", "mllama")])
def test_vlm_checkpoint_stops_the_start(vlm, tmp_path) -> None:
    error = start_error(write_config_only(vlm, tmp_path))
    assert error is not None and vlm.architecture in error and PHRASES[vlm.model_type] in error, error
    assert "TGI_BACKEND=stock" in error and vlm.phrase in error


def test_text_only_siblings_are_not_vlm_refused() -> None:
    for model_type in ("gemma3_text", "llama4_text", "qwen2"):
        if model_type in transformers.CONFIG_MAPPING:
            reason = family_support.unsupported_reason(transformers.AutoConfig.for_model(model_type))
            assert reason is None or "vision-language" not in reason, (model_type, reason)


def test_gemma3_with_pan_and_scan_is_refused(tmp_path) -> None:
    """Pan-and-scan crops add an image sequence per crop: outside stock's count (256 per image)."""
    import json

    from tests.helpers.gemma_vlm_models import write_gemma_vlm_model

    path = write_gemma_vlm_model(tmp_path / "gemma3", "gemma3")
    config = json.loads((path / vlm_loading.PREPROCESSOR_CONFIG).read_text())
    (path / vlm_loading.PREPROCESSOR_CONFIG).write_text(json.dumps({**config, "do_pan_and_scan": True}))
    error = start_error(path)
    assert error is not None and "do_pan_and_scan" in error, error
