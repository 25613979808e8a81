"""Tensor parallelism over quantized weights: the fp8 weight is quantized whole, then sliced.

- unit: column slices keep their rows' bytes and scales, row slices keep every row's full scale, and
  the ranks' outputs (row-parallel: summed as the all-reduce would) equal the unsharded ``Fp8Linear``
  in fp32 up to summation order (1e-6);
- two gloo ranks (``tests/distributed/tp_worker.py --quantize``) decode greedily token-identical to HF
  on the dequantized weights, for load-time fp8 (Llama, Qwen2 with biases) and a compressed-tensors
  checkpoint, each rank holding about half the quantized layer bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from tests.helpers.paged_driver import greedy_hf
from tests.helpers.quant_models import dequantized_reference, write_compressed_fp8
from tests.helpers.tp_spawn import run_tp_workers
from tests.helpers.tiny_models import EOS_ID, PAD_ID
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.quant.linear import Fp8Linear
from tgi_paged_backend.runner.tensor_parallel import RowParallelFp8Linear

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
        result = run_tp_workers(models, prompts, MAX_NEW, tmp_path / f"{quantize}.json",
                                extra_args=["--quantize", quantize])
        results.update({(quantize, m): r for m, r in zip(models, result.values())})

    for (quantize, model), got in results.items():
        src = llama if model == ct else model
        assert got["tokens"] == greedy_hf(dequantized_reference(src), prompts, MAX_NEW, [EOS_ID], PAD_ID), model
        single = ModelRunner(ModelConfig(model_id=str(model), quantize=quantize), CacheConfig(block_size=8), "cpu")
        fp8_bytes = sum(m.qweight.numel() for m in single.model.modules() if isinstance(m, Fp8Linear))
        for _, _, _, weights in got["sizes"]:  # one row per rank: each holds half the fp8 weight bytes (and
            assert single.weights_bytes - weights >= fp8_bytes // 2  # half the column scales); the rest is replicated
