"""Int8 checkpoints of one group per output channel (GPTQ ``group_size -1``, compressed-tensors ``channel``), and fp8
weights of one scale per channel (``--quantize fp8``), decode through the native layer with the weights dequantized
inside the GEMM's tile (``tgi_paged_kernels.cpu_quant``).

The oracle is the per-op int8 path (``TGI_PAGED_NATIVE_LAYERS=0``: ``IntLinear`` dequantizes each weight to
``(code - zero) * scale`` in fp32 and runs ``F.linear``), within its own semantics: the same weight values, the
GEMMs summed in another order. Compared: the greedy tokens of both runners through the paged pools (equal, and equal
to HF ``generate`` on the dequantized model), one decode step's logits (within 1e-4), and the native runner's
resident weight bytes (one copy of the codes, fewer bytes than the fp32 model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.int_checkpoints import int_reference, write_int_checkpoint
from tests.helpers.paged_driver import greedy_hf, greedy_paged
from tests.helpers.tiny_models import EOS_ID, PAD_ID
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer, NativeInt8Linear
from tgi_paged_backend.runner.quant.linear import IntLinear
from tgi_paged_kernels.cpu_native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")

CASES = {"gptq": ("gptq", dict(bits=8, group_size=-1, sym=True)),
         "compressed-tensors": ("pack-quantized", dict(bits=8, group_size=-1, sym=False))}  # fmt: skip


def _runner(path, quantize: str, native: bool) -> ModelRunner:
    return ModelRunner(
        ModelConfig(model_id=str(path), quantize=quantize, native_layers=native), CacheConfig(block_size=4)
    )


@pytest.mark.parametrize("flag", sorted(CASES))
def test_int8_layers_decode_natively_with_the_per_op_paths_tokens(tiny_model_factory, tmp_path, flag) -> None:
    fmt, options = CASES[flag]
    src = tiny_model_factory("qwen2")  # biased q/k/v: int8 projections with their fp32 biases
    ckpt = write_int_checkpoint(src, tmp_path / flag, fmt, **options)
    native, per_op = _runner(ckpt.path, flag, True), _runner(ckpt.path, flag, False)
    layers = [m for m in native.model.modules() if isinstance(m, NativeDecoderLayer)]
    assert len(layers) == 2 and all(m.weights.int8_columns is not None for m in layers)
    assert len([m for m in native.model.modules() if isinstance(m, NativeInt8Linear)]) == 8  # qkv, o, gate_up, down
    assert not any(isinstance(m, NativeDecoderLayer) for m in per_op.model.modules())
    # one copy of the codes: no IntLinear left beside the packed ones; bytes within the column vectors' difference
    assert not any(isinstance(m, IntLinear) for m in native.model.modules())
    assert abs(native.weights_bytes - per_op.weights_bytes) < 0.02 * per_op.weights_bytes

    prompts = [np.random.default_rng(3).integers(4, 320, n).tolist() for n in (6, 17, 30)]
    tokens = greedy_paged(native, prompts, 10)
    assert tokens == greedy_paged(per_op, prompts, 10)
    assert tokens == greedy_hf(int_reference(src, ckpt), prompts, 10, [EOS_ID], PAD_ID)
    assert sum(m.native_steps for m in layers) >= 2 * 8  # both layers, every decode step after the first token

    logits = []
    for runner in (native, per_op):  # one decode step of two requests over fresh pools
        runner.allocate_kv_cache(16)
        prefill = build_forward_batch([RequestChunk(list(range(5, 14)), 0, [0, 1, 2]),
                                       RequestChunk(list(range(20, 25)), 0, [3, 4])], 4)  # fmt: skip
        runner.forward(prefill)
        decode = build_forward_batch([RequestChunk([7], 9, [0, 1, 2]), RequestChunk([8], 5, [3, 4])], 4)
        logits.append(runner.forward(decode))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_fp8_layers_decode_natively_with_the_per_op_paths_tokens(tiny_model_factory) -> None:
    """``--quantize fp8`` (e4m3, one scale per output channel): the native layer decodes the bytes in its GEMM's tile
    (``weight_dtype`` 3), giving the per-op ``Fp8Linear`` path's tokens and HF's on the dequantized model."""
    from tests.helpers.quant_models import dequantized_reference
    from tgi_paged_backend.runner.quant.linear import Fp8Linear

    src = tiny_model_factory("qwen2")
    native, per_op = _runner(src, "fp8", True), _runner(src, "fp8", False)
    layers = [m for m in native.model.modules() if isinstance(m, NativeDecoderLayer)]
    assert len(layers) == 2 and all(m.weights.fp8_codes for m in layers)
    assert len([m for m in native.model.modules() if isinstance(m, NativeInt8Linear)]) == 8
    assert not any(isinstance(m, Fp8Linear) for m in native.model.modules())  # one copy of the bytes
    assert abs(native.weights_bytes - per_op.weights_bytes) < 0.02 * per_op.weights_bytes

    prompts = [np.random.default_rng(5).integers(4, 320, n).tolist() for n in (6, 17, 30)]
    tokens = greedy_paged(native, prompts, 10)
    assert tokens == greedy_paged(per_op, prompts, 10)
    assert tokens == greedy_hf(dequantized_reference(src), prompts, 10, [EOS_ID], PAD_ID)
    assert sum(m.native_steps for m in layers) >= 2 * 8
