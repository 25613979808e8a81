"""Quantized models through the shard engine: greedy tokens equal the dequantized HF model's over a batch
that is preempted (recompute and swap), and Warmup reports the quantized weight bytes.

Formats: ``--quantize fp8`` on each tiny family (load-time quantization), compressed-tensors FP8
checkpoints written by our quantizer (per-channel scales; per-tensor with dynamic activations), and
int checkpoints written by ``tests/helpers/int_checkpoints.py`` (GPTQ int4 act-order, GPTQ int8, AWQ
int4, compressed-tensors pack-quantized int4). The reference is HF ``generate`` on the same
architecture whose quantized linears hold the dequantized weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import (
    TINY_KIND_FIXTURES,
    RouterBlocks,
    RouterDriver,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
)
from tests.helpers.int_checkpoints import int_reference, write_int_checkpoint
from tests.helpers.quant_models import dequantized_reference, write_compressed_fp8
from tgi_paged_backend.engine import build_engine
from tgi_paged_backend.engine.types import BatchSpec, FinishReason
from tgi_paged_backend.envs import build_config


def make_quantized_engine(model_dir, quantize: str, *, mode: str, block_size: int = 8):
    settings = {
        "TGI_PAGED_NUM_BLOCKS": str(64 // block_size + 1),
        "TGI_PAGED_BLOCK_SIZE": str(block_size),
        "TGI_PAGED_PREEMPTION": mode,
        "TGI_PAGED_SWAP_SPACE_GB": "0.01",
        "PREFIX_CACHING": "1",
        "TGI_PAGED_OVERCOMMIT": "3",
    }
    return build_engine(build_config({"model_id": str(model_dir), "quantize": quantize}, settings))


def reference_tokens(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, x.shape[1] :].tolist()


def run_preempted_batch(engine, reference, mode: str) -> None:
    """As ``test_preemption_keeps_outputs_identical``: 4 requests of ~12 + 20 tokens on 64 physical tokens."""
    router_warmup(engine, 64)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 3), 20) for rid in (40, 41, 42, 44)]
    driver.drain(driver.prefill(BatchSpec(id=5, requests=tuple(requests))))
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    for r in requests:
        ids = prompt_ids(engine, r.text)
        assert driver.tokens[r.id] == reference_tokens(reference, ids, 20), f"request {r.id} differs"
        assert driver.final[r.id].generated_text.finish_reason is FinishReason.LENGTH
    driver.assert_idle()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", sorted(TINY_KIND_FIXTURES))
def test_fp8_is_token_exact_under_preemption(request, kind, mode):
    src = request.getfixturevalue(TINY_KIND_FIXTURES[kind])
    engine = make_quantized_engine(src, "fp8", mode=mode)
    run_preempted_batch(engine, dequantized_reference(src, "channel"), mode)


@pytest.mark.parametrize("strategy, dynamic, mode", [("channel", False, "recompute"), ("tensor", True, "swap")])
def test_compressed_tensors_is_token_exact_under_preemption(tiny_llama_dir, tmp_path, strategy, dynamic, mode):
    ckpt = write_compressed_fp8(tiny_llama_dir, tmp_path / strategy, strategy, dynamic_activations=dynamic)
    engine = make_quantized_engine(ckpt, "compressed-tensors", mode=mode)
    run_preempted_batch(engine, dequantized_reference(tiny_llama_dir, strategy), mode)


INT_CASES = [  # (format, --quantize, writer options, preemption)
    ("gptq", "gptq", dict(bits=4, group_size=16, desc_act=True), "recompute"),
    ("gptq", "gptq", dict(bits=8, group_size=32, sym=True), "swap"),
    ("awq", "awq", dict(group_size=32), "swap"),
    ("pack-quantized", "compressed-tensors", dict(bits=4, group_size=32, sym=False), "recompute"),
]


@pytest.mark.parametrize("fmt, quantize, options, mode", INT_CASES)
def test_int_checkpoints_are_token_exact_under_preemption(tiny_llama_dir, tmp_path, fmt, quantize, options, mode):
    ckpt = write_int_checkpoint(tiny_llama_dir, tmp_path / fmt, fmt, **options)
    engine = make_quantized_engine(ckpt.path, quantize, mode=mode)
    run_preempted_batch(engine, int_reference(tiny_llama_dir, ckpt), mode)


@pytest.mark.parametrize("quantize", ["fp8", "gptq"])
def test_warmup_reports_the_quantized_weight_bytes(tiny_llama_dir, tmp_path, quantize):
    budgets = []
    model_dir = (
        tiny_llama_dir if quantize == "fp8" else write_int_checkpoint(tiny_llama_dir, tmp_path / "gptq", "gptq").path
    )
    engine = make_quantized_engine(model_dir, quantize, mode="recompute")
    engine.recorder.record_budget = budgets.append  # what feeds tgi_paged_weights_bytes
    router_warmup(engine, 64)
    (budget,) = budgets
    assert budget.weights_bytes == engine.runner.weights_bytes
    unquantized = sum(t.numel() * t.element_size() for t in dequantized_reference(tiny_llama_dir).state_dict().values())
    assert budget.weights_bytes < unquantized
