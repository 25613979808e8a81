"""One decode step, eager vs the static decode step compiled by inductor (``TGI_PAGED_COMPILE``), on CPU.

Two runners of the same model in one process: the default one (fast-layer swap, eager forward) and one
with plain layers whose static decode step is compiled (inductor cannot lower the swap's prepacked
oneDNN linears). Both run the same decode batch (``--rows`` requests, contexts drawn in 40..200, block
16) over their own pools, alternating ``--steps`` steps of each for ``--rounds`` rounds; prints the
compile time, the logits difference and the step times (median, min), with the load average.

    .venv/bin/python examples/bench_compiled_decode.py --model DIR [--rows 20] [--bucket N | --dynamic-rows]
        [--freezing] [--cpp-wrapper]

``--dynamic-rows`` compiles what ``TGI_PAGED_COMPILE=1`` serves (one graph for 2..256 rows); otherwise
one graph for ``--bucket`` rows (default: ``--rows``). docs/performance.md, "Compiled decode", has the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from tgi_paged_backend.bench.decode_step import random_decode_step
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.static.decode_step import CPU_COMPILE_BUCKETS

BLOCK_SIZE = 16


def _times(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _ms(times: list[float]) -> str:
    return f"median {1000 * statistics.median(times):.1f} ms, min {1000 * min(times):.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--bucket", type=int, default=None)
    parser.add_argument("--dynamic-rows", action="store_true")
    parser.add_argument("--freezing", action="store_true")
    parser.add_argument("--cpp-wrapper", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.freezing, inductor_config.cpp_wrapper = args.freezing, args.cpp_wrapper
    fast = ModelRunner(ModelConfig(model_id=args.model), CacheConfig(block_size=BLOCK_SIZE))
    plain = ModelRunner(ModelConfig(model_id=args.model, compile_decode=True), CacheConfig(block_size=BLOCK_SIZE))
    step = random_decode_step(args.rows, BLOCK_SIZE)
    batch = step.batch
    for runner in (fast, plain):
        runner.allocate_kv_cache(step.num_blocks)
    start = time.perf_counter()
    if args.dynamic_rows:
        plain.prepare_static_decode(256 * BLOCK_SIZE, mode="compile", buckets=CPU_COMPILE_BUCKETS, dynamic_rows=True)
    else:
        plain.prepare_static_decode(256 * BLOCK_SIZE, mode="compile", buckets=(args.bucket or args.rows,))
    compile_s = time.perf_counter() - start
    if plain.static_decode is None:
        raise SystemExit("the compile failed (see the warning above)")
    ref, out = fast.forward(batch), plain.forward(batch)
    same = bool((out.argmax(-1) == ref.argmax(-1)).all())
    print(
        f"compile {compile_s:.1f} s ({'rows 2..256' if args.dynamic_rows else f'{args.bucket or args.rows} rows'}, "
        f"freezing={args.freezing}, cpp_wrapper={args.cpp_wrapper}); max|dlogits| {(out - ref).abs().max():.2e}, "
        f"argmax same: {same}; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    eager, compiled = [], []
    for _ in range(2):
        fast.forward(batch), plain.forward(batch)
    for _ in range(args.rounds):
        eager += _times(lambda: fast.forward(batch), args.steps)
        compiled += _times(lambda: plain.forward(batch), args.steps)
    step, plain.static_decode = plain.static_decode, None
    unpacked = _times(lambda: plain.forward(batch), args.steps)
    plain.static_decode = step
    print(
        f"{args.rows} decode rows: eager (fast layers) {_ms(eager)} | compiled static step {_ms(compiled)} | "
        f"eager (plain layers) {_ms(unpacked)}; load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
