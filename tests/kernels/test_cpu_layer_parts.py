"""A tensor-parallel rank's native decode layer (``tgi_paged_kernels.cpu_layer_step.decode_layer_parts``): a layer
cut into two ranks' slices as ``runner/parallel/slicing.py`` cuts it (query and KV heads, MLP columns; o and down
by their input columns, their biases whole), each rank run in its own thread with an all-reduce that sums the two
ranks' partial sums, must give the whole layer's output (``cpu_layer_ref.decode_layer_ref``) on both ranks and
write each rank's KV heads to its pools."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from tests.kernels.test_cpu_layer import FORMS, _layer, _step
from tests.kernels.test_cpu_layer_bf16 import BF16_ULP
from tgi_paged_kernels.cpu_layer import LayerWeights
from tgi_paged_kernels.cpu_layer_ref import decode_layer_ref
from tgi_paged_kernels.cpu_layer_step import LayerStep, decode_layer_parts

RANKS = 2


class ThreadAllReduce:
    """Sums one tensor per rank (each rank a thread) in place, as ``torch.distributed.all_reduce`` does; counts
    the calls."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks)
        self.parts: list[torch.Tensor | None] = [None] * ranks
        self.calls = [0] * ranks

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = self.parts[0]
            for part in self.parts[1:]:
                total = total + part  # type: ignore[operator]
            self.barrier.wait()  # every rank read every part before any overwrites its own next time
            t.copy_(total)  # type: ignore[arg-type]
            self.calls[rank] += 1
            return t

        return all_reduce


