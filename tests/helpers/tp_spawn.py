"""Two gloo ranks of ``tests/distributed/tp_worker.py`` over some model directories: the one way the
tensor-parallel runner tests (plain, quantized, the family matrix) start them and read the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.shard_driving import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_tp_workers(
    models: Sequence[Path | str],
    prompts: list[list[int]],
    max_new: int,
    out: Path,
    *,
    extra_args: Sequence[str] = (),
    timeout_s: float = 150,
) -> dict:
    """Rank 0's JSON result (``{model: {"tokens", "sizes"} | {"refused"}}``); both ranks must exit 0."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.distributed.tp_worker",
                "--rank",
                str(rank),
                "--world-size",
                "2",
                "--port",
                str(port),
                "--prompts",
                json.dumps(prompts),
                "--max-new",
                str(max_new),
                "--out",
                str(out),
                *extra_args,
                *map(str, models),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())
