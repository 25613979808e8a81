"""Multi-head latent attention decode on CPU: attention in latent space vs "decompress then attend" (one run).

    python examples/bench_mla_decode.py [--batch 32] [--context 512] [--heads 16] [--threads 2] [--repeats 3]

One layer of a DeepSeek-V2-like attention at decode, fp32, block size 16: ``--heads`` query heads,
kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; the pool holds one latent entry
per token, ``[c (512) ; k_rope (64)]`` (Dk = 576), and every request has ``--context`` tokens. A step computes
the ``[batch, heads, 128]`` attention output from ``q_nope`` ``[batch, heads, 128]`` and ``q_rope``
``[batch, heads, 64]``:

- ``latent``: absorb the key up-projection into the query (``q_nope @ W_uk^T`` per head: 576-wide queries),
  attend over the pool with ``v_cache = k_cache[..., :512]`` (one KV head, MQA, outputs 512 wide), then apply
  the value up-projection (``@ W_uv`` per head). Timed on the native C++ decode kernel (the CPU default) and
  on the torch gather path (``cpu_kernel="sdpa"``; a narrower V takes its matmul pair per KV head);
- ``decompress``: gather each request's latent entries, expand them to per-head keys ``[c @ W_uk ; k_rope]``
  (192 wide) and values ``c @ W_uv`` (128 wide), then standard attention (SDPA, 16 heads).

Both compute the same function (checked: the outputs agree to 1e-4); best of ``--repeats`` after a warm-up.
Prints the host's CPU model and ISA first. About 20 s on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration.peers.host import describe, host_info  # noqa: E402
from tgi_paged_kernels import paged_decode_attention  # noqa: E402
from tgi_paged_kernels.testing import make_paged_kv  # noqa: E402

KV_LORA_RANK, NOPE, ROPE, V_HEAD_DIM, BLOCK_SIZE = 512, 128, 64, 128, 16


def best_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe(host_info(), "float32"))
    batch, heads, dk = args.batch, args.heads, KV_LORA_RANK + ROPE
    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv([args.context] * batch, num_kv_heads=1, head_dim=dk, block_size=BLOCK_SIZE,
                       kv_dtype=torch.float32, latent_v_head_dim=KV_LORA_RANK, poison=False, generator=gen)  # fmt: skip
    w_uk = torch.randn(heads, KV_LORA_RANK, NOPE, generator=gen) * KV_LORA_RANK**-0.5  # c -> k_nope, per head
    w_uv = torch.randn(heads, KV_LORA_RANK, V_HEAD_DIM, generator=gen) * KV_LORA_RANK**-0.5  # c -> v, per head
    q_nope = torch.randn(batch, heads, NOPE, generator=gen)
    q_rope = torch.randn(batch, heads, ROPE, generator=gen)
    scale = (NOPE + ROPE) ** -0.5

    def latent(cpu_kernel: str) -> torch.Tensor:
        q_absorbed = torch.einsum("bhn,hcn->bhc", q_nope, w_uk)  # [B, H, 512]
        query = torch.cat([q_absorbed, q_rope], dim=-1)  # [B, H, 576]
        out = paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=scale,
                                     cpu_kernel=cpu_kernel)  # fmt: skip
        return torch.einsum("bhc,hcv->bhv", out, w_uv)  # [B, H, 128]

    def decompress() -> torch.Tensor:
        positions = torch.arange(args.context)
        block_ids = kv.block_tables[:, positions // BLOCK_SIZE].long()  # [B, T]
        entries = kv.k_cache[block_ids, positions % BLOCK_SIZE, 0]  # [B, T, 576]
        c, k_rope = entries[..., :KV_LORA_RANK], entries[..., KV_LORA_RANK:]
        k_nope = torch.einsum("btc,hcn->bhtn", c, w_uk)  # [B, H, T, 128]
        keys = torch.cat([k_nope, k_rope[:, None].expand(-1, heads, -1, -1)], dim=-1)  # [B, H, T, 192]
        values = torch.einsum("btc,hcv->bhtv", c, w_uv)  # [B, H, T, 128]
        query = torch.cat([q_nope, q_rope], dim=-1)[:, :, None]  # [B, H, 1, 192]
        return F.scaled_dot_product_attention(query, keys, values, scale=scale)[:, :, 0]

    torch.testing.assert_close(latent("native"), decompress(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(latent("sdpa"), decompress(), atol=1e-4, rtol=1e-4)
    print(
        f"shape: {batch} requests x {args.context} tokens, {heads} heads, latent Dk {dk} / Dv {KV_LORA_RANK}, "
        f"decompressed K {NOPE + ROPE} / V {V_HEAD_DIM}, fp32, {args.threads} threads, best of {args.repeats}"
    )
    decompressed_ms = best_ms(decompress, args.repeats)
    for name, kernel in (("latent, native C++ decode", "native"), ("latent, torch gather path", "sdpa")):
        latent_ms = best_ms(lambda kernel=kernel: latent(kernel), args.repeats)
        print(f"{name:30s} {latent_ms:9.1f} ms/step   decompress then attend {decompressed_ms:9.1f} ms/step   "
              f"ratio {decompressed_ms / latent_ms:5.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
