"""Int4/int8 checkpoints (GPTQ, AWQ, compressed-tensors ``pack-quantized``) load from their real layouts,
compute what the dequantized model computes, and hand what they save to the KV budget.

Checkpoints are written by ``tests/helpers/int_checkpoints.py`` on tiny Qwen2 (biased q/k/v):

- every linear but the head becomes an ``IntLinear`` holding exactly the file's codes, whose
  dequantized weight is the writer's ``(q - z) * s`` bit for bit;
- prompt logits match the HF model holding those weights (the parity tests' 1e-4); greedy generations
  through the paged runner are token-exact against it, also after the KV is dropped and recomputed;
- resident bytes are exactly ``N*K*bits/8`` codes + 5 bytes per (channel, group) + 4 per input column
  per quantized linear, the rest in the model dtype;
- unsupported options of each format are refused naming what is served; ``--quantize gptq`` serves an
  AWQ checkpoint (as TGI, which converts it);
- where ``QUANT_CROSSCHECK_PYTHON`` names a Python with ``compressed-tensors``, its decompression of the
  pack-quantized checkpoints, and of the AWQ one through its ``AutoAWQConverter``, equals ours bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.int_checkpoints import int_reference, write_int_checkpoint
from tests.helpers.paged_driver import greedy_hf, greedy_paged
from tests.helpers.quant_models import linear_names
from tests.helpers.tiny_models import EOS_ID, PAD_ID, load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu.fast_layers import PackedLinear
from tgi_paged_backend.runner.model.loader import ModelLoadError, load_model
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.quant.linear import IntLinear
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites

CROSSCHECK = Path(__file__).parents[1] / "helpers" / "compressed_tensors_check.py"
FLAG = {"gptq": "gptq", "awq": "awq", "pack-quantized": "compressed-tensors"}
CASES = {  # name: (format, writer options)
    "gptq-int4-g32-sym": ("gptq", dict(bits=4, group_size=32, sym=True)),
    "gptq-int4-g16-act-order": ("gptq", dict(bits=4, group_size=16, desc_act=True)),
    "gptq-int8-channel": ("gptq", dict(bits=8, group_size=-1)),
    "awq-int4-g32": ("awq", dict(group_size=32)),
    "ct-int4-g32-sym": ("pack-quantized", dict(bits=4, group_size=32, sym=True)),
    "ct-int4-g16-asym": ("pack-quantized", dict(bits=4, group_size=16, sym=False)),
    "ct-int8-channel-asym": ("pack-quantized", dict(bits=8, group_size=-1, sym=False)),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(78)
    return [rng.integers(4, 320, n).tolist() for n in (7, 18, 31)]


@pytest.fixture(scope="module")
def src(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def checkpoints(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("int")
    return {name: write_int_checkpoint(src, out / name, fmt, **kw) for name, (fmt, kw) in CASES.items()}


def _rewrite_config(ckpt_dir: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in ckpt_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("case", sorted(CASES))
def test_linears_hold_the_file_codes_and_match_the_dequantized_model(case, src, checkpoints, prompts):
    ckpt = checkpoints[case]
    runner = ModelRunner(  # loading only: the int8 layers' native decode (their codes packed) is test_native_int8's
        ModelConfig(model_id=str(ckpt.path), quantize=FLAG[ckpt.fmt]), CacheConfig(block_size=8), "cpu",
        rewrites=model_rewrites(without=("fuse", "native")),
    )  # fmt: skip
    names = linear_names(src)
    assert {n for n, m in runner.model.named_modules() if isinstance(m, IntLinear)} == set(names)
    # the LM head stays full precision (a plain linear, packed for oneDNN by the fast-layer swap)
    assert type(runner.model.get_output_embeddings()) in (torch.nn.Linear, PackedLinear)
    for name in names:
        ours = runner.model.get_submodule(name)
        assert ours.bits == ckpt.bits and ours.qweight.dtype == torch.uint8
        assert torch.equal(ours.codes(), ckpt.codes[name]), name
        assert torch.equal(ours.dequantized_weight(torch.float32), ckpt.weights[name]), name

    full = load_reference(src)
    resident, fp32 = 0, 0
    for name in names:
        linear = full.get_submodule(name)
        n, k = linear.out_features, linear.in_features
        groups = 1 if ckpt.group_size == -1 else k // ckpt.group_size
        resident += n * k * ckpt.bits // 8 + n * groups * 5 + k * 4
        fp32 += linear.weight.numel() * 4
    full_bytes = sum(t.numel() * t.element_size() for t in (*full.parameters(), *full.buffers()))
    assert runner.weights_bytes == full_bytes - fp32 + resident
    assert resident < fp32 * (0.25 if ckpt.bits == 4 else 0.4)  # ~int4 / int8 plus the group metadata

    reference = int_reference(src, ckpt)
    runner.allocate_kv_cache(64)
    from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch

    batch = build_forward_batch([RequestChunk(prompts[1], 0, [3, 9, 1], all_logits=True)], 8)
    with torch.no_grad():
        want = reference(torch.tensor([prompts[1]])).logits[0]
    torch.testing.assert_close(runner.forward(batch), want, rtol=1e-4, atol=1e-4)

    expected = greedy_hf(reference, prompts, 16, [EOS_ID], PAD_ID)

    def preempt(driver) -> None:  # recompute mid-decode: requests 0 and 2 lose their KV
        if driver.step_index == 6:
            driver.drop_kv(0)
            driver.drop_kv(2)

    assert greedy_paged(runner, prompts, 16, num_blocks=64, hook=preempt) == expected


def test_quantize_gptq_serves_an_awq_checkpoint(checkpoints):
    ckpt = checkpoints["awq-int4-g32"]
    model = load_model(ModelConfig(model_id=str(ckpt.path), quantize="gptq"), "cpu").model
    name = next(iter(ckpt.weights))
    assert torch.equal(model.get_submodule(name).dequantized_weight(torch.float32), ckpt.weights[name])


@pytest.mark.parametrize(
    "case, edit, message",
    [
        ("gptq-int4-g32-sym", lambda qc: qc.update(bits=3), "gptq checkpoint not supported: bits=3"),
        ("gptq-int4-g32-sym", lambda qc: qc.update(bits=2), "bits=2"),
        ("gptq-int4-g32-sym", lambda qc: qc.update(checkpoint_format="gptq_v2"), "checkpoint_format='gptq_v2'"),
        ("gptq-int4-g32-sym", lambda qc: qc.update(group_size=48), "not a multiple of group_size=48"),
        ("awq-int4-g32", lambda qc: qc.update(version="gemv"), "awq checkpoint not supported: version='gemv'"),
        ("awq-int4-g32", lambda qc: qc.update(zero_point=False), "zero_point=False"),
        ("awq-int4-g32", lambda qc: qc.update(backend="llm-awq"), "version='llm-awq'"),
        (
            "ct-int4-g32-sym",
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(actorder="group"),
            "actorder='group'",
        ),
        (
            "ct-int4-g32-sym",
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
            "strategy='tensor'",
        ),
        ("ct-int4-g32-sym", lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=2), "num_bits=2"),
        (
            "ct-int4-g32-sym",
            lambda qc: qc["config_groups"]["group_0"].update(
                input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
            ),
            "input_activations are quantized",
        ),
        ("ct-int4-g32-sym", lambda qc: qc.update(format="int-quantized"), "format='int-quantized'"),
    ],
)
def test_unsupported_int_options_are_refused_naming_what_is_served(case, edit, message, checkpoints, tmp_path):
    ckpt = checkpoints[case]
    model_dir = _rewrite_config(ckpt.path, tmp_path / "ckpt", edit)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(ModelConfig(model_id=str(model_dir), quantize=FLAG[ckpt.fmt]), "cpu")
    assert "supported:" in str(info.value)


def test_a_malformed_tensor_is_named(checkpoints, tmp_path):
    ckpt = checkpoints["gptq-int4-g32-sym"]
    model_dir = _rewrite_config(ckpt.path, tmp_path / "bad", lambda qc: None)
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    tensors[f"{name}.scales"] = tensors[f"{name}.scales"][:1].clone()
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"{name}.scales is float16 \[1, 128\]: expected .*\[2, 128\]"):
        load_model(ModelConfig(model_id=str(model_dir), quantize="gptq"), "cpu")


@pytest.mark.skipif(
    not os.environ.get("QUANT_CROSSCHECK_PYTHON"),
    reason="set QUANT_CROSSCHECK_PYTHON to a Python with compressed-tensors + transformers "
    "(not a dependency of this package) to cross-check against that independent loader",
)
@pytest.mark.parametrize("case", ["ct-int4-g32-sym", "ct-int4-g16-asym", "ct-int8-channel-asym", "awq-int4-g32"])
def test_independent_loader_dequantizes_bit_for_bit(case, src, checkpoints, tmp_path):
    ckpt = checkpoints[case]
    out = tmp_path / "theirs.safetensors"
    done = subprocess.run(
        [os.environ["QUANT_CROSSCHECK_PYTHON"], str(CROSSCHECK), str(ckpt.path), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = load_file(str(out))
    ours = load_model(ModelConfig(model_id=str(ckpt.path), quantize=FLAG[ckpt.fmt]), "cpu").model
    for name in linear_names(src):
        want = theirs[f"{name}.weight"]  # float32 (compressed-tensors' fp32 scales), float16 for AWQ
        assert torch.equal(ours.get_submodule(name).dequantized_weight(want.dtype), want), name


@pytest.mark.skipif(
    not os.environ.get("TGI_SERVER_SOURCE"),
    reason="set TGI_SERVER_SOURCE to a checkout of text-generation-inference's server/ directory to "
    "decode TGI's own AWQ->GPTQ conversion with our GPTQ reader",
)
def test_tgi_awq_to_gptq_conversion_decodes_to_the_same_codes(checkpoints):
    """TGI serves AWQ under ``--quantize gptq`` by repacking it into GPTQ v1 tensors for its GPTQ kernels
    (``layers/awq/conversion_utils.py``, pure torch, loaded by path): our GPTQ reader must decode those to
    exactly the codes and zeros our AWQ reader reads, which checks the GPTQ packing and ``zero - 1``
    offset against TGI's."""
    import importlib.util

    from tgi_paged_backend.runner.quant.gptq_awq import GptqAwqScheme, decode_awq, decode_gptq

    path = Path(os.environ["TGI_SERVER_SOURCE"]) / "text_generation_server/layers/awq/conversion_utils.py"
    spec = importlib.util.spec_from_file_location("tgi_awq_conversion_utils", path)
    tgi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tgi)
    ckpt = checkpoints["awq-int4-g32"]
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    for name, codes in ckpt.codes.items():
        n, k = codes.shape
        awq = {s: tensors[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales")}
        qweight, qzeros = tgi.fast_awq_to_gptq(awq["qweight"], awq["qzeros"])
        gptq = decode_gptq(
            name, {"qweight": qweight, "qzeros": qzeros, "scales": awq["scales"]}, GptqAwqScheme("gptq", 4, 32), n, k
        )
        ours = decode_awq(name, awq, GptqAwqScheme("awq", 4, 32), n, k)
        assert torch.equal(gptq.codes, codes) and torch.equal(gptq.codes, ours.codes), name
        assert torch.equal(gptq.zeros, ours.zeros), name
