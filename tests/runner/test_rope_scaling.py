"""``apply_rope_scaling``: the model config's RoPE scaling replaced as stock's ``_get_rope_config`` replaces it."""

from __future__ import annotations

from types import SimpleNamespace

import transformers

from tests.helpers.tiny_models import tiny_config
from tgi_paged_backend.runner.model.rope_scaling import apply_rope_scaling


def test_replaces_the_whole_scaling_and_keeps_the_base_rope() -> None:
    config = tiny_config(
        "llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    before = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert before["rope_type"] == "llama3" and "low_freq_factor" in before
    assert apply_rope_scaling(config, "dynamic", 2.0)
    params = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert params["rope_type"] == "dynamic" and params["factor"] == 2.0
    assert "low_freq_factor" not in params  # stock drops the model's own scaling entirely
    theta = params["rope_theta"] if "rope_theta" in params else config.rope_theta
    assert theta == 10000.0
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.model.rotary_emb.rope_type == "dynamic"


def test_transformers_4_layout() -> None:
    """4.x keeps ``rope_theta`` on the config and the scaling in ``rope_scaling``."""
    config = SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    assert apply_rope_scaling(config, "linear", 2.0)
    assert config.rope_scaling == {"rope_type": "linear", "type": "linear", "factor": 2.0}
    assert config.rope_theta == 10000.0


def test_per_layer_type_parameters_are_each_scaled() -> None:
    config = SimpleNamespace(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    assert apply_rope_scaling(config, "linear", 4.0)
    assert config.rope_parameters == {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
    }


def test_a_model_without_rope_is_left_alone() -> None:
    config = SimpleNamespace(n_positions=1024)  # GPT-2 style: learned positions, stock ignores the variables
    assert not apply_rope_scaling(config, "linear", 2.0)
    assert vars(config) == {"n_positions": 1024}
