"""torch.distributed for tensor-parallel shards: the process groups, control collectives, peer loss.

Under ``text-generation-launcher --num-shard N`` every rank is its own ``text-generation-server serve``
process with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (parsed into
:class:`~tgi_paged_backend.config.ServerConfig`). :meth:`TensorParallelGroup.initialize` forms three
groups over one TCPStore rendezvous on ``MASTER_ADDR:MASTER_PORT``:

- the **model** group (the default process group): NCCL on CUDA, gloo on CPU. Only the row-parallel
  all-reduces inside the forward use it (:meth:`TensorParallelGroup.all_reduce_`).
- a **control** group (gloo, CPU tensors): the small collectives the engine thread issues between
  forwards (Warmup's pool size, the preemption-cost calibration, the per-step consistency check), so
  they never wait on the device stream.
- a **heartbeat** group (gloo), used only by a background thread, so a rank notices a dead peer even
  while no RPC runs.

Rendezvous and the post-load barrier wait up to :data:`STARTUP_TIMEOUT_S` (ranks load at different
speeds; the launcher itself has no start-up timeout). Every collective after that waits at most
``ServerConfig.dist_timeout_s`` (``TGI_PAGED_DIST_TIMEOUT_S``, default 30 s).

Failure rule: a failed collective means the group is broken -- a peer died, hung longer than the
timeout, or the ranks lost step -- and nothing can be repaired in place. The rank logs one clear
error, removes its socket and exits with :data:`EXIT_CODE`, so the launcher tears the deployment down
instead of every rank hanging. During a graceful shutdown (:func:`mark_shutting_down`, called when the
server got SIGTERM) peers going away is expected: the failure only raises :class:`PeerLostError`.

Shutdown (:meth:`TensorParallelGroup.close`, also registered with :mod:`atexit`) stops and joins the
heartbeat thread, then destroys the groups -- heartbeat, control, model: the reverse of their creation,
on every rank -- and drops the store. The order matters. The groups' C++ threads (gloo's workers, which
drop the last reference to a finished collective's tensors) and the heartbeat thread (inside a gloo
all-reduce with the GIL released) must be gone before the interpreter finalizes: a thread that needs
the GIL after finalization began is ended by CPython with ``pthread_exit``, whose unwinding through a
``noexcept`` C++ destructor calls ``std::terminate`` ("terminate called without an active exception",
SIGABRT). Joining first is what makes destroying safe: a gloo group's destructor waits for its
collective in flight. Every wait is bounded by the collective timeout.
"""

from __future__ import annotations

import atexit
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from loguru import logger

from tgi_paged_backend.config import ServerConfig

STARTUP_TIMEOUT_S = 3600.0
"""How long rendezvous and the post-load barrier wait for the slowest rank."""
HEARTBEAT_INTERVAL_S = 1.0
"""Pause between two heartbeat all-reduces."""
SHUTDOWN_GRACE_S = 5.0
"""After a collective fails, how long to wait for this rank's own SIGTERM (or :meth:`close`) before calling
it a crash (the launcher signals all shards within a fraction of a second; a peer may exit first)."""
EXIT_CODE = 1
"""Exit status of a rank that lost its group."""

_shutting_down = threading.Event()


def mark_shutting_down() -> None:
    """This process is shutting down on purpose (SIGTERM): peers leaving is no longer an error."""
    _shutting_down.set()


def is_shutting_down() -> bool:
    return _shutting_down.is_set()


class DistributedError(RuntimeError):
    """The tensor-parallel group cannot be formed or used."""


class PeerLostError(DistributedError):
    """A collective failed while this rank was shutting down anyway."""


class RankMismatchError(DistributedError):
    """The ranks are about to run different steps (RPCs reached them in a different order). Every rank
    detects it at the same collective and fails the same RPC, so their states stay identical."""


def _store_barrier(store: dist.Store, name: str, rank: int, world_size: int, timeout: timedelta) -> None:
    store.set(f"tgi_paged/barrier/{name}/{rank}", "1")
    store.wait([f"tgi_paged/barrier/{name}/{r}" for r in range(world_size)], timeout)


