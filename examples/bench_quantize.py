"""Weight bytes and KV blocks gained under ``--quantize`` on a real model (default SmolLM2-135M).

Loads the model on the CPU in the serving dtype (default float16, as on a GPU), unquantized and with
``--quantize fp8``, and prints what ``ModelRunner.weights_bytes`` (the figure Warmup subtracts from
the CUDA KV budget and ``tgi_paged_weights_bytes`` reports) is for each, then the physical blocks the
saved bytes buy at the given block size (what the pool gains on a GPU, where the budget is
``memory_fraction x total - weights - activations``). compressed-tensors FP8 checkpoints hold the same
bytes (same ``Fp8Linear`` modules). A few seconds.

``--int`` also writes GPTQ int4 (groups of ``--group-size``), AWQ int4 and compressed-tensors
pack-quantized int8 (per channel) checkpoints of the model with the tests' quantizer
(``tests/helpers/int_checkpoints.py``; the numbers are the layout's bytes, not a quality claim) into a
temporary directory and loads each (about a minute more).

Usage::

    python examples/bench_quantize.py [--model DIR] [--dtype float16] [--block-size 16] [--step-time]
                                      [--int [--group-size 64]]
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
    parser.add_argument(
        "--step-time",
        action="store_true",
        help="also time one CPU decode step of 8 requests (fp8 dequantizes every linear on the fly)",
    )
    parser.add_argument("--int", action="store_true", help="also GPTQ int4, AWQ int4, compressed-tensors int8")
    parser.add_argument(
        "--group-size",
        type=int,
        default=64,
        help="groups of the int4 checkpoints (must divide every linear's in_features)",
    )
    args = parser.parse_args()

    from loguru import logger

    from tgi_paged_backend.config import CacheConfig, ModelConfig
    from tgi_paged_backend.runner.model_runner import ModelRunner

    logger.remove()
    if args.model is None:
        from integration.smollm2 import ensure_smollm2

        args.model = str(ensure_smollm2())
    import tempfile

    cases = [("none", args.model, None), ("fp8", args.model, None)]
    tmp = tempfile.TemporaryDirectory()
    if args.int:
        from tests.helpers.int_checkpoints import write_int_checkpoint

        g = args.group_size
        for name, fmt, options in (
            (f"gptq int4 g{g}", "gptq", dict(bits=4, group_size=g, sym=True)),
            (f"awq int4 g{g}", "awq", dict(group_size=g)),
            ("ct int8 channel", "pack-quantized", dict(bits=8, group_size=-1, sym=True)),
        ):
            cases.append(
                (name, str(write_int_checkpoint(Path(args.model), Path(tmp.name) / fmt, fmt, **options).path), fmt)
            )
    flags = {None: None, "gptq": "gptq", "awq": "awq", "pack-quantized": "compressed-tensors"}
    rows = {}
    for name, model_dir, fmt in cases:
        quantize = "fp8" if name == "fp8" else flags[fmt]
        runner = ModelRunner(
            ModelConfig(model_id=model_dir, quantize=quantize, dtype=args.dtype),
            CacheConfig(block_size=args.block_size),
            "cpu",
        )
        rows[name] = (runner.weights_bytes, runner.block_bytes)
        if args.step_time:
            print(
                f"--quantize {quantize or 'none'} ({name}): CPU decode step of 8 requests "
                f"{decode_step_ms(runner):.1f} ms"
            )
        del runner
    tmp.cleanup()
    plain, block_bytes = rows["none"]
    print(
        f"model {Path(args.model).name}, dtype {args.dtype}, block of {args.block_size} tokens = "
        f"{block_bytes:,} bytes of KV"
    )
    print(f"{'weights':<18}{'weights bytes':>16}{'MiB':>10}{'vs unquantized':>16}{'KV blocks gained':>18}")
    for name, (weights, _) in rows.items():
        gained = (plain - weights) // block_bytes
        print(
            f"{name:<18}{weights:>16,}{weights / 2**20:>10.1f}{weights / plain:>15.1%}"
            f"{f'+{gained:,}' if name != 'none' else '':>18}"
        )


if __name__ == "__main__":
    main()
