"""The static decode step is capture-safe and exact, proven on CPU (issue 21, item 3).

- Tracing: ``torch.compile(fullgraph=True)`` traces the static decode forward of every bucket with no
  graph break (fullgraph raises on one) and compiles exactly once per bucket, with the fixed-width
  block tables a CUDA graph captures; refilled buffers of other batches reuse those graphs.
- Replay: the static buffers refilled step after step (decode batches of varying size, padded to the
  buckets, larger ones eager) give the same greedy tokens as the eager path, through
  ``ModelRunner.forward``, for full attention, sliding windows and soft-capping.
- The pure parts: bucket choice, padding rows, the runner's defaults on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers.paged_driver import PagedDriver, greedy_paged
from tests.helpers.static_decode_stand_ins import CountingBackend, fake_cuda_graphs
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.static import setup as static_setup
from tgi_paged_backend.runner.static.decode_step import (
    VIEW_NAMES,
    StaticDecodeInputs,
    blocks_per_request,
    choose_bucket,
)

BUCKETS = (1, 2, 4)
MAX_SEQ_LEN = 96
"""Longest request of these tests (prompt + new tokens < 96): 12 blocks of 8 per request."""
PROMPT_LENGTHS = (5, 17, 33, 41, 9)
ARRIVALS = (0, 3, 4, 9, 11)
"""Staggered arrivals and different prompt lengths: decode steps of 1 to 5 rows (5 runs eagerly)."""


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, 320, n).tolist() for n in PROMPT_LENGTHS]


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(ModelConfig(model_id=str(path), cuda_graphs=(1, 2, 4)), CacheConfig(block_size=8), "cpu")


def _decode_batch(lengths: list[int], block_size: int = 8, first_block: int = 1):
    """A decode batch (one new token per request) over consecutive blocks from ``first_block``."""
    chunks, block = [], first_block
    for i, length in enumerate(lengths):
        n = -(-length // block_size)
        chunks.append(RequestChunk([10 + i], length - 1, list(range(block, block + n))))
        block += n
    return build_forward_batch(chunks, block_size)


def test_choose_bucket_takes_the_smallest_that_holds_the_batch() -> None:
    buckets = (1, 2, 4, 8, 16, 32)
    assert [choose_bucket(buckets, b) for b in (1, 2, 3, 5, 8, 9, 31, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert choose_bucket(buckets, 33) is None
    assert choose_bucket((4,), 1) == 4
    assert blocks_per_request(96, 8) == 12 and blocks_per_request(97, 8) == 13 and blocks_per_request(1, 16) == 1


def test_fill_copies_the_batch_and_makes_the_other_rows_harmless_padding() -> None:
    inputs = StaticDecodeInputs(max_batch=4, max_blocks=6, device=torch.device("cpu"))
    inputs.fill(_decode_batch([20, 30, 12]), bucket=4, width=6)  # 3 rows, tables 4 wide
    inputs.fill(_decode_batch([9, 17], first_block=40), bucket=4, width=6)  # fewer rows, narrower: no leftovers
    views = dict(zip(VIEW_NAMES, inputs.views(4, 6), strict=True))
    assert views["input_ids"].tolist() == [10, 11, 0, 0]
    assert views["positions"].tolist() == [8, 16, 0, 0]
    assert views["slot_mapping"].tolist() == [40 * 8 + 8, 44 * 8 + 0, 0, 0]  # padding writes slot 0 (scratch)
    assert views["seq_lens"].tolist() == [9, 17, 1, 1]  # padding attends over its own position only
    assert views["block_tables"].tolist() == [[40, 41, 0, 0, 0, 0], [42, 43, 44, 0, 0, 0]] + [[0] * 6] * 2
    assert views["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    assert views["logits_indices"].tolist() == [0, 1, 2, 3]
    assert inputs.views(4, 6)[0] is views["input_ids"]  # the same views each call: what a graph reads
    narrow = inputs.views(2, 3)[VIEW_NAMES.index("block_tables")]
    assert narrow.is_contiguous() and narrow.shape == (2, 3)
    with pytest.raises(ValueError, match="does not fit"):
        inputs.fill(_decode_batch([9, 9, 9]), bucket=2, width=6)


def test_on_cpu_the_runner_keeps_decode_eager_unless_asked(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir)
    assert runner.profile_decode_graphs(MAX_SEQ_LEN) == 0 and runner.graph_bytes == 0
    runner.allocate_kv_cache(32)
    runner.prepare_static_decode(MAX_SEQ_LEN)  # CUDA_GRAPHS set, but no CUDA device: nothing to capture
    assert runner.static_decode is None
    runner.prepare_static_decode(MAX_SEQ_LEN, mode="eager")  # buckets default to CUDA_GRAPHS
    assert runner.static_decode is not None and runner.static_decode.buckets == (1, 2, 4)
    runner.allocate_kv_cache(32)  # a new pool: graphs of the old one must never replay
    assert runner.static_decode is None


def test_the_graphs_memory_comes_out_of_the_kv_budget(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    fake = SimpleNamespace(
        device=torch.device("cuda", 0), weights_bytes=2**30, num_blocks=0, block_bytes=2**20,
        activation_peak_bytes=2**20, graph_bytes=0,
    )  # fmt: skip
    without = ModelRunner.available_kv_bytes(fake, 0.9)  # type: ignore[arg-type]
    fake.graph_bytes = 300 * 2**20  # what profile_decode_graphs measured
    assert without - ModelRunner.available_kv_bytes(fake, 0.9) == 300 * 2**20  # type: ignore[arg-type]


def test_compile_traces_every_bucket_once_with_no_graph_break(tiny_model_factory: Callable[..., Path]) -> None:
    runner = _runner(tiny_model_factory("llama", num_hidden_layers=2))
    runner.allocate_kv_cache(64)
    torch._dynamo.reset()
    counters.clear()
    backend = CountingBackend()
    step = static_setup.static_step(runner, runner.k_caches, runner.v_caches, max_seq_len=MAX_SEQ_LEN, buckets=BUCKETS)
    step.compile(backend=backend)  # fullgraph=True: a graph break would raise here
    assert len(backend.graphs) == len(BUCKETS)
    for lengths in ([9], [40, 3], [17, 25, 8], [70, 1, 33, 12], [5]):  # refilled buffers, every bucket
        assert step.run(_decode_batch(lengths)) is not None
    assert len(backend.graphs) == len(BUCKETS)  # no recompilation
    assert step.counts == {1: 2, 2: 1, 4: 2}
    assert not counters["graph_break"]
    traced = backend.graphs[-1].graph
    assert not any(n.op == "call_function" and "nonzero" in str(n.target) for n in traced.nodes)


def _static_from_first_step(mode: str, **options) -> Callable[[PagedDriver], None]:
    def hook(driver: PagedDriver) -> None:
        if driver.step_index == 0:  # the driver allocated its pool: set up the step over it
            driver.runner.prepare_static_decode(MAX_SEQ_LEN, mode=mode, buckets=BUCKETS, **options)

    return hook


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])  # full, sliding window 24, soft-cap + window 8
def test_replays_give_the_eager_paths_tokens(kind: str, tiny_model_factory, prompts) -> None:
    runner = _runner(tiny_model_factory(kind))
    eager = greedy_paged(runner, prompts, 16, arrival_steps=ARRIVALS, num_blocks=64)
    assert runner.static_decode is None
    static = greedy_paged(
        runner,
        prompts,
        16,
        arrival_steps=ARRIVALS,
        num_blocks=64,
        hook=_static_from_first_step("eager", fixed_width=True),
    )
    assert static == eager
    step = runner.static_decode
    assert step is not None and step.fixed_width and all(step.counts[b] > 0 for b in BUCKETS)


def test_graph_capture_plumbing_replays_the_refilled_buffers(monkeypatch, tiny_model_factory, prompts) -> None:
    graphs = fake_cuda_graphs(monkeypatch)
    runner = _runner(tiny_model_factory("llama", num_hidden_layers=2))
    eager = greedy_paged(runner, prompts, 16, arrival_steps=ARRIVALS, num_blocks=64)
    hook = _static_from_first_step("graphs")
    assert greedy_paged(runner, prompts, 16, arrival_steps=ARRIVALS, num_blocks=64, hook=hook) == eager
    step = runner.static_decode
    assert step is not None and step.fixed_width and len(graphs) == len(BUCKETS)
    assert [g.out.shape[0] for g in graphs] == [4, 2, 1]  # largest first, one shared pool
    assert sum(g.replays for g in graphs) == sum(step.counts.values()) > 0


def test_tgi_paged_compile_serves_cpu_decode_through_one_graph(tiny_model_factory, prompts) -> None:
    path = tiny_model_factory("llama", num_hidden_layers=2)
    eager = greedy_paged(_runner(path), prompts, 16, arrival_steps=ARRIVALS, num_blocks=64)
    runner = ModelRunner(ModelConfig(model_id=str(path), compile_decode=True), CacheConfig(block_size=8), "cpu")
    assert runner.fast_layers is not None and runner.fast_layers.packed_linears > 0  # traced as an opaque op
    torch._dynamo.reset()
    backend = CountingBackend()

    def hook(driver: PagedDriver) -> None:
        if driver.step_index == 0:  # what Warmup does, with a fast backend instead of inductor
            driver.runner.prepare_static_decode(MAX_SEQ_LEN, backend=backend)

    assert greedy_paged(runner, prompts, 16, arrival_steps=ARRIVALS, num_blocks=64, hook=hook) == eager
    step = runner.static_decode
    assert step is not None and step.buckets == tuple(range(2, 257)) and not step.fixed_width
    assert len(backend.graphs) == 1  # rows 2..5 and every table width: one graph
    assert step.counts[2] > 0 and step.counts[5] > 0  # one row padded to two; five rows as they are
