"""bf16 models on the native decode layer (``runner.native.layers``, ``runner.native.checks``): the layers are
wrapped, every decode step runs natively, and greedy generation's logits stay as close to HF's fp32 logits as HF's
own bf16 model is.

Criterion, on the same tokens (ours, fed to HF as one sequence), with ``e_ours = max|ours - HF fp32|`` and
``e_hf = max|HF bf16 - HF fp32|`` over the vocabulary at one step of one request:

- every step: ``e_ours <= 2 e_hf + 0.05 max|HF fp32 logits|``;
- over all steps and requests: ``mean(e_ours) <= 1.25 mean(e_hf)``.

Our layers sum in fp32 and round once per layer (HF bf16 rounds after every op): measured per layer on these steps,
the native output's error is about half the per-op bf16 layer's. On logits both are dominated by bf16 roundings
of the residual stream that a tiny random model amplifies chaotically (one step in ~30 lands 2-3x above HF's own
error while the mean is at or below it), hence the slack per step and the tight bound on the mean. A wrong layer
is off by the logits' own scale.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.tiny_models import load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu import fast_layers
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.native import layers as native_layers
from tgi_paged_backend.runner.native.checks import bf16_step_close, fp32_close, fp32_params
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer
from tgi_paged_kernels.cpu_gemm import bf16_from_packed, pack_weight, set_bf16_amx, set_bf16_dot
from tgi_paged_kernels.cpu_native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")

PROMPTS = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2], [12]]
NEW_TOKENS = 8
SLACK = 0.05
"""Per-step slack, relative to the largest HF fp32 logit."""


def _runner(path, **options) -> ModelRunner:
    return ModelRunner(ModelConfig(model_id=str(path), dtype="bfloat16", **options), CacheConfig(block_size=4))


def _generate(runner: ModelRunner, slots: tuple[int, ...] = (-1, -1, -1)) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill then greedy decode steps: each request's tokens (prompt and generated) and each step's logits
    (request ``i`` on adapter slot ``slots[i]``, -1: the base model)."""
    blocks = 8
    runner.allocate_kv_cache(len(PROMPTS) * blocks + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(PROMPTS))]
    chunk = RequestChunk
    prompts = [chunk(p, 0, t, lora_slot=s) for p, t, s in zip(PROMPTS, tables, slots)]
    logits = [runner.forward(build_forward_batch(prompts, 4))]
    tokens = [list(p) for p in PROMPTS]
    for _ in range(NEW_TOKENS):
        ids = logits[-1].argmax(dim=-1).tolist()
        chunks = [chunk([i], len(seq), t, lora_slot=s) for i, seq, t, s in zip(ids, tokens, tables, slots)]
        for seq, i in zip(tokens, ids):
            seq.append(i)
        logits.append(runner.forward(build_forward_batch(chunks, 4)))
    return tokens, [step.float() for step in logits]


@pytest.mark.parametrize("name", ["Llama", "Qwen3", "Gemma3"])
def test_bf16_greedy_generation_is_as_close_to_hf_fp32_as_hf_bf16(family_dir, monkeypatch, name) -> None:
    path = family_dir(name)
    runner = _runner(path)
    assert runner.native_layers is not None and runner.native_layers.wrapped == 2
    assert all(
        m.weights.weight_dtype == torch.bfloat16 for m in runner.model.modules() if isinstance(m, NativeDecoderLayer)
    )
    calls: list[torch.dtype] = []
    real = native_layers.decode_layer
    monkeypatch.setattr(native_layers, "decode_layer", lambda *a, **k: calls.append(a[2].dtype) or real(*a, **k))
    tokens, ours = _generate(runner)
    assert calls == [torch.bfloat16] * (2 * NEW_TOKENS)  # every decode step of both layers ran natively, in bf16
    _expect_as_close_as_hf(name, tokens, ours, load_reference(path), load_reference(path).to(torch.bfloat16))


