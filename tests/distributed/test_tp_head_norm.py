"""OLMo2's q/k norms over all heads on a head shard (``runner/parallel/head_norm.py``): two simulated ranks (threads
whose all-reduce sums their tensors in rank order) reproduce the full-width norm, also with a replicated KV head
and in bf16; the slicing gives a rank its slice of the weight; a TP rank fuses the attention around the shard and
keeps the per-op decode step. Token-exactness at TP=2 over gloo: ``test_tp_families.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.family_models import FAMILY_BY_NAME, write_family_model
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu.fused_blocks import FusedPagedAttention
from tgi_paged_backend.runner.model.loader import ModelLoadError, load_model
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.parallel.head_norm import AllHeadsNormShard, shard_all_heads_norm
from tgi_paged_backend.runner.parallel.slicing import shard_model
from tgi_paged_backend.runner.parallel.tp_runner import TensorParallelRunner


class ThreadAllReduce:
    """An all-reduce between ``world_size`` threads: every rank gets the sum of all ranks' tensors, added in
    rank order (so every rank gets the same bits, as a real all-reduce gives)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.parts: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.calls = [0] * world_size

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for r in range(1, self.world_size):
                total += self.parts[r]
            self.barrier.wait()  # every rank has read the parts before the next call overwrites them
            return tensor.copy_(total)

        return all_reduce


def run_ranks(world_size: int, step: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """``step(rank)`` on ``world_size`` threads at once (inference mode: it is per thread); their results in rank
    order."""

    def in_inference_mode(rank: int) -> torch.Tensor:
        with torch.inference_mode():
            return step(rank)

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(in_inference_mode, range(world_size)))


def olmo2_norm(width: int, seed: int = 0) -> nn.Module:
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    norm = Olmo2RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return norm


def _shards(norm: nn.Module, rows: list[slice], reduce: ThreadAllReduce) -> list[AllHeadsNormShard]:
    n = len(rows)
    return [shard_all_heads_norm(norm, rows[r], n, reduce.for_rank(r), "test.q_norm") for r in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_ranks_reproduce_the_norm_over_all_heads(dtype: torch.dtype) -> None:
    norm = olmo2_norm(64).to(dtype)  # 4 heads of 16, 2 per rank
    x = (3.0 * torch.randn(5, 64, generator=torch.Generator().manual_seed(1))).to(dtype)
    reduce = ThreadAllReduce(2)
    shards = _shards(norm, [slice(0, 32), slice(32, 64)], reduce)
    assert [tuple(s.weight.shape) for s in shards] == [(32,), (32,)]
    got = run_ranks(2, lambda r: shards[r](x[:, 32 * r : 32 * (r + 1)]))
    with torch.inference_mode():
        want = norm(x)
    torch.testing.assert_close(torch.cat(got, dim=-1), want)
    assert reduce.calls == [1, 1]  # one all-reduce per call, of the [tokens, 1] sum of squares
    # The statistic of a rank's own heads alone is not the norm: the all-reduce matters.
    local = AllHeadsNormShard(norm.weight[:32], 1e-6, 1, lambda t: t)
    with torch.inference_mode():
        assert not torch.allclose(local(x[:, :32]), want[:, :32], rtol=1e-2, atol=1e-2)


def test_a_replicated_kv_head_counts_once() -> None:
    """Fewer KV heads than ranks: 2 KV heads over 4 ranks, each head held by 2 ranks; every rank's output is its
    head's part of the full norm (the sum over ranks counts each head twice, the width it divides by too)."""
    norm = olmo2_norm(32, seed=2)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    heads = [slice(0, 16), slice(0, 16), slice(16, 32), slice(16, 32)]
    shards = _shards(norm, heads, ThreadAllReduce(4))
    got = run_ranks(4, lambda r: shards[r](x[:, heads[r]]))
    with torch.inference_mode():
        want = norm(x)
    for r, rows in enumerate(heads):
        torch.testing.assert_close(got[r], want[:, rows])


def test_leading_dims_and_a_single_head_per_rank() -> None:
    """The fused attention calls the norm on ``[T, heads * d]`` or, with one local head, ``[T, 1, d]``."""
    norm = olmo2_norm(32, seed=4)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(5))
    shards = _shards(norm, [slice(0, 16), slice(16, 32)], ThreadAllReduce(2))
    got = run_ranks(2, lambda r: shards[r](x[:, 16 * r : 16 * (r + 1)].reshape(6, 1, 16)))
    with torch.inference_mode():
        torch.testing.assert_close(torch.cat(got, dim=-1).reshape(6, 32), norm(x))


