"""The CPU decode attention paths side by side, at the CPU serving shape (one run, ratios).

    python examples/bench_cpu_attention.py [--batch 32] [--context 160] [--layers 30] [--threads 2]
        [--q-heads 9 --kv-heads 3]

SmolLM2-135M's attention by default (9 query heads, 3 KV heads, head_dim 64, fp32; ``--q-heads 2
--kv-heads 1`` is the peers benchmark's host-bound model), block 16, shuffled pool,
random context lengths up to ``--context``. One "step" = ``--layers`` calls of decode attention,
each on its own layer pool, as the model does. Prints ms per step for:

- ``per KV head``: the masked matmul pair per KV head (the path for soft-capping and sinks), over a
  gather planned in every call;
- ``SDPA, plan per call``: ``scaled_dot_product_attention`` over a gather planned in every call;
- ``SDPA, one plan per step``: the gather path as serving runs it with ``TGI_PAGED_CPU_DECODE=sdpa``
  (``plan_decode_gather`` once, shared by the layers);
- ``compiled no-gather``: the inductor kernel (``tgi_paged_kernels.cpu_decode``, compiled before timing);
- ``native C++ no-gather``: the serving default (``tgi_paged_kernels.cpu_native``, built before timing);

and the gathers alone (the memory traffic every path pays). Figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import time

import torch

from tgi_paged_kernels import paged_decode_attention, plan_decode_gather
from tgi_paged_kernels.cpu_attention import gather_decode_kv
from tgi_paged_kernels.testing import make_paged_kv
from tgi_paged_kernels.torch_impl import decode_per_kv_head


def best_ms(fn, repeats: int) -> float:
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
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    args = parser.parse_args()
    heads = dict(num_q_heads=args.q_heads, num_kv_heads=args.kv_heads, head_dim=64)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(max(1, args.context // 2), args.context + 1, (args.batch,), generator=gen).tolist()
    layers = [make_paged_kv(seq_lens, num_kv_heads=heads["num_kv_heads"], head_dim=heads["head_dim"], block_size=16,
                            kv_dtype=torch.float32, generator=torch.Generator().manual_seed(0))
              for _ in range(args.layers)]  # fmt: skip
    tables, lens = layers[0].block_tables, layers[0].seq_lens
    query = torch.randn(args.batch, heads["num_q_heads"], heads["head_dim"], generator=gen)
    scale = heads["head_dim"] ** -0.5

    def per_kv_head():
        for kv in layers:
            decode_per_kv_head(query, kv.k_cache, kv.v_cache, plan_decode_gather(tables, lens, 16, None), scale=scale,
                               softcap=0.0, k_scale=1.0, v_scale=1.0)  # fmt: skip

    def sdpa_plan_per_call():
        for kv in layers:
            paged_decode_attention(query, kv.k_cache, kv.v_cache, tables, lens, scale=scale, cpu_kernel="sdpa")

    def sdpa_plan_per_step():
        plan = plan_decode_gather(tables, lens, 16, None)
        for kv in layers:
            paged_decode_attention(
                query, kv.k_cache, kv.v_cache, tables, lens, scale=scale, gather=plan, cpu_kernel="sdpa"
            )

    def compiled_no_gather():
        plan = plan_decode_gather(tables, lens, 16, None)
        for kv in layers:
            paged_decode_attention(
                query, kv.k_cache, kv.v_cache, tables, lens, scale=scale, gather=plan, cpu_kernel="compiled"
            )

    def native_no_gather():
        for kv in layers:
            paged_decode_attention(query, kv.k_cache, kv.v_cache, tables, lens, scale=scale, cpu_kernel="native")

    plan = plan_decode_gather(tables, lens, 16, None)

    def gathers_only():
        for kv in layers:
            gather_decode_kv(kv.k_cache, plan, 1.0)
            gather_decode_kv(kv.v_cache, plan, 1.0)

    rows = [
        ("per KV head, plan per call", per_kv_head),
        ("SDPA, plan per call", sdpa_plan_per_call),
        ("SDPA, one plan per step (sdpa)", sdpa_plan_per_step),
        ("compiled no-gather (inductor)", compiled_no_gather),
        ("native C++ no-gather (serving default)", native_no_gather),
        ("gathers alone (K and V)", gathers_only),
    ]
    print(
        f"decode attention, {args.layers} layers x batch {args.batch}, contexts {min(seq_lens)}-{max(seq_lens)}, "
        f"{args.q_heads}/{args.kv_heads} heads x 64, fp32, block 16, {args.threads} threads; best of {args.repeats}"
    )
    compiled_no_gather()  # compile outside the timing (Warmup does it when serving)
    base = None
    for label, fn in rows:
        ms = best_ms(fn, args.repeats)
        base = base or ms
        print(f"  {label:<40} {ms:8.1f} ms per step   {base / ms:5.2f}x")


if __name__ == "__main__":
    main()