class TensorParallelGroup:
    """This rank's view of the tensor-parallel group (see the module docstring)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        backend: str,
        timeout_s: float,
        store: dist.Store | None,
        control_group: Any,
        heartbeat_group: Any,
        model_group: Any = None,
        socket_path: str | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
        owns_process_groups: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self.model_group = model_group
        """``None``: the default process group."""
        self.control_group = control_group
        self.heartbeat_group = heartbeat_group
        self.socket_path = socket_path
        self._store = store
        self._exit_fn = exit_fn
        self._owns_process_groups = owns_process_groups
        """Whether :meth:`close` destroys the groups (those :meth:`initialize` created)."""
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None

    @classmethod
    def initialize(
        cls, server: ServerConfig, device: torch.device, *, startup_timeout_s: float = STARTUP_TIMEOUT_S
    ) -> TensorParallelGroup:
        """Join the group of ``server.world_size`` ranks (blocks until every rank has joined)."""
        rank, world_size = server.rank, server.world_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        where = f"MASTER_ADDR={server.master_addr} MASTER_PORT={server.master_port}"
        startup = timedelta(seconds=startup_timeout_s)
        logger.info(f"Tensor parallel: rank {rank}/{world_size} joining the {backend} group at {where}")
        try:
            store = dist.TCPStore(
                server.master_addr,
                server.master_port,
                world_size,
                is_master=rank == 0,
                timeout=startup,
                wait_for_workers=False,
            )
            _store_barrier(store, "joined", rank, world_size, startup)
        except Exception as err:  # noqa: BLE001 - one clear line naming the rendezvous
            raise DistributedError(
                f"tensor-parallel rank {rank}/{world_size}: rendezvous at {where} failed: {type(err).__name__}: {err}"
            ) from err
        timeout = timedelta(seconds=server.dist_timeout_s)
        kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        control = dist.new_group(backend="gloo", timeout=timeout)
        heartbeat = dist.new_group(backend="gloo", timeout=timeout)
        logger.info(
            f"Tensor parallel: rank {rank}/{world_size} joined ({backend}, collective timeout "
            f"{server.dist_timeout_s:g} s)"
        )
        group = cls(
            rank=rank,
            world_size=world_size,
            device=device,
            backend=backend,
            timeout_s=server.dist_timeout_s,
            store=store,
            control_group=control,
            heartbeat_group=heartbeat,
            socket_path=os.path.abspath(server.socket_path),
            owns_process_groups=True,
        )
        atexit.register(group.close)  # any normal exit, also one that never reached close()
        return group

    # -- collectives ----------------------------------------------------------------------------

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (model group; the row-parallel layers' hot path)."""
        try:
            dist.all_reduce(tensor, group=self.model_group)
        except Exception as err:  # noqa: BLE001 - any failure breaks the group
            self.fail("the forward's all-reduce", err)
        return tensor

    def min_int(self, value: int, what: str) -> int:
        """The smallest ``value`` over the ranks (control group)."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        self._control(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group))
        return int(t.item())

    def max_float(self, value: float, what: str) -> float:
        """The largest ``value`` over the ranks (control group)."""
        t = torch.tensor([float(value)], dtype=torch.float64)
        self._control(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group))
        return float(t.item())

    def all_gather_ints(self, values: Sequence[int], what: str) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), in rank order (control group)."""
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._control(what, lambda: dist.all_gather(out, t, group=self.control_group))
        return [o.tolist() for o in out]

    def startup_barrier(self, name: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait (store-based, long timeout) until every rank reached ``name``: e.g. after loading."""
        if self._store is None:
            return
        try:
            _store_barrier(self._store, name, self.rank, self.world_size, timedelta(seconds=timeout_s))
        except Exception as err:  # noqa: BLE001
            raise DistributedError(
                f"tensor-parallel rank {self.rank}/{self.world_size}: waiting for the "
                f"other ranks at {name!r} failed: {type(err).__name__}: {err}"
            ) from err

    def _control(self, what: str, op: Callable[[], Any]) -> None:
        try:
            op()
        except Exception as err:  # noqa: BLE001 - any failure breaks the group
            self.fail(what, err)

    # -- failure and lifetime -------------------------------------------------------------------

    def fail(self, what: str, err: BaseException | str) -> NoReturn:
        """The group is broken: exit the process (or raise :class:`PeerLostError` while shutting down)."""
        detail = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        message = (
            f"tensor-parallel rank {self.rank}/{self.world_size}: {what} failed ({detail}). A peer rank "
            f"died, stalled for more than TGI_PAGED_DIST_TIMEOUT_S={self.timeout_s:g} s, or the ranks "
            "lost step; the group cannot recover"
        )
        cause = err if isinstance(err, BaseException) else None
        if self._leaving_anyway():
            raise PeerLostError(message + " (shutting down)") from cause
        logger.error(message + f": shard exiting with code {EXIT_CODE}")
        self._remove_socket()
        self._exit_fn(EXIT_CODE)
        raise PeerLostError(message) from cause  # only reached when exit_fn returns (tests)

    def start_heartbeat(self, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Background all-reduces on the heartbeat group; a dead or stalled peer ends this process."""
        if self._heartbeat is not None:
            return

        group = self.heartbeat_group

        def beat() -> None:
            t = torch.zeros(1, dtype=torch.int32)
            while not self._closed.is_set() and not _shutting_down.is_set():
                try:
                    dist.all_reduce(t, group=group)
                except Exception as err:  # noqa: BLE001
                    try:
                        self.fail("the heartbeat", err)
                    except PeerLostError:
                        pass
                    return
                self._closed.wait(interval_s)

        self._heartbeat = threading.Thread(target=beat, name="tgi-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self) -> None:
        """Stop and join the heartbeat, then destroy the process groups (see "Shutdown" in the module
        docstring). Idempotent; collectives fail afterwards."""
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        atexit.unregister(self.close)
        if not self._join_heartbeat():
            return
        if self._owns_process_groups:
            self._destroy_process_groups()

    def _join_heartbeat(self) -> bool:
        thread = self._heartbeat
        if thread is None or thread is threading.current_thread():
            return True
        # Its all-reduce in flight ends within the collective timeout (a peer that closed its groups
        # fails it at once), then fail() sees the group closed and returns.
        limit_s = self.timeout_s + SHUTDOWN_GRACE_S
        thread.join(limit_s)
        if thread.is_alive():
            logger.warning(
                f"tensor-parallel rank {self.rank}/{self.world_size}: the heartbeat did not stop "
                f"within {limit_s:g} s; leaving the process groups to process exit"
            )
            return False
        return True

    def _destroy_process_groups(self) -> None:
        """Heartbeat, control, then the model group, then the store (its last users were the groups)."""
        for what in ("heartbeat", "control", "model"):
            self._destroy(what, f"{what}_group")
        self._store = None  # on rank 0 this stops the store's server

    def _destroy(self, what: str, attr: str) -> None:
        """Destroy the group in ``attr`` (``None``: the default group). Its C++ threads are joined when
        its last reference, ``group`` here, goes: on return."""
        group = getattr(self, attr)
        setattr(self, attr, None)
        try:
            if group is not None or dist.is_initialized():
                dist.destroy_process_group(group)
        except Exception as err:  # noqa: BLE001 - shutting down anyway
            logger.warning(
                f"tensor-parallel rank {self.rank}/{self.world_size}: destroying the {what} group "
                f"failed: {type(err).__name__}: {err}"
            )

    def _leaving_anyway(self) -> bool:
        """Whether this rank is closed or shutting down, waiting up to :data:`SHUTDOWN_GRACE_S` for it."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while not (self._closed.is_set() or _shutting_down.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _shutting_down.wait(min(left, 0.05))
        return True

    def _remove_socket(self) -> None:
        path = self.socket_path
        if not path:
            return
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass
