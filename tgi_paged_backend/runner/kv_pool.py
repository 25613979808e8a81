"""The paged KV pool's tensors on one device and the CPU swap space beside it.

Per layer ``k_caches[i]`` and ``v_caches[i]``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A pool laid out for KV layer groups (:class:`~tgi_paged_backend.memory.layer_groups.LayerGroups`) holds
``layers_per_block`` slot tensors and each layer's cache is a view of its slot's (with one group, slot =
layer). The swap space has the slots' shape with ``num_cpu_blocks`` rows (pinned when the device is CUDA).
Blocks are moved by physical id: copy-on-write copies inside the pool, swaps between pool and swap space.

Multi-head latent attention (``ModelSpec.latent_rank``, DeepSeek-V2/V3): one tensor per slot,
``[num_blocks, block_size, 1, latent_rank + qk_rope_head_dim]``, and each ``v_caches[i]`` is the view of its first
``latent_rank`` columns. Only the tensors that own memory (:meth:`KVPool.slot_tensors`) are allocated, copied,
swapped, offloaded and counted, so the latent is never held or moved twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from loguru import logger

from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_kernels import copy_blocks, swap_blocks

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def _ids(ids: BlockIds, device: torch.device) -> torch.Tensor:
    if torch.is_tensor(ids):
        return ids.to(device=device, dtype=torch.int64)
    return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)


class KVPool:
    """K/V pool tensors of one model on one device, and its swap space."""

    def __init__(self, spec: ModelSpec, block_size: int, kv_dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.device = device
        self.groups = LayerGroups.uniform(spec.num_layers)
        """The groups the pool is laid out for (one group of every layer until :meth:`allocate` is told)."""
        self.layer_group: tuple[int, ...] = (0,) * spec.num_layers
        self.k_slots: list[torch.Tensor] = []
        self.v_slots: list[torch.Tensor] = []
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.cpu_k_caches: list[torch.Tensor] = []
        self.cpu_v_caches: list[torch.Tensor] = []
        self.host_k: list[torch.Tensor] = []
        self.host_v: list[torch.Tensor] = []
        """The host tier's arena (``memory.host_tier``): the swap space's shape, ``num_host_rows`` rows."""

    def value_views(self, keys: list[torch.Tensor]) -> list[torch.Tensor]:
        """MLA: the value caches the kernels read, views of the first ``latent_rank`` columns of ``keys``."""
        return [k[..., : self.spec.latent_rank] for k in keys]

    def new_caches(self, num_blocks: int, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``count`` zeroed K and V caches of ``num_blocks`` blocks on the pool's device (V as views under MLA)."""
        shape = self.block_shape(num_blocks)
        keys = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(count)]
        if self.spec.latent_rank:
            return keys, self.value_views(keys)
        return keys, [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(count)]

    def _host_tensors(self, num_blocks: int, pin: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Uninitialized host K and V tensors, one per slot (no V under MLA: the latent is copied once)."""
        shape = self.block_shape(num_blocks)
        count = self.groups.layers_per_block
        keys = [torch.empty(shape, dtype=self.kv_dtype, pin_memory=pin) for _ in range(count)]
        values = (
            []
            if self.spec.latent_rank
            else [torch.empty(shape, dtype=self.kv_dtype, pin_memory=pin) for _ in range(count)]
        )
        return keys, values

    def block_bytes_for(self, groups: LayerGroups) -> int:
        """Bytes of one block of a pool laid out for ``groups`` (``layers_per_block`` layers' K and V)."""
        per_layer = self.spec.kv_bytes_per_block(self.block_size, self.kv_dtype) // self.spec.num_layers
        return per_layer * groups.layers_per_block

    @property
    def block_bytes(self) -> int:
        return self.block_bytes_for(self.groups)

    @property
    def num_blocks(self) -> int:
        return int(self.k_caches[0].shape[0]) if self.k_caches else 0

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.cpu_k_caches[0].shape[0]) if self.cpu_k_caches else 0

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)

    def allocate(self, num_blocks: int, groups: LayerGroups) -> None:
        """Allocate (or replace) the pool, laid out for ``groups``; zero-filled, so blocks never written hold
        finite values."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV pool needs at least one block")
        self.k_caches, self.v_caches, self.k_slots, self.v_slots = [], [], [], []  # free the old pool first
        self.groups = groups
        self.layer_group = tuple(groups.layer_group(layer) for layer in range(self.spec.num_layers))
        self.k_slots, self.v_slots = self.new_caches(num_blocks, groups.layers_per_block)
        self.k_caches = [self.k_slots[groups.layer_slot(layer)] for layer in range(self.spec.num_layers)]
        self.v_caches = [self.v_slots[groups.layer_slot(layer)] for layer in range(self.spec.num_layers)]
        logger.info(
            "KV pool: {} blocks x {} tokens, {:.1f} MiB ({})",
            num_blocks,
            self.block_size,
            num_blocks * self.block_bytes / 2**20,
            self.kv_dtype,
        )

    def allocate_swap(self, num_cpu_blocks: int) -> None:
        """Allocate (or replace) the CPU swap space, one tensor per slot of the pool; 0 frees it."""
        self.cpu_k_caches, self.cpu_v_caches = [], []
        if num_cpu_blocks <= 0:
            return
        self.cpu_k_caches, self.cpu_v_caches = self._host_tensors(num_cpu_blocks, pin=self.device.type == "cuda")

    @property
    def num_host_rows(self) -> int:
        return int(self.host_k[0].shape[0]) if self.host_k else 0

    def allocate_host_tier(self, num_rows: int) -> None:
        """Allocate (or replace) the host tier's arena, pinned on CUDA; 0 frees it. Pages are committed as
        offloads write them (``torch.empty``), so an idle tier costs address space, not RAM."""
        self.host_k, self.host_v = [], []
        if num_rows <= 0:
            return
        self.host_k, self.host_v = self._host_tensors(num_rows, pin=self.device.type == "cuda")

    def slot_tensors(self) -> list[torch.Tensor]:
        """The pool's tensors that own memory (a block is row ``b`` of each), K's then V's (MLA: the K slots alone,
        each V a view of its K)."""
        return self.k_slots if self.spec.latent_rank else self.k_slots + self.v_slots

    def host_tensors(self) -> list[torch.Tensor]:
        """The host tier arena's tensors, matching :meth:`slot_tensors` one for one."""
        return self.host_k + self.host_v

    def offload(self, device_ids: BlockIds, host_rows: BlockIds) -> None:
        """Copy pool blocks ``device_ids[i]`` to host-tier rows ``host_rows[i]`` (in order, on this thread;
        :mod:`tgi_paged_backend.offload.tier_copies` runs them on a copy stream on CUDA)."""
        self._swap(self.slot_tensors(), self.host_tensors(), device_ids, host_rows)

    def load(self, host_rows: BlockIds, device_ids: BlockIds) -> None:
        """Copy host-tier rows ``host_rows[i]`` into pool blocks ``device_ids[i]``."""
        self._swap(self.host_tensors(), self.slot_tensors(), host_rows, device_ids)

    def read_host_rows(self, rows: Sequence[int]) -> np.ndarray:
        """The host rows' K/V as raw bytes, ``uint8 [len(rows), tensors, block_size, Hkv, D * itemsize]`` (tensors:
        ``2 * slots``, MLA ``slots``)
        (what the disk tier stores; a copy, so the rows may be reused at once)."""
        index = torch.as_tensor(list(rows), dtype=torch.int64)
        stacked = torch.stack([t.index_select(0, index) for t in self.host_k + self.host_v], dim=1)
        return stacked.view(torch.uint8).numpy().copy()

    def write_host_rows(self, rows: Sequence[int], payload: np.ndarray) -> None:
        """Write :meth:`read_host_rows`' bytes back into host rows ``rows``."""
        data = torch.from_numpy(np.ascontiguousarray(payload)).view(self.kv_dtype)
        for i, tensor in enumerate(self.host_k + self.host_v):
            tensor[list(rows)] = data[:, i]

    def host_row_shape(self) -> tuple[int, ...]:
        """Shape of one row of :meth:`read_host_rows`."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return (
            self.spec.kv_tensors_per_layer * self.groups.layers_per_block,
            self.block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim * itemsize,
        )

    def copy_blocks(self, src: BlockIds, dst: BlockIds) -> None:
        """Copy pool blocks ``src[i] -> dst[i]`` in every layer (copy-on-write)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks: {len(src)} sources for {len(dst)} destinations")
        if len(src) == 0:
            return
        if self.spec.latent_rank:  # one tensor per slot: a block-to-block copy of each, inside the pool
            swap_blocks(self.k_slots, self.k_slots, _ids(src, self.device), _ids(dst, self.device))
            return
        copy_blocks(self.k_slots, self.v_slots, _ids(src, self.device), _ids(dst, self.device))

    def swap_out(self, device_ids: BlockIds, cpu_ids: BlockIds) -> None:
        """Copy pool blocks ``device_ids[i]`` to swap blocks ``cpu_ids[i]`` (every slot tensor, K and V)."""
        self._swap(self.slot_tensors(), self.cpu_k_caches + self.cpu_v_caches, device_ids, cpu_ids)

    def swap_in(self, cpu_ids: BlockIds, device_ids: BlockIds) -> None:
        """Copy swap blocks ``cpu_ids[i]`` back to pool blocks ``device_ids[i]``."""
        self._swap(self.cpu_k_caches + self.cpu_v_caches, self.slot_tensors(), cpu_ids, device_ids)

    def _swap(self, src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: BlockIds, dst_ids: BlockIds) -> None:
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"swap: {len(src_ids)} sources for {len(dst_ids)} destinations")
        if len(src_ids) == 0:
            return
        if not dst or not src:
            raise RuntimeError(
                "no host memory to copy to: call allocate_swap_space (swap) or allocate_host_tier (host tier) first"
            )
        cpu = torch.device("cpu")
        # swap_blocks returns once the CPU side is done: swap-out copies have landed in the swap space,
        # swap-in sources have been read (the device-side scatter is in stream order).
        swap_blocks(src, dst, _ids(src_ids, cpu), _ids(dst_ids, cpu))
