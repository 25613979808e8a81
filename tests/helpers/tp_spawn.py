"""Two gloo ranks of a worker module: the one way the tensor-parallel tests start them and read the result
(:func:`run_tp_workers` for ``tests/distributed/tp_worker.py``: plain, quantized, the family matrix; the
engine-level LoRA and preemption tests pass their own module to :func:`run_two_ranks`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from integration.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_two_ranks(
    module: str, args: Sequence[str], out: Path, *, env: dict[str, str] | None = None, timeout_s: float = 150
) -> dict:
    """Start ``python -m module --rank R --port P *args --out out`` for ranks 0 and 1 (gloo, one free port),
    wait for both, and return the JSON rank 0 wrote to ``out``; both ranks must exit 0 (else their log tails).

    Each rank logs to a file beside ``out`` (``<out stem>.rank<R>.log``), not to a pipe: a pipe read only once
    the other rank has exited fills up (64 KiB) and blocks its rank mid-step, and the peer then times out
    in the next collective."""
    port = free_port()
    log_paths = [out.parent / f"{out.stem}.rank{rank}.log" for rank in range(2)]
    procs = []
    for rank, log_path in enumerate(log_paths):
        with log_path.open("w") as log:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, "--rank", str(rank), "--port", str(port), *args, "--out", str(out)],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                )
            )
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            p.kill()
            p.wait()
    logs = [path.read_text(errors="replace") for path in log_paths]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    return json.loads(out.read_text())


def run_tp_workers(
    models: Sequence[Path | str],
    prompts: list[list[int]],
    max_new: int,
    out: Path,
    *,
    extra_args: Sequence[str] = (),
    timeout_s: float = 150,
) -> dict:
    """Rank 0's JSON result (``{model: {"tokens", "sizes"} | {"refused"}}``) of ``tests/distributed/tp_worker.py``."""
    args = ["--world-size", "2", "--prompts", json.dumps(prompts), "--max-new", str(max_new), *extra_args]
    return run_two_ranks("tests.distributed.tp_worker", [*args, *map(str, models)], out, timeout_s=timeout_s)
