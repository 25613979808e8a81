"""Tensor parallelism over quantized weights: the weight is quantized (or decoded) whole, then sliced.

- unit: column slices keep their rows' bytes and scales, row slices keep every row's full scale, and
  the ranks' outputs (row-parallel: summed as the all-reduce would) equal the unsharded ``Fp8Linear``
  in fp32 up to summation order (1e-6);
- two gloo ranks (``tests/distributed/tp_worker.py --quantize``) decode greedily token-identical to HF
  on the dequantized weights, for load-time fp8 (Llama, Qwen2 with biases) and a compressed-tensors
  checkpoint, each rank holding about half the quantized layer bytes;
- int (``IntLinear``): column slices keep their rows' codes, scales and zeros; row slices on group
  boundaries keep only their own groups, act-order ``g_idx`` slices keep the groups their columns use,
  and the summed partial outputs equal the unsharded layer; two gloo ranks decode token-identical to HF
  on the dequantized weights for GPTQ act-order int4, AWQ (``--quantize gptq`` serves it, as TGI) and a
  compressed-tensors int8 checkpoint, each rank holding about half the code bytes;
- fused projections (issue 26): a quantized fused linear cut into several row runs (a rank's share of q, k
  and v) computes exactly those columns of the unsharded output; load-time fp8 at two gloo ranks is
  token-identical to HF on the dequantized weights for the fused layouts (Phi-3's qkv_proj and gate_up_proj,
  GPT-NeoX's query_key_value, GPT-BigCode's c_attn with its one replicated KV head, Falcon's query_key_value
  (FalconLinear) multi-query and Falcon-RW's per head with ALiBi, Bloom's per-head query_key_value, MPT's Wqkv).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.family_models import FAMILIES, write_family_model
from tests.helpers.int_checkpoints import int_reference, write_int_checkpoint
from tests.helpers.paged_driver import greedy_hf
from tests.helpers.quant_models import dequantized_reference, write_compressed_fp8
from tests.helpers.tiny_models import EOS_ID, PAD_ID
from tests.helpers.tp_spawn import run_tp_workers
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.parallel.fused_parts import take_rows
from tgi_paged_backend.runner.parallel.row_parallel import RowParallelFp8Linear, RowParallelQuantLinear
from tgi_paged_backend.runner.quant.linear import Fp8Linear, IntLinear
from tgi_paged_kernels.int_gemm import pack_codes

MAX_NEW = 12


def test_fp8_slices_reassemble_the_unsharded_layer() -> None:
    torch.manual_seed(0)
    full = Fp8Linear.from_linear(nn.Linear(8, 6, bias=True))
    x = torch.randn(5, 8)
    halves = [full.output_slice(slice(0, 3)), full.output_slice(slice(3, 6))]
    assert torch.equal(torch.cat([h.qweight.view(torch.uint8) for h in halves]), full.qweight.view(torch.uint8))
    assert torch.equal(torch.cat([h.weight_scale for h in halves]), full.weight_scale)
    torch.testing.assert_close(torch.cat([h(x) for h in halves], dim=1), full(x), rtol=1e-6, atol=1e-6)

    partial_1 = full.input_slice(slice(4, 8))(x[:, 4:]).detach()  # what rank 1 contributes
    rank0 = RowParallelFp8Linear(full, 0, 2, lambda t: t.add_(partial_1))
    assert rank0.local.qweight.shape == (6, 4) and torch.equal(rank0.local.weight_scale, full.weight_scale)
    torch.testing.assert_close(rank0(x[:, :4]), full(x), rtol=1e-6, atol=1e-6)  # fp32, two partial sums


def test_two_rank_runner_matches_the_dequantized_model(tiny_model_factory, tmp_path: Path) -> None:
    llama, qwen2 = tiny_model_factory("llama"), tiny_model_factory("qwen2")
    ct = write_compressed_fp8(llama, tmp_path / "ct", "channel")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 320, n).tolist() for n in (5, 17, 33)]
    results = {}
    for quantize, models in (("fp8", [llama, qwen2]), ("compressed-tensors", [ct])):
        result = run_tp_workers(
            models, prompts, MAX_NEW, tmp_path / f"{quantize}.json", extra_args=["--quantize", quantize]
        )
        results.update({(quantize, m): r for m, r in zip(models, result.values())})

    for (quantize, model), got in results.items():
        src = llama if model == ct else model
        assert got["tokens"] == greedy_hf(dequantized_reference(src), prompts, MAX_NEW, [EOS_ID], PAD_ID), model
        single = ModelRunner(ModelConfig(model_id=str(model), quantize=quantize), CacheConfig(block_size=8), "cpu")
        fp8_bytes = sum(m.qweight.numel() for m in single.model.modules() if isinstance(m, Fp8Linear))
        for _, _, _, weights in got["sizes"]:  # one row per rank: each holds half the fp8 weight bytes (and
            assert single.weights_bytes - weights >= fp8_bytes // 2  # half the column scales); the rest is replicated


def _int_linear(g_idx: torch.Tensor, groups: int, bits: int = 4) -> IntLinear:
    gen = torch.Generator().manual_seed(3)
    n, k = 6, g_idx.numel()
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen).to(torch.uint8)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(torch.uint8)
    return IntLinear(
        pack_codes(codes, bits), torch.rand(n, groups, generator=gen), zeros, g_idx, bits, torch.randn(n, generator=gen)
    )


def test_int_slices_reassemble_the_unsharded_layer() -> None:
    x = torch.randn(5, 16)
    full = _int_linear((torch.arange(16) // 4).to(torch.int32), 4)  # groups of 4
    halves = [full.output_slice(slice(0, 3)), full.output_slice(slice(3, 6))]
    assert torch.equal(torch.cat([h.codes() for h in halves]), full.codes())
    assert torch.equal(torch.cat([h.zeros for h in halves]), full.zeros)
    torch.testing.assert_close(torch.cat([h(x) for h in halves], dim=1), full(x), rtol=1e-6, atol=1e-6)

    right = full.input_slice(slice(8, 16))  # groups 2 and 3 only, rebased to 0 and 1
    assert torch.equal(right.scales, full.scales[:, 2:]) and right.g_idx.tolist() == [0] * 4 + [1] * 4
    rank0 = RowParallelQuantLinear(full, 0, 2, lambda t: t.add_(right(x[:, 8:]).detach()))
    assert rank0.local.scales.shape == (6, 2) and torch.equal(rank0.local.codes(), full.codes()[:, :8])
    torch.testing.assert_close(rank0(x[:, :8]), full(x), rtol=1e-6, atol=1e-6)

    act_order = (torch.arange(16) // 4)[torch.randperm(16, generator=torch.Generator().manual_seed(1))]
    full = _int_linear(act_order.to(torch.int32), 4)
    left, right = full.input_slice(slice(0, 8)), full.input_slice(slice(8, 16))
    for part, cols in ((left, slice(0, 8)), (right, slice(8, 16))):
        assert torch.equal(part.dequantized_weight(torch.float32), full.dequantized_weight(torch.float32)[:, cols])
    torch.testing.assert_close(left(x[:, :8]) + right(x[:, 8:]) + full.bias, full(x), rtol=1e-5, atol=1e-5)  # no bias
    with pytest.raises(ValueError, match="even column"):
        full.input_slice(slice(0, 7))


def test_two_rank_runner_matches_the_dequantized_int_models(tiny_model_factory, tmp_path: Path) -> None:
    llama, qwen2 = tiny_model_factory("llama"), tiny_model_factory("qwen2")
    ckpts = {
        "gptq": [
            write_int_checkpoint(llama, tmp_path / "gptq", "gptq", bits=4, group_size=16, desc_act=True),
            write_int_checkpoint(qwen2, tmp_path / "awq", "awq", group_size=32),
        ],
        "compressed-tensors": [
            write_int_checkpoint(qwen2, tmp_path / "ct", "pack-quantized", bits=8, group_size=32, sym=False)
        ],
    }
    sources = {tmp_path / "gptq": llama, tmp_path / "awq": qwen2, tmp_path / "ct": qwen2}
    rng = np.random.default_rng(8)
    prompts = [rng.integers(4, 320, n).tolist() for n in (6, 21)]
    for quantize, models in ckpts.items():
        result = run_tp_workers(
            [c.path for c in models],
            prompts,
            MAX_NEW,
            tmp_path / f"{quantize}.json",
            extra_args=["--quantize", quantize],
        )
        for ckpt, got in zip(models, result.values()):
            reference = int_reference(sources[ckpt.path], ckpt)
            assert got["tokens"] == greedy_hf(reference, prompts, MAX_NEW, [EOS_ID], PAD_ID), ckpt.path
            single = ModelRunner(
                ModelConfig(model_id=str(ckpt.path), quantize=quantize), CacheConfig(block_size=8), "cpu"
            )
            code_bytes = sum(m.qweight.numel() for m in single.model.modules() if isinstance(m, IntLinear))
            for _, _, _, weights in got["sizes"]:
                assert single.weights_bytes - weights >= code_bytes // 2


def test_quantized_fused_rows_are_the_unsharded_columns() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    runs = [slice(0, 2), slice(6, 7), slice(9, 11)]  # a rank's q rows, then its k and v rows
    columns = torch.cat([torch.arange(r.start, r.stop) for r in runs])
    fp8 = Fp8Linear.from_linear(nn.Linear(16, 12, bias=True))
    int4 = _int_linear((torch.arange(16) // 4).to(torch.int32), 4)
    int4 = int4.output_rows([slice(0, 6), slice(0, 6)])  # 12 outputs (rows repeat: any run order works)
    for full in (fp8, int4):
        part = take_rows(full, runs, "qkv")
        assert type(part) is type(full) and part.out_features == 5 and part.in_features == 16
        torch.testing.assert_close(part(x), full(x)[:, columns], rtol=1e-6, atol=1e-6)


def test_two_rank_fp8_fused_projections_match_the_dequantized_model(tmp_path: Path) -> None:
    names = ("Phi3", "GPT-NeoX", "GPT-BigCode", "Falcon-7B", "Falcon-RW", "Bloom", "MPT")
    families = {f.name: f for f in FAMILIES if f.name in names}
    models = [write_family_model(families[name], tmp_path / name) for name in sorted(families)]
    prompts = [np.random.default_rng(9).integers(4, 320, n).tolist() for n in (6, 19)]
    result = run_tp_workers(models, prompts, MAX_NEW, tmp_path / "fused.json", extra_args=["--quantize", "fp8"])
    for model, got in zip(models, result.values()):
        assert got["tokens"] == greedy_hf(dequantized_reference(model), prompts, MAX_NEW, [EOS_ID], PAD_ID), model
