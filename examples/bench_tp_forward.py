"""One CPU decode step at tensor parallel 2 (two gloo ranks on this host), native decode layers against the per-op
path, alternated in the same two processes (``examples/bench_forward.py`` is one process, one shard).

Each rank builds two :class:`TensorParallelRunner` shards of the model: ``default`` (what serving runs: the
ranks' layers through the native parts with the all-reduces between them) and ``per-op``
(``TGI_PAGED_NATIVE_LAYERS=0``), runs the same decode batch (``--rows`` requests, contexts in 40..200, block 16)
through each, a step of each in turn for ``--steps`` rounds, and rank 0 prints median and min ms per step with
the host's CPU and load, and how many layers decoded natively.

    .venv/bin/python examples/bench_tp_forward.py [--model hostbound|smollm2|DIR] [--rows 20] [--threads 1]
        [--steps 20] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.net import free_port  # noqa: E402
from integration.peers.host import describe, host_info  # noqa: E402
from integration.peers.hostbound import ensure_hostbound_model  # noqa: E402
from tgi_paged_backend.bench.decode_step import random_decode_step  # noqa: E402
from tgi_paged_backend.config import CacheConfig, ModelConfig, ServerConfig  # noqa: E402
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer  # noqa: E402
from tgi_paged_backend.runner.parallel.process_group import TensorParallelGroup  # noqa: E402
from tgi_paged_backend.runner.parallel.tp_runner import TensorParallelRunner  # noqa: E402

BLOCK_SIZE = 16
WORLD_SIZE = 2
SMOLLM2 = Path.home() / ".cache" / "tgi-paged-backend" / "SmolLM2-135M-Instruct"
VARIANTS = ("default", "per-op")


def _model_dir(name: str) -> str:
    if name == "smollm2":
        return str(SMOLLM2)
    if name == "hostbound":
        return str(ensure_hostbound_model(Path("out/bench"), SMOLLM2))
    return name


def rank_main(args: argparse.Namespace) -> None:
    """One rank: both variants' shards, the same steps in turn; rank 0 prints."""
    torch.set_num_threads(args.threads)
    server = ServerConfig(
        rank=args.rank, world_size=WORLD_SIZE, master_addr="127.0.0.1", master_port=args.port, dist_timeout_s=120
    )
    group = TensorParallelGroup.initialize(server, torch.device("cpu"), startup_timeout_s=300)
    step = random_decode_step(args.rows, BLOCK_SIZE)
    runners = {}
    for variant in VARIANTS:
        config = ModelConfig(model_id=args.model, native_layers=variant == "default", dtype=args.dtype)
        runners[variant] = TensorParallelRunner(config, CacheConfig(block_size=BLOCK_SIZE), "cpu", group)
        runners[variant].allocate_kv_cache(step.num_blocks)
        for _ in range(3):
            runners[variant].forward(step.batch)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.steps):
        for variant, runner in runners.items():
            start = time.perf_counter()
            runner.forward(step.batch)
            times[variant].append(1000 * (time.perf_counter() - start))
    native = [m for m in runners["default"].model.modules() if isinstance(m, NativeDecoderLayer)]
    counts = group.all_gather_ints([len(native), sum(m.native_steps for m in native)], "bench")
    if args.rank == 0:
        print(describe(host_info(), args.dtype), f"load average {os.getloadavg()[0]:.2f}")
        print(
            f"decode step, {args.rows} rows, {Path(args.model).name} {args.dtype}, tensor parallel {WORLD_SIZE} "
            "(gloo), "
            f"{args.threads} thread(s) per rank, {args.steps} steps each, alternated; native layers "
            f"(layers, steps) per rank: {counts}"
        )
        first = statistics.median(times[VARIANTS[0]])
        for variant, ts in times.items():
            median = statistics.median(ts)
            print(f"  {variant:8s} median {median:7.2f} ms, min {min(ts):7.2f} ms  ({median / first:.2f}x default)")
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hostbound", help="hostbound, smollm2 or a model directory")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's --dtype")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    model, port = _model_dir(args.model), free_port()
    common = ["--model", model, "--rows", str(args.rows), "--threads", str(args.threads), "--steps", str(args.steps)]
    common += ["--dtype", args.dtype]
    procs = [
        subprocess.Popen([sys.executable, __file__, *common, "--rank", str(rank), "--port", str(port)])
        for rank in range(WORLD_SIZE)
    ]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
