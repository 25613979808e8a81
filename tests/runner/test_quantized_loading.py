"""Quantized checkpoints load from their real layout, compute what the dequantized model computes, and
hand what they save to the KV budget.

- ``--quantize fp8`` (load-time) and compressed-tensors FP8 (channel and tensor scales, written here by
  our own quantizer): every linear but the head becomes an ``Fp8Linear`` holding the file's bytes; the
  prompt logits match the HF model holding ``q * scale`` (same tolerance as the unquantized parity
  test), greedy generations through the paged runner are token-exact against it, also after the KV is
  dropped mid-generation and recomputed;
- the resident weight bytes are exactly 1 byte per quantized weight + 4 per output channel + the rest
  in the model dtype, and the CUDA KV budget grows by exactly what was saved;
- Phi-3 (fused projections) and Gemma 2 under fp8 are token-exact too, and so is Falcon in each matrix variant
  (its ``FalconLinear`` projections quantized like ``nn.Linear``); an ``nn.Linear`` subclass not known to compute
  ``x @ W^T + b`` is refused, never silently left in full precision;
- every other scheme and flag/checkpoint mismatch is refused naming what is served;
- where ``QUANT_CROSSCHECK_PYTHON`` names a Python with ``compressed-tensors`` (a throwaway venv), the
  independent loader's dequantized weights equal ours bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.family_models import FAMILY_BY_NAME, write_family_model
from tests.helpers.paged_driver import greedy_hf, greedy_paged
from tests.helpers.quant_models import dequantized_reference, linear_names, write_compressed_fp8
from tests.helpers.tiny_models import EOS_ID, PAD_ID, load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu.fast_layers import PackedLinear
from tgi_paged_backend.runner.model.loader import ModelLoadError, load_model
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer
from tgi_paged_backend.runner.quant.apply import AFFINE_LINEAR_SUBCLASSES, quantize_model_fp8
from tgi_paged_backend.runner.quant.linear import Fp8Linear
from tgi_paged_backend.runner.quant.methods import QuantizationError
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites

CROSSCHECK = Path(__file__).parents[1] / "helpers" / "compressed_tensors_check.py"


def native_layers(runner: ModelRunner) -> list[NativeDecoderLayer]:
    return [m for m in runner.model.modules() if isinstance(m, NativeDecoderLayer)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(77)
    return [rng.integers(4, 320, n).tolist() for n in (6, 19, 33)]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory, tmp_path_factory):
    """(model dir, --quantize, strategy of the reference) per case, on tiny Qwen2 (biased q/k/v)."""
    src = tiny_model_factory("qwen2")
    out = tmp_path_factory.mktemp("ct")
    return {
        "fp8": (src, "fp8", "channel"),
        "ct-channel": (write_compressed_fp8(src, out / "channel", "channel"), "compressed-tensors", "channel"),
        "ct-tensor-dynamic": (
            write_compressed_fp8(src, out / "tensor", "tensor", dynamic_activations=True),
            "compressed-tensors",
            "tensor",
        ),
        "src": src,
    }


CASES = ("fp8", "ct-channel", "ct-tensor-dynamic")


@pytest.mark.parametrize("case", CASES)
def test_linears_hold_the_quantized_bytes_and_match_the_dequantized_model(case, checkpoints, prompts):
    model_dir, quantize, strategy = checkpoints[case]
    src = checkpoints["src"]
    config = ModelConfig(model_id=str(model_dir), quantize=quantize)
    # loading: the linears as loaded (the served runner below fuses them and packs them for the native layers)
    loaded = ModelRunner(config, CacheConfig(block_size=8), "cpu", rewrites=model_rewrites(without=("fuse", "native")))
    reference = dequantized_reference(src, strategy)
    names = linear_names(src)
    assert {n for n, m in loaded.model.named_modules() if isinstance(m, Fp8Linear)} == set(names)
    # the LM head stays full precision (a plain linear, packed for oneDNN by the fast-layer swap)
    assert type(loaded.model.get_output_embeddings()) in (torch.nn.Linear, PackedLinear)
    for name in names:
        ours = loaded.model.get_submodule(name)
        assert ours.qweight.dtype == torch.float8_e4m3fn
        assert torch.equal(ours.dequantized_weight(torch.float32), reference.get_submodule(name).weight)
        if quantize == "compressed-tensors":  # the file's bytes, not a re-quantization
            raw = load_file(str(model_dir / "model.safetensors"))[f"{name}.weight"]
            assert torch.equal(ours.qweight.view(torch.uint8), raw.view(torch.uint8))

    # Resident bytes: fp8 weights + fp32 scales for the linears, everything else in float32.
    full = load_reference(src)
    assert all(not torch.equal(full.get_submodule(n).weight, reference.get_submodule(n).weight) for n in names)
    quantized = sum(full.get_submodule(n).weight.numel() for n in names)
    channels = sum(full.get_submodule(n).out_features for n in names)
    full_bytes = sum(t.numel() * t.element_size() for t in (*full.parameters(), *full.buffers()))
    assert loaded.weights_bytes == full_bytes - quantized * 4 + quantized * 1 + channels * 4

    runner = ModelRunner(config, CacheConfig(block_size=8), "cpu")  # served: the native layers decode the fp8 bytes
    assert all(layer.weights.fp8_codes for layer in native_layers(runner))
    runner.allocate_kv_cache(64)
    from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch

    batch = build_forward_batch([RequestChunk(prompts[1], 0, [3, 9, 1], all_logits=True)], 8)
    with torch.no_grad():
        want = reference(torch.tensor([prompts[1]])).logits[0]
    torch.testing.assert_close(runner.forward(batch), want, rtol=1e-4, atol=1e-4)  # as test_runner_parity

    expected = greedy_hf(reference, prompts, 16, [EOS_ID], PAD_ID)
    assert greedy_paged(runner, prompts, 16, num_blocks=64) == expected

    def preempt(driver) -> None:  # recompute mid-decode: requests 0 and 2 lose their KV
        if driver.step_index == 6:
            driver.drop_kv(0)
            driver.drop_kv(2)

    assert greedy_paged(runner, prompts, 16, num_blocks=64, hook=preempt) == expected


def test_kv_budget_on_cuda_grows_by_the_bytes_saved(monkeypatch, checkpoints):
    src = checkpoints["src"]
    plain = ModelRunner(ModelConfig(model_id=str(src)), CacheConfig(block_size=8), "cpu")
    fp8 = ModelRunner(ModelConfig(model_id=str(src), quantize="fp8"), CacheConfig(block_size=8), "cpu")
    saved = plain.weights_bytes - fp8.weights_bytes
    assert saved > 0
    total = 80 * 2**30  # an 80 GiB device, nearly free: the memory_fraction bound is the binding one
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - 2**30, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)

    def budget(runner: ModelRunner) -> int:
        fake = types.SimpleNamespace(
            device=torch.device("cuda", 0),
            weights_bytes=runner.weights_bytes,
            num_blocks=0,
            block_bytes=runner.block_bytes,
            activation_peak_bytes=2**20,
            graph_bytes=0,
        )
        return ModelRunner.available_kv_bytes(fake, 0.9)

    assert budget(fp8) - budget(plain) == saved


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda qc: qc.update(format="int-quantized"), "format='int-quantized'"),
        (lambda qc: qc.update(format="pack-quantized"), "config_groups.group_0.weights num_bits=8 type='float'"),
        (
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128),
            "strategy='group'",
        ),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"), "num_bits=4 type='int'"),
        (
            lambda qc: qc["config_groups"]["group_0"].update(
                input_activations={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
            ),
            "static",
        ),
        (lambda qc: qc.update(quantization_status="frozen"), "quantization_status='frozen'"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_refused(edit, message, checkpoints, tmp_path):
    model_dir = write_compressed_fp8(checkpoints["src"], tmp_path / "ckpt")
    config = json.loads((model_dir / "config.json").read_text())
    edit(config["quantization_config"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(ModelConfig(model_id=str(model_dir), quantize="compressed-tensors"), "cpu")
    assert "supported: FP8 weights" in str(info.value)


@pytest.mark.parametrize(
    "quantize, on, message",
    [
        ("fp8", "ct", "already quantized .*--quantize compressed-tensors"),
        (None, "ct", "no --quantize was given; pass --quantize compressed-tensors"),
        ("compressed-tensors", "src", "needs a checkpoint whose config.json has quantization_config.quant_method"),
        (
            "eetq",
            "src",
            "--quantize eetq is not supported by tgi-paged-backend: supported fp8, compressed-tensors, gptq, awq",
        ),
        ("gptq", "src", "needs a checkpoint whose config.json has quantization_config.quant_method='gptq'"),
        ("bitsandbytes-nf4", "src", "--quantize bitsandbytes-nf4 is not supported"),
    ],
)
def test_flag_and_checkpoint_must_agree(quantize, on, message, checkpoints):
    model_dir = checkpoints["ct-channel"][0] if on == "ct" else checkpoints["src"]
    with pytest.raises(ModelLoadError, match=message):
        load_model(ModelConfig(model_id=str(model_dir), quantize=quantize), "cpu")


def test_quantized_config_of_another_method_names_the_flag(checkpoints, tmp_path):
    model_dir = write_compressed_fp8(checkpoints["src"], tmp_path / "eetq")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "eetq", "weights": "int8"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="pass --quantize eetq .*--quantize eetq is not supported"):
        load_model(ModelConfig(model_id=str(model_dir)), "cpu")


@pytest.mark.skipif(
    not os.environ.get("QUANT_CROSSCHECK_PYTHON"),
    reason="set QUANT_CROSSCHECK_PYTHON to a Python with compressed-tensors + transformers "
    "(not a dependency of this package) to cross-check against that independent loader",
)
@pytest.mark.parametrize("case", ["ct-channel", "ct-tensor-dynamic"])
def test_independent_loader_dequantizes_bit_for_bit(case, checkpoints, tmp_path):
    model_dir, quantize, _ = checkpoints[case]
    out = tmp_path / "theirs.safetensors"
    done = subprocess.run(
        [os.environ["QUANT_CROSSCHECK_PYTHON"], str(CROSSCHECK), str(model_dir), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = load_file(str(out))
    ours = load_model(ModelConfig(model_id=str(model_dir), quantize=quantize), "cpu").model
    names = linear_names(checkpoints["src"])
    for name in names:
        assert torch.equal(theirs[f"{name}.weight"], ours.get_submodule(name).dequantized_weight(torch.float32)), name


@pytest.mark.parametrize("kind", ["phi3", "gemma2"])
def test_fp8_other_families_are_token_exact(kind, tiny_model_factory, prompts):
    """Fused QKV / gate-up (Phi-3) and soft-capping with sliding windows (Gemma 2) under fp8."""
    from tests.helpers.paged_driver import greedy_hf_full_recompute

    src = tiny_model_factory(kind)
    runner = ModelRunner(ModelConfig(model_id=str(src), quantize="fp8"), CacheConfig(block_size=8), "cpu")
    fp8_layers = [layer for layer in native_layers(runner) if layer.weights.fp8_codes]
    assert fp8_layers or any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    expected = greedy_hf_full_recompute(dequantized_reference(src), prompts, 12, [EOS_ID])
    assert greedy_paged(runner, prompts, 12, num_blocks=64) == expected


@pytest.mark.parametrize("name", ["Falcon", "Falcon-7B", "Falcon-RW"])
def test_fp8_quantizes_falcons_linears(name, tmp_path, prompts):
    """Falcon's projections are ``FalconLinear`` (an ``nn.Linear`` subclass): every one of them, attention and MLP,
    becomes an ``Fp8Linear``, and greedy tokens equal HF's on the dequantized weights."""
    src = write_family_model(FAMILY_BY_NAME[name], tmp_path / name)
    runner = ModelRunner(ModelConfig(model_id=str(src), quantize="fp8"), CacheConfig(block_size=8), "cpu")
    names = linear_names(src)
    layer_linears = {f"transformer.h.{i}.{n}" for i in range(2) for n in FALCON_LINEARS}
    assert set(names) == layer_linears
    assert {n for n, m in runner.model.named_modules() if isinstance(m, Fp8Linear)} == layer_linears
    reference = dequantized_reference(src)
    expected = greedy_hf(reference, prompts, 12, [EOS_ID], PAD_ID)
    assert greedy_paged(runner, prompts, 12, num_blocks=64) == expected


FALCON_LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def test_falcon_linear_is_the_affine_map_fp8_assumes():
    """``AFFINE_LINEAR_SUBCLASSES`` lists FalconLinear because its forward is ``x @ W^T + b``."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    layer = FalconLinear(8, 6, bias=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    kind = f"{FalconLinear.__module__}.{FalconLinear.__qualname__}"
    assert kind in AFFINE_LINEAR_SUBCLASSES


def test_fp8_refuses_a_linear_subclass_it_does_not_know():
    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.plain, self.head = ScaledLinear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

        def get_output_embeddings(self):
            return self.head

    with pytest.raises(QuantizationError, match=r"proj is a .*ScaledLinear, an nn.Linear subclass"):
        quantize_model_fp8(Tiny())  # type: ignore[arg-type]
