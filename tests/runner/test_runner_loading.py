"""Model loading, attention registration and the runner's memory helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers.tiny_models import EOS_ID
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.attention import ATTENTION_NAME, register_attention
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.memory_budget import CPU_KV_BUDGET_CAP_BYTES
from tgi_paged_backend.runner.model.loader import ModelLoadError, eos_token_ids, load_model, resolve_dtype
from tgi_paged_backend.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def llama_runner(tiny_llama_dir: Path) -> ModelRunner:
    return ModelRunner(ModelConfig(model_id=str(tiny_llama_dir)), CacheConfig(block_size=8), "cpu")


# ------------------------------------------------------------------------------- loading
def test_load_model_uses_paged_attention_in_eval_mode(tiny_mistral_dir: Path) -> None:
    loaded = load_model(ModelConfig(model_id=str(tiny_mistral_dir)), "cpu")
    assert loaded.model.config._attn_implementation == ATTENTION_NAME
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.dtype is torch.float32 and next(loaded.model.parameters()).dtype is torch.float32
    assert loaded.eos_token_ids == (EOS_ID,)
    assert loaded.tokenizer("hello world").input_ids[0] == loaded.tokenizer.bos_token_id


def test_load_model_dtype_from_config(tiny_qwen2_dir: Path) -> None:
    loaded = load_model(ModelConfig(model_id=str(tiny_qwen2_dir), dtype="bfloat16"), "cpu")
    assert next(loaded.model.parameters()).dtype is torch.bfloat16


def test_resolve_dtype_defaults() -> None:
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert resolve_dtype(None, torch.device("cuda", 0)) is torch.float16
    with pytest.raises(ModelLoadError, match="dtype='float8'"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.mark.parametrize("field, value, message", [("quantize", "awq", "--quantize awq")])
def test_unsupported_options_are_rejected(tiny_llama_dir: Path, field: str, value, message: str) -> None:
    config = ModelConfig(model_id=str(tiny_llama_dir), **{field: value})
    with pytest.raises(ModelLoadError, match=message):
        load_model(config, "cpu")


def test_mlp_speculator_checkpoint_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    model = shutil.copytree(tiny_llama_dir, tmp_path / "speculator")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "mlp_speculator"}))
    with pytest.raises(ModelLoadError, match="is an MLP speculator checkpoint.*--speculate N"):
        load_model(ModelConfig(model_id=str(model), speculate=2), "cpu")


def test_non_local_model_id_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a local directory"):
        load_model(ModelConfig(model_id="HuggingFaceTB/SmolLM2-135M-Instruct"), "cpu")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(ModelConfig(model_id=str(tmp_path)), "cpu")


def test_eos_ids_list_from_generation_config_wins() -> None:
    tokenizer = type("Tok", (), {"eos_token_id": 7})()
    assert eos_token_ids(transformers.GenerationConfig(eos_token_id=[2, 9]), tokenizer) == (2, 9)
    assert eos_token_ids(transformers.GenerationConfig(eos_token_id=2), tokenizer) == (7,)
    assert eos_token_ids(transformers.GenerationConfig(eos_token_id=2), object()) == (2,)


def test_eos_list_written_in_generation_config(tiny_model_factory, tmp_path: Path) -> None:
    path = tiny_model_factory("llama", seed=3)
    gen = json.loads((path / "generation_config.json").read_text())
    target = tmp_path / "model"
    target.mkdir()
    for file in path.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    (target / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [EOS_ID, 11]}))
    assert load_model(ModelConfig(model_id=str(target)), "cpu").eos_token_ids == (EOS_ID, 11)


def test_registration_is_idempotent_and_metadata_is_required(llama_runner: ModelRunner) -> None:
    assert register_attention() == register_attention() == ATTENTION_NAME
    with pytest.raises(RuntimeError, match="tgi_paged_metadata"):
        with torch.no_grad():
            llama_runner.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


# ------------------------------------------------------------------------- pool & memory
def test_allocate_pool_and_swap_space(llama_runner: ModelRunner) -> None:
    spec = llama_runner.spec
    llama_runner.allocate_kv_cache(10)
    llama_runner.allocate_swap_space(4)
    assert len(llama_runner.k_caches) == len(llama_runner.v_caches) == spec.num_layers == 3
    assert llama_runner.k_caches[0].shape == (10, 8, spec.num_kv_heads, spec.head_dim)
    assert llama_runner.pool.cpu_v_caches[2].shape == (4, 8, spec.num_kv_heads, spec.head_dim)
    assert (llama_runner.num_blocks, llama_runner.num_cpu_blocks) == (10, 4)
    assert llama_runner.block_bytes == spec.kv_bytes_per_block(8, torch.float32)
    with pytest.raises(ValueError):
        llama_runner.allocate_kv_cache(0)


def test_copy_and_swap_move_exact_block_contents(llama_runner: ModelRunner) -> None:
    llama_runner.allocate_kv_cache(8)
    llama_runner.allocate_swap_space(6)
    for cache in llama_runner.k_caches + llama_runner.v_caches:
        cache.copy_(torch.randn_like(cache))
    before = [c.clone() for c in llama_runner.k_caches + llama_runner.v_caches]
    llama_runner.copy_blocks([1, 2], [5, 6])
    llama_runner.swap_out([3, 4], [0, 5])
    for cache in llama_runner.k_caches + llama_runner.v_caches:
        cache[[3, 4]] = 0
    llama_runner.swap_in([5, 0], [0, 7])  # block 4 -> 0, block 3 -> 7
    for old, new in zip(before, llama_runner.k_caches + llama_runner.v_caches, strict=True):
        assert torch.equal(new[[5, 6]], old[[1, 2]])
        assert torch.equal(new[0], old[4]) and torch.equal(new[7], old[3])
    llama_runner.copy_blocks([], [])  # no-op
    with pytest.raises(ValueError):
        llama_runner.copy_blocks([1], [2, 3])


def test_fp8_kv_pool_runs_and_stays_close(tiny_llama_dir: Path, llama_runner: ModelRunner) -> None:
    fp8 = ModelRunner(
        ModelConfig(model_id=str(tiny_llama_dir)), CacheConfig(block_size=8, kv_cache_dtype="fp8_e4m3fn"), "cpu"
    )
    assert fp8.kv_dtype is torch.float8_e4m3fn
    assert fp8.block_bytes * 4 == llama_runner.block_bytes
    batch = build_forward_batch([RequestChunk(list(range(4, 30)), 0, [3, 1, 6, 0])], 8)
    fp8.allocate_kv_cache(8)
    llama_runner.allocate_kv_cache(8)
    got, want = fp8.forward(batch), llama_runner.forward(batch)
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


def test_forward_needs_a_pool(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(model_id=str(tiny_llama_dir)), CacheConfig(block_size=8), "cpu")
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        runner.forward(build_forward_batch([RequestChunk([1, 2], 0, [0])], 8))
    with pytest.raises(RuntimeError, match="allocate_swap_space"):
        runner.allocate_kv_cache(2)
        runner.swap_out([0], [0])


def test_profile_and_budget_on_cpu(llama_runner: ModelRunner) -> None:
    small, large = llama_runner.profile_prefill(64), llama_runner.profile_prefill(1024)
    assert 0 < small < large
    assert llama_runner.activation_peak_bytes == large
    assert llama_runner.profile_prefill(1024, num_logits=1024) > large
    budget = llama_runner.available_kv_bytes(0.9)
    assert 0 < budget <= CPU_KV_BUDGET_CAP_BYTES
    assert llama_runner.available_kv_bytes(0.9, activation_bytes=10**15) == 0
    with pytest.raises(ValueError):
        llama_runner.available_kv_bytes(0.0)


def test_copy_bandwidth_is_positive(llama_runner: ModelRunner) -> None:
    assert llama_runner.measure_copy_bandwidth(num_bytes=1 << 20) > 1e6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_budget_and_swap(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(model_id=str(tiny_llama_dir)), CacheConfig(block_size=16), "cuda")
    peak = runner.profile_prefill(2048)
    assert peak > 0
    budget = runner.available_kv_bytes(0.9)
    assert budget > 0
    runner.allocate_kv_cache(64)
    runner.allocate_swap_space(8)
    assert runner.pool.cpu_k_caches[0].is_pinned()
    runner.k_caches[0][3].normal_()
    runner.swap_out([3], [5])
    runner.swap_in([5], [9])
    assert torch.equal(runner.k_caches[0][9], runner.k_caches[0][3])
    assert runner.measure_copy_bandwidth() > 1e8
