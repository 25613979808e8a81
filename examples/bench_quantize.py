"""Weight bytes and KV blocks gained under ``--quantize fp8`` on a real model (default SmolLM2-135M).

Loads the model twice on the CPU in the serving dtype (default float16, as on a GPU), unquantized and
with ``--quantize fp8``, and prints what ``ModelRunner.weights_bytes`` (the figure Warmup subtracts
from the CUDA KV budget and ``tgi_paged_weights_bytes`` reports) is for each, then the physical blocks
the saved bytes buy at the given block size (what the pool gains on a GPU, where the budget is
``memory_fraction x total - weights - activations``). compressed-tensors FP8 checkpoints hold the same
bytes (same ``Fp8Linear`` modules). A few seconds.

Usage::

    python examples/bench_quantize.py [--model DIR] [--dtype float16] [--block-size 16] [--step-time]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode_step_ms(runner, repeats: int = 5) -> float:
    """Best of ``repeats`` forwards of 8 one-token decodes at position 20 (after one warm-up)."""
    import time

    from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch

    per_request = -(-21 // runner.block_size)
    runner.allocate_kv_cache(per_request * 8 + 1)
    chunks = [RequestChunk([5], 20, list(range(1 + i * per_request, 1 + (i + 1) * per_request))) for i in range(8)]
    batch = build_forward_batch(chunks, runner.block_size)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - start)
    return 1000 * min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--step-time", action="store_true",
                        help="also time one CPU decode step of 8 requests (fp8 dequantizes every linear on the fly)")
    args = parser.parse_args()

    from loguru import logger

    from tgi_paged_backend.config import CacheConfig, ModelConfig
    from tgi_paged_backend.runner.model_runner import ModelRunner

    logger.remove()
    if args.model is None:
        from integration.smollm2 import ensure_smollm2

        args.model = str(ensure_smollm2())
    rows = {}
    for quantize in (None, "fp8"):
        runner = ModelRunner(ModelConfig(model_id=args.model, quantize=quantize, dtype=args.dtype),
                             CacheConfig(block_size=args.block_size), "cpu")
        rows[quantize] = (runner.weights_bytes, runner.block_bytes)
        if args.step_time:
            print(f"--quantize {quantize or 'none'}: CPU decode step of 8 requests {decode_step_ms(runner):.1f} ms")
    (plain, block_bytes), (fp8, _) = rows[None], rows["fp8"]
    print(f"model {Path(args.model).name}, dtype {args.dtype}, block of {args.block_size} tokens = "
          f"{block_bytes:,} bytes of KV")
    print(f"{'--quantize':<12}{'weights bytes':>16}{'MiB':>10}{'vs unquantized':>16}")
    for name, (weights, _) in (("none", rows[None]), ("fp8", rows["fp8"])):
        print(f"{name:<12}{weights:>16,}{weights / 2**20:>10.1f}{weights / plain:>15.1%}")
    saved = plain - fp8
    print(f"saved {saved:,} bytes = {saved // block_bytes:,} more KV blocks "
          f"({saved // block_bytes * args.block_size:,} tokens) on a GPU")


if __name__ == "__main__":
    main()
