"""Start and shut down a two-rank group, round after round (``python -m tests.distributed.tp_shutdown_worker N``).

The parent imports torch once and forks both ranks of every round (no other thread runs in it when it
forks; ``OMP_NUM_THREADS=1``), so a round costs a rendezvous instead of two torch imports. Each rank
joins the real :class:`TensorParallelGroup`, beats the heartbeat every millisecond (so it is nearly
always inside a gloo all-reduce), runs a burst of model and control collectives and shuts down, the
two ranks taking turns at going first. The way out cycles through the three a shard has:
``mark_shutting_down`` then ``close`` (SIGTERM), ``close`` alone (the end of ``tp_worker``), and no
``close`` at all (the atexit hook). Every rank then leaves through the interpreter's normal
finalization, which is where a heartbeat or gloo thread still running aborts the process; so that the
outcome does not rest on the race alone, a last atexit hook also checks that the shutdown left no
thread but the main one (else exit code :data:`THREADS_LEFT_EXIT`). The parent prints one JSON line:
each round's two exit codes (-6 is SIGABRT, -9 a rank killed after :data:`ROUND_TIMEOUT_S`).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # no OpenMP pool: the parent forks, the check counts threads

import torch  # noqa: E402

from integration.net import free_port  # noqa: E402  (imports only socket: no thread before the forks)
from tgi_paged_backend.config import ServerConfig  # noqa: E402
from tgi_paged_backend.runner.parallel.process_group import TensorParallelGroup, mark_shutting_down  # noqa: E402

WORLD_SIZE = 2
ROUND_TIMEOUT_S = 60.0
"""A round's ranks still running after this long are killed (a hang fails the test, never blocks it)."""
EXITS = ("sigterm", "close", "atexit")
THREADS_LEFT_EXIT = 3


def check_only_the_main_thread_is_left() -> None:
    """At exit, after the group's own hook: the heartbeat, gloo and TCPStore threads are all gone (a
    joined Python thread may linger in the kernel's list for a moment)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return
    deadline = time.monotonic() + 2.0
    while len(names := _thread_names(tasks)) > 1:
        if time.monotonic() > deadline:
            print(f"threads left at exit: {names}", file=sys.stderr, flush=True)
            os._exit(THREADS_LEFT_EXIT)
        time.sleep(0.01)


def _thread_names(tasks: Path) -> list[str]:
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # exited meanwhile
            pass
    return sorted(names)


def run_rank(rank: int, port: int, round_: int) -> None:
    atexit.register(check_only_the_main_thread_is_left)  # before initialize(): runs after the group's hook
    server = ServerConfig(
        rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1", master_port=port, dist_timeout_s=20
    )
    group = TensorParallelGroup.initialize(server, torch.device("cpu"), startup_timeout_s=ROUND_TIMEOUT_S)
    group.start_heartbeat(interval_s=0.001)
    t = torch.ones(256)
    for step in range(10):
        group.all_reduce_(t)
        group.min_int(step, "the test's control collective")
    group.all_gather_ints([rank, round_], "the test's last collective")
    if rank != round_ % WORLD_SIZE:
        time.sleep(0.02)  # the other rank shuts down first
    how = EXITS[round_ % len(EXITS)]
    if how == "sigterm":
        mark_shutting_down()
    if how != "atexit":
        group.close()


def fork_rank(rank: int, port: int, round_: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        run_rank(rank, port, round_)
        code = 0
    except BaseException:  # noqa: BLE001 - reported on stderr, exit 1
        traceback.print_exc()
    sys.exit(code)  # unwinds into the interpreter's normal exit (atexit, finalization), as a shard's does


def wait_exit(pid: int, deadline: float) -> int:
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main() -> None:
    rounds = int(sys.argv[1])
    codes: list[list[int]] = []
    for round_ in range(rounds):
        port = free_port()
        pids = [fork_rank(rank, port, round_) for rank in range(WORLD_SIZE)]
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        codes.append([wait_exit(pid, deadline) for pid in pids])
    print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    main()