def _shard(raw: dict, hq: int, hkv: int, d: int, inter: int, gated: bool, rank: int) -> dict:
    """Rank ``rank``'s slices of ``raw`` (one KV head is replicated on both ranks)."""
    q = slice(rank * hq // RANKS * d, (rank + 1) * hq // RANKS * d)
    kv_heads = slice(rank * hkv // RANKS * d, (rank + 1) * hkv // RANKS * d) if hkv >= RANKS else slice(0, d)
    rows = torch.cat([torch.arange(hq * d)[q], (hq * d + torch.arange(hkv * d))[kv_heads],
                      ((hq + hkv) * d + torch.arange(hkv * d))[kv_heads]])  # fmt: skip
    cols = slice(rank * inter // RANKS, (rank + 1) * inter // RANKS)
    up_rows = (
        torch.cat([torch.arange(inter)[cols], inter + torch.arange(inter)[cols]])
        if gated
        else torch.arange(inter)[cols]
    )
    out = dict(raw)
    out.update(qkv=raw["qkv"][rows], o=raw["o"][:, q])
    out.update(qkv_bias=None if raw["qkv_bias"] is None else raw["qkv_bias"][rows])
    out.update(gate_up_bias=raw["gate_up_bias"][up_rows])
    if raw["router"] is None:
        out.update(gate_up=raw["gate_up"][up_rows], down=raw["down"][:, cols])
        return out
    # MoE (slicing.py's _shard_moe): every expert's intermediate split, the router replicated; the shared expert's
    # intermediate split the same way, its sigmoid gate replicated
    out.update(gate_up=raw["gate_up"][:, up_rows], down=raw["down"][:, :, cols])
    if raw["shared_gate_up"] is not None:
        width = raw["shared_down"].shape[1]
        shared = slice(rank * width // RANKS, (rank + 1) * width // RANKS)
        shared_rows = torch.cat([torch.arange(width)[shared], width + torch.arange(width)[shared]])
        out.update(shared_gate_up=raw["shared_gate_up"][shared_rows], shared_down=raw["shared_down"][:, shared])
    return out


@pytest.mark.parametrize(
    "form_name",
    ["Llama", "Mistral+Qwen2", "Qwen3", "Gemma2", "Gemma3", "Granite", "Cohere", "Phi", "GPT-NeoX", "GPT-BigCode",
     "OPT post-LN", "Falcon", "Mixtral", "Qwen2-MoE"],
)  # fmt: skip
def test_two_ranks_give_the_whole_layer(native, form_name) -> None:
    _check_two_ranks(native, form_name, torch.float32)


@pytest.mark.parametrize("form_name", ["Llama", "Gemma3", "Phi", "Mixtral", "Qwen2-MoE"])
def test_two_bf16_ranks_give_the_whole_bf16_layer(native, form_name) -> None:
    """A bf16 model's rank: bf16 weights, hidden state and pools; the partial sums and the residual stream between
    the stages stay fp32 (widened once, rounded once), so each rank's output is the whole bf16 layer's to one bf16
    rounding (sequential, sandwich norms, a parallel block)."""
    _check_two_ranks(native, form_name, torch.bfloat16)


def _check_two_ranks(native, form_name: str, dtype: torch.dtype) -> None:  # noqa: ANN001
    hq, hkv, d, form = FORMS[form_name]
    hidden, inter, block_size = 96, 160, 4
    raw, packed = _layer(hq, hkv, d, hidden, inter, form)
    bf16 = dtype == torch.bfloat16
    if bf16:  # the projections rounded to bf16 (a bf16 model's), packed in bf16
        projections = ("qkv", "o", "gate_up", "down", "router", "shared_gate_up", "shared_down", "shared_gate")
        raw = {n: t.bfloat16().float() if n in projections and t is not None else t for n, t in raw.items()}
        packed = LayerWeights.pack(form, raw, num_q_heads=hq, num_kv_heads=hkv, head_dim=d).as_bf16()
    lengths = [1, 5, 17, 40, 3]
    (k_pool, v_pool), tables, seq_lens, slots = _step(lengths, block_size, hkv, d, torch.int64)
    k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(lengths), hidden, generator=g).to(dtype)
    r = form.rotary_dim or d
    cos, sin = (torch.randn(len(lengths), r, generator=g).to(dtype) for _ in range(2))
    if form.rope == "none":
        cos = sin = None
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    rounds = bf16 and native.gemm_bf16_rounds_activations
    expected = decode_layer_ref(
        raw, packed, x, cos, sin, ref_k, ref_v, slots, tables, seq_lens, rounds_activations=rounds
    )
    tol = dict(rtol=BF16_ULP, atol=1e-4) if bf16 else dict(rtol=1e-4, atol=1e-4)

    local_kv = hkv // RANKS if hkv >= RANKS else 1
    heads = [slice(rank * local_kv, (rank + 1) * local_kv) if hkv >= RANKS else slice(0, 1) for rank in range(RANKS)]
    pools = [(k_pool[:, :, h].clone(), v_pool[:, :, h].clone()) for h in heads]
    reduce = ThreadAllReduce(RANKS)
    outputs: list[torch.Tensor | None] = [None] * RANKS
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            shard = _shard(raw, hq, hkv, d, inter, form.gated, rank)
            w = LayerWeights.pack(form, shard, num_q_heads=hq // RANKS, num_kv_heads=local_kv, head_dim=d)
            w = w.as_bf16() if bf16 else w
            outputs[rank] = decode_layer_parts(
                native, w, x, cos, sin, *pools[rank], slots, tables, seq_lens, reduce.for_rank(rank)
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert reduce.calls == [1 if form.parallel else 2] * RANKS  # a parallel block: one all-reduce for both blocks
    for rank in range(RANKS):
        got = outputs[rank]
        assert got is not None and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), **tol)
        torch.testing.assert_close(pools[rank][0].float(), ref_k[:, :, heads[rank]].float(), **tol)
        torch.testing.assert_close(pools[rank][1].float(), ref_v[:, :, heads[rank]].float(), **tol)


def test_a_parallel_block_with_an_moe_mlp_gets_none_before_any_all_reduce(native) -> None:
    hq, hkv, d, form = FORMS["Mixtral"]
    form = dataclasses.replace(form, parallel=True, mlp_in_norm=False)  # no family has one: the parts refuse it
    raw, _ = _layer(hq, hkv, d, 64, 96, form)
    packed = LayerWeights.pack(form, raw, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    (k_pool, v_pool), tables, seq_lens, slots = _step([3, 9], 4, hkv, d, torch.int32)
    x, cs = torch.randn(2, 64), torch.rand(2, d)

    def refuse(t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no all-reduce for a form the parts do not run")

    assert decode_layer_parts(native, packed, x, cs, cs, k_pool, v_pool, slots, tables, seq_lens, refuse) is None


def test_a_stage_the_library_does_not_know_is_refused(native) -> None:
    hq, hkv, d, form = FORMS["Cohere"]  # parallel: no stage 2
    _, packed = _layer(hq, hkv, d, 64, 96, form)
    (k_pool, v_pool), tables, seq_lens, slots = _step([3, 9], 4, hkv, d, torch.int32)
    x, cs = torch.randn(2, 64), torch.rand(2, d)
    step = LayerStep.prepare(native, packed, x, cs, cs, k_pool, v_pool, slots, tables, seq_lens)
    assert step is not None
    partial = torch.zeros(2, 64)
    for stage, buffer in ((2, partial), (4, partial), (1, None)):
        with pytest.raises(ValueError, match="status 6"):
            step.run(stage, buffer)
