"""Multi-head latent attention (DeepSeek-V2/V3): the latent page geometry and what moves it.

The pool holds one ``[blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` tensor per layer; the value cache is
the view of its first ``kv_lora_rank`` columns. The bytes per token measured from the pool's storages equal the
formula, and copy-on-write, swap and the host tier move each latent entry once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

import tgi_paged_backend.runner.kv_pool as kv_pool_module
from tests.helpers.paged_driver import PagedDriver, greedy_paged
from tests.helpers.static_decode_stand_ins import CountingBackend, fake_cuda_graphs
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.families.mla import PagedLatentAttention
from tgi_paged_backend.runner.model import family_support
from tgi_paged_backend.runner.model_runner import ModelRunner

BLOCK_SIZE = 4
RANK, ROPE, LAYERS = 16, 8, 2  # the tiny configs of tests/helpers/family_models.py


def _runner(model_dir, kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(
        ModelConfig(model_id=str(model_dir)), CacheConfig(block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype)
    )


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (a view of another's storage counted once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("kv_cache_dtype, itemsize", [("auto", 4), ("fp8_e4m3fn", 1)])
@pytest.mark.parametrize("name", ["DeepSeek-V2", "DeepSeek-V3"])
def test_the_pool_holds_one_latent_entry_per_token_and_layer(name, kv_cache_dtype, itemsize, family_dir):
    runner = _runner(family_dir(name), kv_cache_dtype)
    assert sum(isinstance(m, PagedLatentAttention) for m in runner.model.modules()) == LAYERS
    spec = runner.spec
    assert (spec.latent_rank, spec.head_dim, spec.num_kv_heads, spec.v_head_dim) == (RANK, RANK + ROPE, 1, RANK)
    formula = (RANK + ROPE) * LAYERS * itemsize
    assert spec.kv_bytes_per_token(runner.kv_dtype) == formula
    assert runner.block_bytes == BLOCK_SIZE * formula  # what Warmup divides the budget by
    runner.allocate_kv_cache(10)
    for k, v in zip(runner.k_caches, runner.v_caches, strict=True):
        assert k.shape == (10, BLOCK_SIZE, 1, RANK + ROPE) and v.shape == (10, BLOCK_SIZE, 1, RANK)
        assert v.data_ptr() == k.data_ptr() and v.stride() == k.stride()  # a view: the latent's own columns
    measured = _storage_bytes(runner.k_caches + runner.v_caches) / (10 * BLOCK_SIZE)
    assert measured == formula
    runner.allocate_swap_space(3)
    assert _storage_bytes(runner.pool.cpu_k_caches + runner.pool.cpu_v_caches) == 3 * runner.block_bytes
    runner.pool.allocate_host_tier(5)
    assert _storage_bytes(runner.pool.host_k + runner.pool.host_v) == 5 * runner.block_bytes
    assert runner.pool.host_row_shape() == (LAYERS, BLOCK_SIZE, 1, (RANK + ROPE) * itemsize)


def test_block_moves_copy_each_latent_entry_once(family_dir, monkeypatch):
    runner = _runner(family_dir("DeepSeek-V3"))
    runner.allocate_kv_cache(8)
    runner.allocate_swap_space(4)
    runner.pool.allocate_host_tier(4)
    moved: list[list[torch.Tensor]] = []
    real_swap = kv_pool_module.swap_blocks

    def recording_swap(src, dst, src_ids, dst_ids):
        moved.append(list(src))
        real_swap(src, dst, src_ids, dst_ids)

    monkeypatch.setattr(kv_pool_module, "swap_blocks", recording_swap)
    monkeypatch.setattr(kv_pool_module, "copy_blocks", lambda *a: pytest.fail("K and V copied as two tensors"))
    for k in runner.k_caches:
        k[1].copy_(torch.randn(k[1].shape))
    original = [k[1].clone() for k in runner.k_caches]
    runner.copy_blocks([1], [2])  # copy-on-write
    runner.swap_out([1], [0])
    runner.swap_in([0], [3])
    runner.pool.offload([1], [2])
    runner.pool.load([2], [4])
    assert len(moved) == 5
    for tensors in moved:  # every layer's one tensor, no latent twice, no value view
        assert len(tensors) == LAYERS and len({t.data_ptr() for t in tensors}) == LAYERS
        assert all(t.shape[-1] == RANK + ROPE for t in tensors)
    for k, v, before in zip(runner.k_caches, runner.v_caches, original, strict=True):
        for block in (2, 3, 4):
            assert torch.equal(k[block], before)
            assert torch.equal(v[block], before[..., :RANK])


def test_latent_attention_outside_deepseeks_classes_is_refused():
    config = SimpleNamespace(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512)
    reason = family_support.unsupported_reason(config)
    assert reason is not None and "multi-head latent attention outside" in reason
    served = SimpleNamespace(model_type="deepseek_v3", kv_lora_rank=512)
    assert family_support.unsupported_reason(served) is None


def _static_from_first_step(mode: str, **options) -> Callable[[PagedDriver], None]:
    def hook(driver: PagedDriver) -> None:
        if driver.step_index == 0:  # the driver allocated its pool: set up the step over it
            driver.runner.prepare_static_decode(96, mode=mode, buckets=(1, 2, 4), **options)

    return hook


@pytest.mark.parametrize("mode", ["eager", "graphs", "compile"])
def test_the_static_decode_step_gives_the_eager_tokens(mode, family_dir, monkeypatch):
    # The latent attention in the fixed-buffer step (CUDA graphs' and TGI_PAGED_COMPILE's): the padded CPU plan
    # reads the value view; compile traces it whole (fullgraph: a graph break would raise).
    path = family_dir("DeepSeek-V3")
    prompts = [[5 + i for i in range(n)] for n in (5, 17, 9)]
    runner = ModelRunner(ModelConfig(model_id=str(path), cuda_graphs=(1, 2, 4)), CacheConfig(block_size=8), "cpu")
    eager = greedy_paged(runner, prompts, 12, arrival_steps=(0, 2, 3), num_blocks=32)
    options: dict = {}
    if mode == "graphs":
        fake_cuda_graphs(monkeypatch)
    elif mode == "compile":
        torch._dynamo.reset()
        options = {"backend": CountingBackend(), "fixed_width": True}
    hook = _static_from_first_step(mode, **options)
    assert greedy_paged(runner, prompts, 12, arrival_steps=(0, 2, 3), num_blocks=32, hook=hook) == eager
    step = runner.static_decode
    assert step is not None and sum(step.counts.values()) > 0


def test_rope_forms_are_transformers_own_bit_for_bit():
    # [T, H, rope] as the latent attention rotates them, against transformers' functions on [1, H, T, rope].
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    from tgi_paged_backend.runner.families.mla import rotate_complex, rotate_halves, rotate_interleaved

    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 8, generator=generator), torch.randn(5, 1, 8, generator=generator)
    angles = torch.arange(5.0)[:, None] * torch.rand(4, generator=generator)  # [T, rope / 2]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]  # [1, T, rope]

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)[None]

    for ours, theirs in (
        (rotate_interleaved, v3.apply_rotary_pos_emb_interleave),
        (rotate_halves, v3.apply_rotary_pos_emb),
    ):
        want_q, want_k = theirs(heads_first(q), heads_first(k), cos, sin)
        assert torch.equal(ours(q, cos[0, :, None], sin[0, :, None]), want_q[0].transpose(0, 1))
        assert torch.equal(ours(k, cos[0, :, None], sin[0, :, None]), want_k[0].transpose(0, 1))
    freqs = torch.polar(torch.ones_like(angles), angles)[None]  # V2: complex [1, T, rope / 2]
    want_q, want_k = v2.apply_rotary_emb(heads_first(q), heads_first(k), freqs)
    assert torch.equal(rotate_complex(q, freqs[0]), want_q[0].transpose(0, 1))
    assert torch.equal(rotate_complex(k, freqs[0]), want_k[0].transpose(0, 1))
