"""Launcher settings that change what the real shard engine does, each read as the stock server reads it.

- ``PREFIX_CACHING``: stock parsing (``1``/``true`` in any case enable it; anything else disables it);
  disabled, the engine advertises no prefix caching *and* retains no prefix blocks.
- ``ROPE_SCALING`` / ``ROPE_FACTOR``: the model config's RoPE scaling is replaced; greedy output is
  token-identical to HF on a ``config.json`` that carries the same scaling (and differs from the
  unscaled model, so the comparison can fail).
- ``WEIGHTS_CACHE_OVERRIDE``: a hub id is served from that directory.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import RouterDriver, make_engine, make_text, prompt_ids, spec
from tests.helpers.tiny_models import write_tiny_model
from tgi_paged_backend.engine import build_engine
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.model_files import with_local_model


@pytest.mark.parametrize(
    ("value", "enabled"),
    [("true", True), ("TRUE", True), ("1", True), ("0", False), ("false", False), ("yes", False), (" true", False)],
)
def test_prefix_caching_decides_retention_as_stock_parses_it(tiny_llama_dir, value, enabled) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=32, PREFIX_CACHING=value)
    assert engine.info().use_prefix_caching is enabled
    driver = RouterDriver(engine)
    text = make_text(3, 30)
    assert len(prompt_ids(engine, text)) > 3 * engine.block_size  # several full prompt blocks
    driver.run(BatchSpec(id=0, requests=(spec(1, text, 4),)))
    assert (engine.kv.num_retained_blocks > 0) is enabled
    hits = engine.stats.prefix_hit_tokens
    driver.run(BatchSpec(id=1, requests=(spec(2, text, 4),)))
    assert (engine.stats.prefix_hit_tokens > hits) is enabled
    assert driver.tokens[2] == driver.tokens[1]
    driver.assert_idle()
    if not enabled:
        assert engine.kv.num_retained_blocks == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rope_scaling_is_token_exact_with_hf_on_the_same_config_change(tmp_path, hf_greedy, kind) -> None:
    plain = write_tiny_model(kind, tmp_path / "plain", seed=3)
    scaled = write_tiny_model(kind, tmp_path / "scaled", seed=3, rope_scaling={"rope_type": "linear", "factor": 4.0})
    engine = make_engine(plain, num_blocks=40, ROPE_SCALING="linear", ROPE_FACTOR="4")
    driver = RouterDriver(engine)
    requests = [spec(rid, make_text(rid, words), 10) for rid, words in ((1, 28), (2, 9))]
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    differs = False
    for r in requests:
        ids = prompt_ids(engine, r.text)
        assert driver.tokens[r.id] == hf_greedy(scaled, ids, 10), f"request {r.id} differs from HF (scaled config)"
        differs |= driver.tokens[r.id] != hf_greedy(plain, ids, 10)
    assert differs, "the scaling changed no token: the test cannot tell scaled from unscaled"
    driver.assert_idle()


def test_weights_cache_override_serves_a_hub_id_from_that_directory(tiny_qwen2_dir, hf_greedy) -> None:
    env = {
        "TGI_PAGED_NUM_BLOCKS": "32",
        "TGI_PAGED_BLOCK_SIZE": "8",
        "TGI_PAGED_SWAP_SPACE_GB": "0.01",
        "WEIGHTS_CACHE_OVERRIDE": str(tiny_qwen2_dir),
    }
    config = with_local_model(build_config({"model_id": "some-org/not-downloaded"}, env))
    assert config.model.model_id == str(tiny_qwen2_dir)
    engine = build_engine(config)
    driver = RouterDriver(engine)
    r = spec(1, make_text(5, 12), 8)
    driver.run(BatchSpec(id=0, requests=(r,)))
    assert driver.tokens[1] == hf_greedy(tiny_qwen2_dir, prompt_ids(engine, r.text), 8)
    driver.assert_idle()


def test_cuda_memory_fraction_caps_the_process_on_cuda_only(monkeypatch) -> None:
    """As stock ``utils/dist.py``: ``torch.cuda.set_per_process_memory_fraction(CUDA_MEMORY_FRACTION, device)``
    (recorded here: this machine has no GPU; a GPU run exercises the real call through ``build_engine``)."""
    import torch

    from tgi_paged_backend.engine import cap_device_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    cap_device_memory(torch.device("cuda:1"), 0.5)
    cap_device_memory(torch.device("cuda:0"), 1.0)  # the launcher's default: no cap
    cap_device_memory(torch.device("cpu"), 0.5)
    assert calls == [(0.5, torch.device("cuda:1"))]


def test_attention_is_ignored_block_size_is_ours(tiny_llama_dir) -> None:
    """The launcher's ``ATTENTION`` picks stock's block size (flashinfer 1, flashdecoding 256); here
    ``TGI_PAGED_BLOCK_SIZE`` does, and Info says so."""
    info = make_engine(tiny_llama_dir, num_blocks=16, block_size=4, ATTENTION="flashdecoding").info()
    assert (info.attention_impl, info.block_size) == ("paged", 4)
