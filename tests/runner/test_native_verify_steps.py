"""Speculative verify steps (several new rows per request that has context) on the native decode layers: every
family form's load-time check proves its verify step, and a runner's verify steps run as one native call per
layer with the logits and greedy tokens of the per-op path; a prompt's first chunk keeps the prefill path."""

from __future__ import annotations

import pytest
import torch

from tests.runner.test_native_layers import WRAPPED, _count_native_calls, _runner
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.native.layers import MAX_QUERY_ROWS, NativeDecoderLayer
from tgi_paged_kernels.cpu_native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")


@pytest.mark.parametrize("name", sorted(n for n, count in WRAPPED.items() if count))
def test_every_native_form_proves_its_verify_step(family_dir, name) -> None:
    runner = _runner(family_dir(name))
    layers = [m for m in runner.model.modules() if isinstance(m, NativeDecoderLayer)]
    assert layers and all(layer.verify_steps for layer in layers)
    assert runner.native_layers is not None and not any("verify" in line for line in runner.native_layers.kept)


def _verify(runner: ModelRunner, prompts: list[list[int]], drafts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill, then two verify steps (each request's last token plus its draft): the logits of every row."""
    blocks = 8
    runner.allocate_kv_cache(len(prompts) * blocks + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(prompts))]
    first = [RequestChunk(p, 0, t) for p, t in zip(prompts, tables)]
    logits = [runner.forward(build_forward_batch(first, 4))]
    lengths = [len(p) for p in prompts]
    for _ in range(2):
        last = logits[-1].argmax(dim=-1).tolist()
        chunks = [
            RequestChunk([token, *draft], n, t, all_logits=True)
            for token, draft, n, t in zip(last[-len(prompts) :], drafts, lengths, tables)
        ]
        logits.append(runner.forward(build_forward_batch(chunks, 4)))
        lengths = [n + 1 + len(d) for n, d in zip(lengths, drafts)]
    return logits


@pytest.mark.parametrize("name", ["Llama", "Mistral", "Qwen3", "Gemma3", "Cohere", "Phi", "Falcon", "Mixtral"])
def test_verify_steps_run_natively_with_the_per_op_logits(family_dir, monkeypatch, name) -> None:
    """Rows of 4, 1 and 3 per request (Mistral's and Gemma 3's windows of 8 are passed on the way)."""
    path = family_dir(name)
    prompts = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2], [12, 4]]
    drafts = [[5, 9, 1], [], [2, 2]]
    runner = _runner(path)
    calls = _count_native_calls(monkeypatch)  # from now on: not the load-time checks' calls
    native = _verify(runner, prompts, drafts)
    assert calls == [8] * (2 * 2)  # both verify steps of both layers, one call each; the prefill per op
    plain = _verify(_runner(path, native_layers=False), prompts, drafts)
    for got, expected in zip(native, plain):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))


def test_long_rows_and_first_chunks_keep_the_prefill_path(family_dir, monkeypatch) -> None:
    runner = _runner(family_dir("Llama"))
    runner.allocate_kv_cache(20)
    calls = _count_native_calls(monkeypatch)
    runner.forward(build_forward_batch([RequestChunk([1, 2, 3], 0, [1, 2])], 4))  # a prompt: no context
    runner.forward(build_forward_batch([RequestChunk(list(range(MAX_QUERY_ROWS + 1)), 3, list(range(3, 9)))], 4))
    assert calls == []
    runner.forward(build_forward_batch([RequestChunk(list(range(MAX_QUERY_ROWS)), 3, list(range(3, 9)))], 4))
    assert calls == [MAX_QUERY_ROWS] * 2
