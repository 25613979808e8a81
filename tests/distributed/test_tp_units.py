"""Tensor-parallel pieces that need no process group: the timeout knob, the divisibility check, the
row-parallel layer, the failure rule, the per-step consistency check and the reporting rank."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tgi_paged_backend.config import CacheConfig, ConfigError, ModelConfig, ServerConfig
from tgi_paged_backend.engine.tp_engine import SyncedRateCalibrator, TensorParallelShardEngine
from tgi_paged_backend.engine.types import CachedBatchInfo, StepResult
from tgi_paged_backend.envs import build_config, read_env
from tgi_paged_backend.runner.model.loader import ModelLoadError, load_model
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.parallel import process_group as distributed
from tgi_paged_backend.runner.parallel.process_group import PeerLostError, RankMismatchError, TensorParallelGroup
from tgi_paged_backend.runner.parallel.row_parallel import RowParallelLinear
from tgi_paged_backend.runner.parallel.slicing import check_divisible, shard_model
from tgi_paged_backend.runner.parallel.tp_runner import TensorParallelRunner


class FakeGroup:
    """What the runner needs from a group before any collective runs."""

    def __init__(self, rank: int = 0, world_size: int = 2) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_dist_timeout_knob() -> None:
    assert read_env({}).dist_timeout_s == 30.0
    cfg = build_config({"model_id": "/m"}, {"TGI_PAGED_DIST_TIMEOUT_S": "7.5", "WORLD_SIZE": "2", "RANK": "1"})
    assert cfg.server.dist_timeout_s == 7.5 and cfg.server.world_size == 2
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ConfigError) as err:
            read_env({"TGI_PAGED_DIST_TIMEOUT_S": bad})
        assert "TGI_PAGED_DIST_TIMEOUT_S" in str(err.value) and "(0, 86400]" in str(err.value)
    with pytest.raises(ConfigError, match="dist_timeout_s"):
        ServerConfig(dist_timeout_s=0)


def _spec(q: int, kv: int, inter: int = 128) -> ModelSpec:
    return ModelSpec(
        model_type="llama",
        num_layers=2,
        num_q_heads=q,
        num_kv_heads=kv,
        head_dim=16,
        hidden_size=64,
        intermediate_size=inter,
        vocab_size=512,
        max_position_embeddings=512,
        sliding_window=None,
        softcap=0.0,
        dtype=torch.float32,
    )


def test_head_counts_must_divide_by_the_number_of_shards() -> None:
    check_divisible(_spec(4, 2), 2)
    with pytest.raises(ModelLoadError) as err:
        check_divisible(_spec(6, 3, 96), 2)
    message = str(err.value)
    assert "num_key_value_heads=3" in message and "not divisible by 2" in message and "--num-shard" in message
    assert "num_attention_heads" not in message and "intermediate_size" not in message


def test_runner_refuses_a_model_whose_kv_heads_do_not_split(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match="num_key_value_heads=3 not divisible by 2"):
        TensorParallelRunner(ModelConfig(model_id=str(model)), CacheConfig(block_size=8), "cpu", FakeGroup())


def test_phi3_fused_projections_are_sliced_per_part(tiny_model_factory: Callable[..., Path]) -> None:
    """Each rank's fused qkv holds its q, k and v heads; the attention splits it with local head counts
    (its own config copy) while the model's config keeps the full ones. Token-exactness at TP=2:
    test_tp_families.py."""
    loaded = load_model(ModelConfig(model_id=str(tiny_model_factory("phi3"))), "cpu")
    spec = ModelSpec.from_hf_config(loaded.model.config, loaded.dtype)
    shard_model(loaded.model, spec, 0, 2, lambda t: t)
    attn, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
    q_local, kv_local = spec.num_q_heads // 2, spec.num_kv_heads // 2
    assert attn.qkv_proj.out_features == (q_local + 2 * kv_local) * spec.head_dim
    assert attn.config.num_attention_heads == q_local and loaded.model.config.num_attention_heads == spec.num_q_heads
    assert mlp.gate_up_proj.out_features == spec.intermediate_size  # half of gate and half of up


def test_row_parallel_linear_sums_partials_then_adds_the_bias_once() -> None:
    torch.manual_seed(0)
    full = nn.Linear(8, 3, bias=True)
    x = torch.randn(5, 8)
    partial_1 = (x[:, 4:] @ full.weight[:, 4:].T).detach()  # what rank 1 contributes to the all-reduce
    rank0 = RowParallelLinear(full, 0, 2, lambda t: t.add_(partial_1))
    assert rank0.local.weight.shape == (3, 4)
    with torch.no_grad():
        torch.testing.assert_close(rank0(x[:, :4]), full(x))


def test_sharded_layers_sum_to_the_full_model(tiny_model_factory: Callable[..., Path]) -> None:
    """Both ranks' shards of a decoder layer's MLP (and o_proj) reproduce the full layer."""
    path = str(tiny_model_factory("qwen2"))
    full = load_model(ModelConfig(model_id=path), "cpu").model
    shards = [load_model(ModelConfig(model_id=path), "cpu").model for _ in range(2)]
    spec = ModelSpec.from_hf_config(full.config, torch.float32)
    layouts = [shard_model(m, spec, r, 2, lambda t: t) for r, m in enumerate(shards)]
    assert [(lay.num_q_heads, lay.num_kv_heads, lay.intermediate_size) for lay in layouts] == [(2, 1, 64)] * 2
    x = torch.randn(3, spec.hidden_size)
    layer = [m.model.layers[0] for m in shards]
    with torch.no_grad():
        torch.testing.assert_close(layer[0].mlp(x) + layer[1].mlp(x), full.model.layers[0].mlp(x))
        q = torch.cat([lay.self_attn.q_proj(x) for lay in layer], dim=-1)
        torch.testing.assert_close(q, full.model.layers[0].self_attn.q_proj(x))  # biases sliced with the rows
        heads = torch.randn(3, spec.num_q_heads * spec.head_dim)
        half = heads.shape[-1] // 2
        o_proj = [lay.self_attn.o_proj for lay in layer]
        bias = o_proj[0].bias if o_proj[0].bias is not None else 0
        total = o_proj[0](heads[:, :half]) + o_proj[1](heads[:, half:]) - bias
        torch.testing.assert_close(total, full.model.layers[0].self_attn.o_proj(heads))


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(distributed, "SHUTDOWN_GRACE_S", 0.05)
    exits: list[int] = []
    path = tmp_path / "s-0"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    g = TensorParallelGroup(
        rank=0,
        world_size=2,
        device=torch.device("cpu"),
        backend="gloo",
        timeout_s=3,
        store=None,
        control_group=None,
        heartbeat_group=None,
        socket_path=str(path),
        exit_fn=exits.append,
    )
    yield g, exits, path
    sock.close()
    distributed._shutting_down.clear()


def test_a_failed_collective_exits_with_a_clear_error(group) -> None:
    g, exits, path = group
    with pytest.raises(PeerLostError):  # only reached because the test's exit_fn returns
        g.fail("the heartbeat", RuntimeError("Connection closed by peer"))
    assert exits == [1] and not path.exists()


def test_peers_leaving_during_shutdown_is_not_a_crash(group) -> None:
    g, exits, path = group
    distributed.mark_shutting_down()
    with pytest.raises(PeerLostError, match="shutting down"):
        g.fail("the forward's all-reduce", RuntimeError("Connection reset by peer"))
    assert exits == [] and path.exists()


def test_a_peer_leaving_just_before_this_rank_closes_is_not_a_crash(group, monkeypatch: pytest.MonkeyPatch) -> None:
    g, exits, path = group
    monkeypatch.setattr(distributed, "SHUTDOWN_GRACE_S", 10.0)
    closer = threading.Timer(0.1, g.close)  # e.g. the peer closed its groups first: our heartbeat failed
    closer.start()
    start = time.monotonic()
    try:
        with pytest.raises(PeerLostError, match="shutting down"):
            g.fail("the heartbeat", RuntimeError("Connection closed by peer"))
    finally:
        closer.join()
    assert exits == [] and path.exists() and time.monotonic() - start < 5
    g.close()  # idempotent


def test_calibrator_folds_in_the_agreed_measurement() -> None:
    seen = []
    calibrator = SyncedRateCalibrator(lambda s: seen.append(s) or 2.0)
    before = calibrator.prefill_tokens_per_s
    calibrator.observe_prefill(1000, 0.001)
    assert seen == [0.001]
    assert calibrator.prefill_tokens_per_s == pytest.approx(before + 0.2 * (500 - before))


def _engine(rank: int, gathered: list[list[int]]) -> TensorParallelShardEngine:
    engine = object.__new__(TensorParallelShardEngine)
    failures: list[str] = []

    def fail(what: str, err: str) -> None:
        failures.append(err)

    engine.group = SimpleNamespace(rank=rank, all_gather_ints=lambda values, what: gathered, fail=fail)
    engine.num_steps = 0
    engine.state_digest = lambda: 5
    engine.failures = failures
    return engine


def test_step_check_fails_the_call_when_ranks_run_different_batches() -> None:
    with pytest.raises(RankMismatchError, match="different order"):
        _engine(0, [[1, 5], [2, 5]])._check_step([1, 2])


def test_step_check_treats_state_divergence_as_fatal() -> None:
    engine = _engine(0, [[1, 5], [1, 6]])
    engine._check_step([1, 2])
    assert engine.failures and "diverged" in engine.failures[0] and engine.num_steps == 1
    agree = _engine(0, [[1, 5], [1, 5]])
    agree._check_step([1, 2])
    assert agree.failures == []


def test_only_rank_0_reports_generations() -> None:
    result = StepResult(
        generations=[object()], batch=CachedBatchInfo(id=1, request_ids=[7], max_tokens=8, current_tokens=1)
    )  # type: ignore[list-item]
    assert _engine(0, [])._reported(result) is result
    other = _engine(1, [])._reported(result)
    assert other.generations == [] and other.batch == result.batch


def _digest_of(last_token: int = 7, blocks: tuple[int, ...] = (3, 4)) -> int:
    from tgi_paged_backend.engine.request_state import RequestStatus
    from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager

    engine = object.__new__(TensorParallelShardEngine)
    engine.kv = KVCacheManager(num_blocks=16, block_size=8)
    engine.kv.add_request(2**64 - 1, blocks)  # the liveness id does not fit int64: digests must not care
    engine.kv.allocate(2**64 - 1, 12)
    engine.requests = {
        2**64 - 1: SimpleNamespace(
            status=RequestStatus.RUNNING, num_computed=12, output_ids=[5, last_token], num_preemptions=0
        )
    }
    engine.batches = {0: [2**64 - 1]}
    return engine.state_digest()


def test_state_digest_is_reproducible_and_follows_tokens() -> None:
    assert _digest_of() == _digest_of()
    assert _digest_of(last_token=8) != _digest_of()


def test_fused_projections_give_each_rank_its_share_of_every_part() -> None:
    """Phi-3's qkv (q 8 rows, k 4, v 4) at TP=2: rank 1 gets q rows 4-7, k rows 10-11, v rows 14-15 -- not the
    contiguous second half of the fused matrix, which would be all k and v."""
    import torch
    from torch import nn

    from tgi_paged_backend.runner.parallel.fused_parts import fused_row_slices, shard_fused_linear

    assert fused_row_slices((8, 4, 4), 1, 2, "qkv") == [slice(4, 8), slice(10, 12), slice(14, 16)]
    fused = nn.Linear(3, 16, bias=True)
    with torch.no_grad():
        fused.weight.copy_(torch.arange(16.0)[:, None].expand(16, 3))
        fused.bias.copy_(torch.arange(16.0))
    local = shard_fused_linear(fused, (8, 4, 4), 1, 2, "qkv")
    assert local.weight[:, 0].tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert local.bias.tolist() == [4, 5, 6, 7, 10, 11, 14, 15]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_block_shards_sum_to_the_full_block(model_type: str) -> None:
    """Two ranks' shards of a MoE block (experts' intermediate split, router replicated, shared expert split,
    one all-reduce) sum to the full block's output; a wrong split (rank 0 given rank 1's down columns) does
    not, so the check can fail."""
    import copy

    import transformers

    from tgi_paged_backend.runner.parallel import slicing as tp

    config = transformers.AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=48, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    block = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp.float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        full = block(x)
        shards = [tp._shard_moe(copy.deepcopy(block), rank, 2, lambda t: t, "mlp") for rank in range(2)]
        torch.testing.assert_close(shards[0](x) + shards[1](x), full, rtol=1e-5, atol=1e-5)
        wrong = copy.deepcopy(shards[0])
        wrong.block.experts.down_proj.copy_(shards[1].block.experts.down_proj)  # experts' columns swapped
        assert not torch.allclose(wrong(x) + shards[1](x), full, rtol=1e-3, atol=1e-3)


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_that_read_them() -> None:
    """8 query heads over 2 KV heads at TP=4: ranks 0-1 read KV head 0 and ranks 2-3 KV head 1 (GQA groups of 4
    query heads); one KV head at TP=2 (multi-query) is on both ranks; 3 KV heads at TP=2 do not split."""
    from dataclasses import replace

    from tgi_paged_backend.runner.parallel.slicing import _kv_rows, check_divisible

    base = ModelSpec.from_hf_config(
        SimpleNamespace(
            model_type="llama", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
            intermediate_size=128, vocab_size=32, max_position_embeddings=64,
        ),
        torch.float32,
    )  # fmt: skip
    assert [_kv_rows(base, r, 4) for r in range(4)] == [slice(0, 8), slice(0, 8), slice(8, 16), slice(8, 16)]
    check_divisible(base, 4)
    mqa = replace(base, num_kv_heads=1)
    assert [_kv_rows(mqa, r, 2) for r in range(2)] == [slice(0, 8), slice(0, 8)]
    with pytest.raises(ModelLoadError, match="num_key_value_heads=3"):
        check_divisible(replace(base, num_kv_heads=3, num_q_heads=6), 2)
