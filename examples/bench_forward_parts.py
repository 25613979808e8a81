"""The two parts of a CPU decode step that issue 21 changed, old way vs new way, in one process.

1. GEMMs: a 30-layer set of distinct weights (SmolLM2-135M's shapes, plus its LM head), so every weight is
   cold in cache as in a real step, run at ``--rows`` rows with ``F.linear`` and with the fast-layer swap's
   packed oneDNN call; then single small and mid-size weights hot in cache (the per-call cost that sets
   ``fast_layers.PACK_MIN_ELEMENTS``).
2. Decode attention over a paged pool, 30 layers: gather + SDPA (``TGI_PAGED_CPU_DECODE=sdpa``) vs the
   no-gather compiled kernel (``compiled``, the default), for SmolLM2's heads and the host-bound model's.

Prints median and min ms per repetition, alternating the two ways. Figures move with the machine's load
(printed). Usage: ``.venv/bin/python examples/bench_forward_parts.py [--threads 2] [--rows 20]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from tgi_paged_kernels import paged_decode_attention, plan_decode_gather
from tgi_paged_kernels.testing import make_paged_kv

SMOLLM2_LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def _ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), min(times)


def _pair(label: str, old: Callable[[], object], new: Callable[[], object], repeats: int) -> None:
    for _ in range(2):
        (om, on), (nm, nn_) = _ms(old, repeats), _ms(new, repeats)
        print(f"  {label}: old median {om:.2f} (min {on:.2f}) ms | new median {nm:.2f} (min {nn_:.2f}) ms")


def gemms(rows: int, repeats: int) -> None:
    print(f"GEMMs, {rows} rows: F.linear (old) vs packed oneDNN (new)")
    weights = [torch.randn(o, i) * 0.02 for o, i in SMOLLM2_LAYER * 30 + [(49152, 576)]]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    inputs = {i: torch.randn(rows, i) for i in (576, 1536)}

    def plain() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def fast() -> None:
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

    _pair("30 layers + LM head, cold", plain, fast, repeats)
    for out_f, in_f in [(128, 128), (256, 128), (576, 576), (1536, 576)]:
        w, x = torch.randn(out_f, in_f), torch.randn(rows, in_f)
        p = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        loops = 200

        def one_plain(w=w, x=x, loops=loops) -> None:
            for _ in range(loops):
                F.linear(x, w)

        def one_packed(p=p, x=x, loops=loops) -> None:
            for _ in range(loops):
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

        _pair(f"{out_f}x{in_f} hot, x{loops} calls", one_plain, one_packed, max(3, repeats // 2))


def attention(rows: int, repeats: int, q_heads: int, kv_heads: int) -> None:
    print(f"decode attention, 30 layers, {rows} requests, {q_heads} q / {kv_heads} kv heads, head_dim 64, block 16:")
    lens = np.random.default_rng(0).integers(40, 200, size=rows).tolist()
    kv = make_paged_kv(lens, num_kv_heads=kv_heads, head_dim=64, block_size=16, kv_dtype=torch.float32, poison=False)
    caches = [(kv.k_cache.clone(), kv.v_cache.clone()) for _ in range(30)]
    query = torch.randn(rows, q_heads, 64)
    plan = plan_decode_gather(kv.block_tables, kv.seq_lens, 16, None)

    def run(compiled: bool) -> None:
        for k, v in caches:
            paged_decode_attention(
                query, k, v, kv.block_tables, kv.seq_lens, scale=0.125, gather=plan, compiled=compiled
            )

    start = time.perf_counter()
    run(True)
    print(f"  (compiled kernel ready in {time.perf_counter() - start:.1f} s)")
    _pair("gather + SDPA (old) vs compiled no-gather (new)", lambda: run(False), lambda: run(True), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    gemms(args.rows, args.repeats)
    attention(args.rows, args.repeats, 9, 3)
    attention(args.rows, args.repeats, 2, 1)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