def _expect_as_close_as_hf(
    name: str,
    tokens: list[list[int]],
    ours: list[torch.Tensor],
    hf32: torch.nn.Module,
    hf16: torch.nn.Module,
    requests: tuple[int, ...] = (0, 1, 2),
) -> None:
    """The module docstring's criterion for ``requests``: ``ours`` (each step's logits) against HF fp32 ``hf32``, as
    HF bf16 ``hf16`` is, on the same tokens."""
    errors: list[tuple[float, float]] = []
    for b in requests:
        ids = torch.tensor([tokens[b]])
        with torch.inference_mode():
            exact, rounded = hf32(ids).logits[0].float(), hf16(ids).logits[0].float()
        start = len(PROMPTS[b]) - 1  # the prompt's last position: the prefill's logits
        for step, got in enumerate(ours):
            pos = start + step
            ours_error = (got[b] - exact[pos]).abs().max().item()
            hf_error = (rounded[pos] - exact[pos]).abs().max().item()
            errors.append((ours_error, hf_error))
            assert ours_error <= 2 * hf_error + SLACK * exact.abs().max().item(), (name, b, step, errors[-1])
    ours_mean, hf_mean = (sum(e) / len(errors) for e in zip(*errors))
    assert ours_mean <= 1.25 * hf_mean, (name, ours_mean, hf_mean)


def test_bf16_verify_steps_run_natively_as_close_to_hf_fp32_as_hf_bf16(family_dir, monkeypatch) -> None:
    """A bf16 model's verify step (each request's generated tokens as drafts, 8 rows per request) runs in the native
    layer call: its logits meet the module docstring's criterion at every row."""
    path = family_dir("Qwen3")
    tokens, _ = _generate(_runner(path))
    runner = _runner(path)
    calls: list[bool] = []
    real = native_layers.decode_layer
    record = lambda *a, **k: calls.append(a[10] is not None) or real(*a, **k)  # noqa: E731 - query_start_loc given
    monkeypatch.setattr(native_layers, "decode_layer", record)
    blocks = 8
    runner.allocate_kv_cache(len(PROMPTS) * blocks + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(PROMPTS))]
    ours = [runner.forward(build_forward_batch([RequestChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], 4))]
    drafts = [RequestChunk(seq[len(p) :], len(p), t, all_logits=True) for p, seq, t in zip(PROMPTS, tokens, tables)]
    rows = runner.forward(build_forward_batch(drafts, 4)).view(len(PROMPTS), NEW_TOKENS, -1)
    assert calls == [True, True]  # both layers ran the verify step natively
    ours += [rows[:, j] for j in range(NEW_TOKENS)]
    _expect_as_close_as_hf("Qwen3 verify", tokens, ours, load_reference(path), load_reference(path).bfloat16())


def test_bf16_adapter_rows_decode_natively_as_close_to_peft_fp32_as_peft_bf16(family_dir, tmp_path, monkeypatch):
    """A bf16 model's adapter rows (beside base rows) decode in the native layer call, the deltas added in fp32:
    greedy logits as close to HF + PEFT in fp32 as HF + PEFT in bf16 are."""
    from peft import PeftModel

    from tests.helpers.lora_adapters import write_adapter

    path = family_dir("Llama")
    adapter = write_adapter(path, tmp_path / "full", seed=5)
    runner = _runner(path, lora_adapters=f"full={adapter}")
    assert runner.native_layers is not None and runner.native_layers.wrapped == 2, runner.native_layers
    assert not runner.native_layers.kept, runner.native_layers.kept
    calls: list[bool] = []
    real = native_layers.decode_layer
    record = lambda *a, **k: calls.append(a[-1] is not None) or real(*a, **k)  # noqa: E731 - token_slots given
    monkeypatch.setattr(native_layers, "decode_layer", record)
    slots = (0, -1, 0)
    tokens, ours = _generate(runner, slots)
    assert calls == [True] * (2 * NEW_TOKENS)  # every decode step of both layers ran natively, with adapter rows
    refs = [PeftModel.from_pretrained(load_reference(path), str(adapter)).eval() for _ in range(2)]
    refs[1] = refs[1].to(torch.bfloat16)
    _expect_as_close_as_hf("Llama+LoRA", tokens, ours, *refs, requests=(0, 2))


