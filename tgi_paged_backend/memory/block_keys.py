"""Identities of retained blocks outside the pool: 16-byte chain digests.

The pool's registry (:mod:`.prefix_cache`) verifies a chain by entry serials, which live only as long as
the process and the pool. A block kept in host RAM or on disk outlives both, so it is named by a *chain
digest*: ``block_key(parent_key, tokens)`` over the parent's key and the block's token ids, starting at
``root_key(salt, namespace)``. The salt is the fingerprint of what makes K/V comparable (model, revision,
KV dtype, block size, pool layout, adapters; :class:`~tgi_paged_backend.offload.disk_store.DiskFingerprint`),
so keys of another model never meet ours. blake2b with 128 bits: a false match between two different
prefixes would need a collision of the hash, which is not a practical event (vLLM's ``sha256`` prefix-hash
option relies on the same argument); the stored token ids are checked on every hit as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

import numpy as np

KEY_BYTES = 16


def root_key(salt: bytes, namespace: int) -> bytes:
    """Where the chains of LoRA adapter index ``namespace`` (0: the base model) start."""
    return blake2b(
        b"tgi-paged-root" + salt + int(namespace).to_bytes(8, "little", signed=True), digest_size=KEY_BYTES
    ).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block holding ``token_ids`` after the block (or root) keyed ``parent``."""
    return blake2b(parent + np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=KEY_BYTES).digest()


@dataclass(frozen=True, slots=True)
class TierBlock:
    """One full block's identity, as the host and disk tiers keep it.

    Attributes:
        key: Its chain digest (:func:`block_key`).
        parent: The chain digest before it (the root's for a first block).
        token_ids: The block's tokens (checked against the prompt on every hit).
        namespace: LoRA adapter index (0: the base model).
        chain_hash: The pool registry's chain hash of the same block (what KV events name it by).
        parent_chain_hash: The pool registry's chain hash before it (``None`` for a first block).
    """

    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    namespace: int
    chain_hash: int
    parent_chain_hash: int | None
