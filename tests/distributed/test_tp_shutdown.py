"""Tensor-parallel shutdown never aborts: two ranks (``tests/distributed/tp_shutdown_worker.py``) are
started and shut down :data:`ROUNDS` times while CPU burners compete for the cores, and every rank
exits with code 0.

Under load a rank used to exit with SIGABRT ("terminate called without an active exception"): its
heartbeat thread, or a gloo worker thread dropping a finished collective's tensors, still needed the
GIL after the interpreter had begun finalizing (see "Shutdown" in
``tgi_paged_backend/runner/parallel/process_group.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 10
BURNERS = 1
"""A busy-looping process, as in the report (on a two-core box, as busy as the ranks)."""


def test_two_ranks_start_and_shut_down_cleanly_many_times_under_cpu_load() -> None:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS)]
    try:
        rounds = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.tp_shutdown_worker", str(ROUNDS)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
        try:
            out, err = rounds.communicate(timeout=300)  # the worker kills a round's ranks after 60 s
        finally:
            if rounds.poll() is None:
                os.killpg(rounds.pid, signal.SIGKILL)  # the worker and the ranks it forked
                rounds.wait()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()

    assert rounds.returncode == 0, err[-3000:]
    codes = json.loads(out.strip().splitlines()[-1])
    assert codes == [[0, 0]] * ROUNDS, (codes, err[-3000:])