@pytest.mark.parametrize(("name", "quantize"), [("Qwen2", "fp8"), ("Qwen2", "gptq"), ("Llama", "fp8")])
def test_quantized_weights_of_a_bf16_model_decode_natively(family_dir, tmp_path, monkeypatch, name, quantize) -> None:
    """``--quantize fp8`` and GPTQ int8 under ``--dtype bfloat16``: the layers keep their codes (one copy, decoded
    in the GEMM's tile into fp32) and run every decode step natively on the bf16 hidden state; prefills run the
    native tile too. The logits meet the module docstring's criterion against HF on the dequantized weights (fp32
    and bf16)."""
    from tests.helpers.int_checkpoints import int_reference, write_int_checkpoint
    from tests.helpers.quant_models import dequantized_reference
    from tgi_paged_backend.runner.quant.linear import Fp8Linear, IntLinear

    src = family_dir(name)  # Qwen2's biased q/k/v, Llama's none: the fusion checks run in bf16 either way
    if quantize == "fp8":
        path, references = src, [dequantized_reference(src, loaded=torch.bfloat16) for _ in range(2)]
    else:
        ckpt = write_int_checkpoint(src, tmp_path / "gptq", "gptq", bits=8, group_size=-1, sym=True)
        path, references = ckpt.path, [int_reference(src, ckpt) for _ in range(2)]
    runner = _runner(path, quantize=quantize)
    layers = [m for m in runner.model.modules() if isinstance(m, NativeDecoderLayer)]
    assert len(layers) == 2 and all(m.weights.int8_columns is not None for m in layers), runner.native_layers
    assert all(m.weights.fp8_codes == (quantize == "fp8") for m in layers)
    assert not any(isinstance(m, (Fp8Linear, IntLinear)) for m in runner.model.modules())  # one copy of the codes
    calls: list[torch.dtype] = []
    real = native_layers.decode_layer
    monkeypatch.setattr(native_layers, "decode_layer", lambda *a, **k: calls.append(a[2].dtype) or real(*a, **k))
    tokens, ours = _generate(runner)
    assert calls == [torch.bfloat16] * (2 * NEW_TOKENS)
    _expect_as_close_as_hf(f"{name} {quantize}", tokens, ours, references[0], references[1].bfloat16())


def test_fp16_and_fp8_kv_keep_the_per_op_path(family_dir) -> None:
    path = family_dir("Llama")
    fp16 = ModelRunner(ModelConfig(model_id=str(path), dtype="float16"), CacheConfig(block_size=4))
    assert fp16.native_layers is None
    fp8 = ModelRunner(
        ModelConfig(model_id=str(path), dtype="bfloat16"), CacheConfig(block_size=4, kv_cache_dtype="fp8_e4m3fn")
    )
    assert fp8.native_layers is None


def test_a_wrong_bf16_packing_is_never_served(family_dir, monkeypatch) -> None:
    """The description is right (the fp32 proof passes) but the bf16 weights are not the layer's: the bf16 check
    keeps every layer on the Python path."""
    real = native_layers.LayerWeights.as_bf16

    def wrong(self):
        packed = real(self)
        return dataclasses.replace(packed, qkv=packed.qkv.flip(-1).contiguous())  # each k pair's members swapped

    monkeypatch.setattr(native_layers.LayerWeights, "as_bf16", wrong)
    runner = _runner(family_dir("Llama"))
    assert runner.native_layers is not None and runner.native_layers.wrapped == 0
    assert any("bf16 decode step differs" in reason for reason in runner.native_layers.kept)


def test_fp32_params_round_trips_and_the_bf16_criterion() -> None:
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    before = layer.weight.detach().clone()
    with fp32_params(layer):
        assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, before.float())
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, before)
    exact = torch.randn(3, 64)
    per_op = exact.bfloat16().float() + 0.01 * torch.randn(3, 64)
    assert bf16_step_close(exact.bfloat16(), per_op, exact)
    assert not bf16_step_close(exact.bfloat16() * 1.1, per_op, exact)


