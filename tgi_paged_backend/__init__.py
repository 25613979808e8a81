"""tgi-paged-backend: a paged-KV model server for Hugging Face TGI's stock launcher and v3 router.

Glossary (these words are used in code too):

- **token position**: index of a token in one request's sequence (prompt + generated).
- **slot**: ``block_id * block_size + offset``; the router sends one slot per reserved token position.
- **virtual block**: a block id handed out by the router (``Request.blocks``). An address, not memory.
- **physical block**: a row of the KV pool tensors (``[num_blocks, block_size, num_kv_heads, head_dim]``
  per layer for K and for V). Only physical blocks cost memory.
- **page map**: virtual block -> physical block (or *swapped*, or *absent*). Filled on first write.
- **block table**: per request, the physical blocks in token order, as the kernels read it.
- **pool**: all physical blocks; **swap space**: a CPU pool of the same block shape.
- **preempt / victim / resume**: take a running request's physical blocks away (swap out or drop for
  recompute); the request chosen; bring it back later.

Dependencies point one way: server -> engine -> {memory, policy, runner} -> kernels (``tgi_paged_kernels``).
"""

__version__ = "0.1.0"
