"""Phase d of the GPU check: decode inter-token latency with and without the decode CUDA graphs.

In process, on the model phase b served: a :class:`ModelRunner` (``CUDA_GRAPHS`` at the launcher's
default buckets) prefills ``B`` requests of ``context`` tokens, then runs ``steps`` greedy decode steps
twice from the same state: eagerly, then through the graphs captured for the pool
(``ModelRunner.prepare_static_decode``). A step's time is what a decode step costs the engine here:
building the batch on the host, the forward, and reading the greedy tokens back (a device sync). Both
runs' tokens are compared: identical is expected; in bf16 a graph's padded shapes may pick another
split of the attention reduction, so a divergence is reported with its step, not failed.

On CPU (``--cpu``, the plumbing check) there are no CUDA graphs: the second run is the same static
step run eagerly (padded buffers, fixed-width tables), which must give identical tokens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tgi_paged_backend.config import LAUNCHER_CUDA_GRAPHS, CacheConfig, ModelConfig
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner

BLOCK_SIZE = 16


def _decode(runner: ModelRunner, batch_size: int, context: int, steps: int) -> tuple[list[float], list[list[int]]]:
    """Prefill ``batch_size`` requests of ``context`` tokens, then time ``steps`` greedy decode steps."""
    per_request = -(-(context + steps) // BLOCK_SIZE)
    tables = [list(range(1 + b * per_request, 1 + (b + 1) * per_request)) for b in range(batch_size)]
    prompts = [[(7 * b + 3 * i) % 1000 + 10 for i in range(context)] for b in range(batch_size)]
    logits = runner.forward(
        build_forward_batch([RequestChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BLOCK_SIZE)
    )
    last = logits.argmax(-1).tolist()
    times, tokens = [], [list(last)]
    for step in range(steps):
        start = time.perf_counter()
        chunks = [RequestChunk([tok], context + step, t) for tok, t in zip(last, tables, strict=True)]
        last = runner.forward(build_forward_batch(chunks, BLOCK_SIZE)).argmax(-1).tolist()
        times.append(time.perf_counter() - start)
        tokens.append(list(last))
    return times, tokens


def _first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            rows = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
            return f"first divergence at step {step} (rows {rows[:4]})"
    return "identical tokens"


def phase_graphs(
    model_dir: Path,
    device: torch.device,
    dtype: str,
    *,
    batch_sizes: Sequence[int] = (1, 8, 32),
    context: int = 256,
    steps: int = 24,
) -> bool:
    """Print decode ITL eager vs graphs per batch size; ``False`` when the graphs could not be captured
    (or, on CPU, when the static step's tokens differ from the eager ones)."""
    buckets = LAUNCHER_CUDA_GRAPHS
    config = ModelConfig(model_id=str(model_dir), dtype=dtype, cuda_graphs=buckets)
    runner = ModelRunner(config, CacheConfig(block_size=BLOCK_SIZE), device)
    max_seq_len = context + steps
    runner.allocate_kv_cache(1 + max(batch_sizes) * -(-max_seq_len // BLOCK_SIZE))
    cuda = device.type == "cuda"
    label = "graphs" if cuda else "static step, eager (CPU: no CUDA graphs)"
    start = time.perf_counter()
    runner.prepare_static_decode(max_seq_len, mode="graphs" if cuda else "eager", fixed_width=True)
    setup_s = time.perf_counter() - start
    if runner.static_decode is None:
        print("d. graphs: capture FAILED (see the warning above); decode stays eager")
        return False
    print(f"d. {label}: buckets {list(buckets)}, {runner.static_decode.inputs.max_blocks} blocks per request, "
          f"ready in {setup_s:.1f} s")  # fmt: skip
    step, ok = runner.static_decode, True
    for batch_size in batch_sizes:
        runner.static_decode = None
        eager_times, eager_tokens = _decode(runner, batch_size, context, steps)
        runner.static_decode = step
        before = dict(step.counts)
        static_times, static_tokens = _decode(runner, batch_size, context, steps)
        used = sum(step.counts.values()) - sum(before.values())
        eager_ms, static_ms = (1000 * statistics.median(t[2:]) for t in (eager_times, static_times))
        same = _first_divergence(eager_tokens, static_tokens)
        ok = ok and (cuda or same == "identical tokens") and used == steps
        print(
            f"d. decode ITL at batch {batch_size}, context {context}: eager {eager_ms:.2f} ms, {label} "
            f"{static_ms:.2f} ms ({eager_ms / static_ms:.2f}x); {used}/{steps} steps through the static step; {same}",
            flush=True,
        )
    return ok