def test_the_fp32_check_tolerance_scales_with_the_result() -> None:
    """fp32 sums in another order differ by ~1e-5 of the result's scale, also on its small values; a wrong
    description is off by a fraction of the scale."""
    expected = torch.tensor([150.0, 0.01, -3.0])
    assert fp32_close(expected, expected + torch.tensor([0.0, 1.4e-3, 0.0]))  # 1e-5 of the scale
    assert not fp32_close(expected, expected + torch.tensor([0.0, 0.02, 0.0]))  # 1.3e-4 of the scale
    assert not fp32_close(expected, expected * (1 + 1e-3))
    small = torch.tensor([3.0, 0.01])  # a scale below 5 keeps the absolute 1e-4
    assert fp32_close(small, small + 5e-5) and not fp32_close(small, small + 5e-4)


def test_native_linear_bf16_rows_small_and_many() -> None:
    """Few bf16 rows: the packed bf16 GEMM (fp32 sums, rounded once); many rows: oneDNN on the kept weight, as the
    per-op linear computes it, where oneDNN runs bf16 (else the packed GEMM at every row count)."""
    linear = torch.nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    packed = pack_weight(linear.weight.detach().float())
    native = fast_layers.NativeLinear(
        bf16_from_packed(packed), 40,
        linear.bias.detach().float(), native_kernels(), 64,
    )  # fmt: skip
    native.keep_dense(linear)
    if fast_layers.can_pack(torch.bfloat16, torch.device("cpu")):
        assert native.bf16_rows in (fast_layers.BF16_MATMUL_ROWS, fast_layers.BF16_DOT_MATMUL_ROWS)
        assert native.dense is not None
    else:
        assert native.bf16_rows == fast_layers.NO_BF16_MATMUL and native.dense is None
    for rows in (3, min(native.bf16_rows, 64) - 1, min(native.bf16_rows, 64) + 5):
        x = torch.randn(rows, 64).bfloat16()
        exact = x.float() @ linear.weight.float().T + linear.bias.float()
        got = native(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=2e-2)


def test_bf16_matmul_rows_follow_the_gemm_path() -> None:
    """oneDNN takes bf16 rows from 64 where the native GEMM runs vdpbf16ps (faster below that), else from 32."""
    if not fast_layers.can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN has no bf16 GEMM on this CPU (test_without_onednn_bf16_the_native_gemm_serves_every_row)")
    native = native_kernels()
    dot = set_bf16_dot(native)
    try:
        if set_bf16_dot(native, True) and not set_bf16_amx(native):
            assert fast_layers.bf16_matmul_rows(native) == fast_layers.BF16_DOT_MATMUL_ROWS == 64
        set_bf16_dot(native, False)
        assert fast_layers.bf16_matmul_rows(native) == fast_layers.BF16_MATMUL_ROWS == 32
    finally:
        set_bf16_dot(native, dot)


def test_without_onednn_bf16_the_native_gemm_serves_every_row(family_dir, monkeypatch) -> None:
    """An AVX2-only CPU (oneDNN has no bf16 GEMM there; simulated): bf16 rows never go to oneDNN, nothing is packed
    for it (packing raised there), and a bf16 model still runs its native layers and answers as on any host."""
    monkeypatch.setattr(fast_layers, "can_pack", lambda dtype, device: dtype == torch.float32)
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def fp32_only(weight: torch.Tensor, *args: object) -> torch.Tensor:  # as oneDNN on such a CPU: bf16 raises
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
        return reorder(weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fp32_only)
    assert fast_layers.bf16_matmul_rows(native_kernels()) == fast_layers.NO_BF16_MATMUL
    runner = _runner(family_dir("Llama"))
    assert runner.native_layers is not None and runner.native_layers.wrapped == 2
    linears = [m for m in runner.model.modules() if isinstance(m, fast_layers.NativeLinear)]
    assert linears and all(m.dense is None and m.bf16_rows == fast_layers.NO_BF16_MATMUL for m in linears)
    assert not any(isinstance(m, fast_layers.PackedLinear) for m in runner.model.modules())
    assert not any(type(m) is torch.nn.Linear for m in runner.model.modules())  # the LM head too: native bf16
    tokens, _ = _generate(runner)
    monkeypatch.undo()
    assert _generate(_runner(family_dir("Llama")))[0] == tokens