class OnePlusRMSNorm(nn.Module):
    """An all-heads norm of another form (Gemma's ``1 + w``): the slicing must refuse, not serve it wrong."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def test_an_all_heads_norm_of_another_form_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"q_norm normalizes across all heads with a OnePlusRMSNorm"):
        shard_all_heads_norm(OnePlusRMSNorm(64), slice(0, 32), 2, lambda t: t, "layer 0.self_attn.q_norm")
    with pytest.raises(ModelLoadError, match="not an RMSNorm"):
        shard_all_heads_norm(nn.LayerNorm(64), slice(0, 32), 2, lambda t: t, "layer 0.self_attn.q_norm")


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family_model(FAMILY_BY_NAME["OLMo2"], tmp_path_factory.mktemp("olmo2"))


def test_olmo2_shards_give_the_full_normed_queries_and_keys(olmo2_dir: Path) -> None:
    """The slicing's q/k norms on both ranks, after their q/k projections, give the full model's."""
    full = load_model(ModelConfig(model_id=str(olmo2_dir)), "cpu").model
    shards = [load_model(ModelConfig(model_id=str(olmo2_dir)), "cpu").model for _ in range(2)]
    spec = ModelSpec.from_hf_config(full.config, torch.float32)
    reduce = ThreadAllReduce(2)
    for rank, model in enumerate(shards):
        shard_model(model, spec, rank, 2, reduce.for_rank(rank))
    attn = [m.model.layers[1].self_attn for m in shards]
    assert all(isinstance(a.q_norm, AllHeadsNormShard) and isinstance(a.k_norm, AllHeadsNormShard) for a in attn)
    assert [tuple(a.q_norm.weight.shape) for a in attn] == [(32,), (32,)]  # 2 of 4 query heads of 16
    assert [tuple(a.k_norm.weight.shape) for a in attn] == [(16,), (16,)]  # 1 of 2 KV heads
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(6))
    got = run_ranks(2, lambda r: torch.cat([attn[r].q_norm(attn[r].q_proj(x)), attn[r].k_norm(attn[r].k_proj(x))], -1))
    ref = full.model.layers[1].self_attn
    with torch.inference_mode():
        q, k = ref.q_norm(ref.q_proj(x)), ref.k_norm(ref.k_proj(x))
    torch.testing.assert_close(torch.cat([got[0][:, :32], got[1][:, :32]], -1), q)
    torch.testing.assert_close(torch.cat([got[0][:, 32:], got[1][:, 32:]], -1), k)


class FakeGroup:
    """A rank of two that never meets its peer (its all-reduce is the identity): enough to see what the load-time
    rewrites make of a shard."""

    rank, world_size = 0, 2

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        return [list(values)] * self.world_size


def test_a_tp_rank_fuses_the_attention_around_the_shard_and_decodes_per_op(olmo2_dir: Path) -> None:
    """The fused attention calls the shard's norm (its all-reduce included); the native decode layer, which runs no
    all-reduce inside a q/k norm, is not taken (the shard is not an RMSNorm it reads), and the fast-layer swap leaves
    the shards alone (only Olmo2RMSNorms become FusedRMSNorms)."""
    runner = TensorParallelRunner(ModelConfig(model_id=str(olmo2_dir)), CacheConfig(block_size=8), "cpu", FakeGroup())
    layers = runner.model.model.layers
    assert runner.rewrites.get("fuse").attentions == 2
    assert runner.native_layers is not None and runner.native_layers.wrapped == 0
    assert any("q_norm: AllHeadsNormShard" in line for line in runner.native_layers.kept), runner.native_layers.kept
    for layer in layers:
        attn = layer.self_attn
        assert isinstance(attn, FusedPagedAttention) and attn.qk_norm_over_heads
        assert isinstance(attn.q_norm, AllHeadsNormShard) and isinstance(attn.k_norm, AllHeadsNormShard)
