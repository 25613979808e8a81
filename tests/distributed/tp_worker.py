"""One tensor-parallel rank of the runner parity test (``python -m tests.distributed.tp_worker``).

Joins a gloo group of ``--world-size`` ranks, loads each model directory as a
:class:`TensorParallelRunner` shard and decodes the prompts greedily through the paged pool with the
test driver; rank 0 writes the generations and the per-rank pool sizes as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from tests.helpers.paged_driver import greedy_paged  # noqa: E402
from tgi_paged_backend.config import CacheConfig, ModelConfig, ServerConfig  # noqa: E402
from tgi_paged_backend.runner.cpu import fast_layers  # noqa: E402
from tgi_paged_backend.runner.model.loader import ModelLoadError  # noqa: E402
from tgi_paged_backend.runner.native import layers as native_layers  # noqa: E402
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer  # noqa: E402
from tgi_paged_backend.runner.parallel.process_group import TensorParallelGroup  # noqa: E402
from tgi_paged_backend.runner.parallel.tp_runner import TensorParallelRunner  # noqa: E402


def main() -> None:
    # Pack every linear, as the suite's in-process runners do (tests/conftest.py), so the weight bytes each
    # rank reports compare with an in-process single runner's.
    fast_layers.PACK_MIN_ELEMENTS = 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max-new", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--quantize", default=None, help="--quantize of every model (fp8, compressed-tensors, gptq, awq)"
    )
    parser.add_argument("--dtype", default=None, help="--dtype of every model (float32, bfloat16)")
    parser.add_argument(
        "--allow-refusal",
        action="store_true",
        help="record a model the slicing refuses (ModelLoadError) instead of failing",
    )
    parser.add_argument(
        "--native-check-fails-on",
        type=int,
        default=None,
        help="this rank's load-time check of the native decode layers fails (every rank must then keep them all)",
    )
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()

    server = ServerConfig(
        rank=args.rank, world_size=args.world_size, master_addr="127.0.0.1", master_port=args.port, dist_timeout_s=60
    )
    if args.native_check_fails_on == args.rank:
        native_layers.reproduces = lambda *_args, **_kwargs: False  # type: ignore[assignment]
    group = TensorParallelGroup.initialize(server, torch.device("cpu"), startup_timeout_s=120)
    prompts = json.loads(args.prompts)
    result: dict[str, dict] = {}
    for model in args.models:
        try:  # a refusal comes before any collective, the same on every rank
            runner = TensorParallelRunner(
                ModelConfig(model_id=model, quantize=args.quantize, **({"dtype": args.dtype} if args.dtype else {})),
                CacheConfig(block_size=8),
                "cpu",
                group,
            )
        except ModelLoadError as err:
            if not args.allow_refusal:
                raise
            result[model] = {"refused": str(err)}
            continue
        tokens = greedy_paged(runner, prompts, args.max_new, seed=args.rank)
        sizes = [runner.block_bytes, runner.spec.num_q_heads, runner.spec.num_kv_heads, runner.weights_bytes]
        native = [m for m in runner.model.modules() if isinstance(m, NativeDecoderLayer)]
        bf16 = sum(m.weights.weight_dtype == torch.bfloat16 for m in native)
        counts = [len(native), sum(m.native_steps for m in native), bf16]  # layers wrapped, native steps, bf16 ones
        result[model] = {
            "tokens": tokens,
            "sizes": group.all_gather_ints(sizes, "test"),
            "native": group.all_gather_ints(counts, "test"),
        }
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    group.close()


if __name__ == "__main__":
    main()
