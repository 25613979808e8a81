"""GEMMs of a CPU decode step: ``F.linear`` (before issue 21) vs the fast-layer swap's packed oneDNN call.

A 30-layer set of distinct weights (SmolLM2-135M's shapes, plus its LM head), so every weight is cold in
cache as in a real step, run at ``--rows`` rows both ways; then single small and mid-size weights hot in
cache (the per-call cost that sets ``fast_layers.PACK_MIN_ELEMENTS``). Prints median and min ms per
repetition, the two ways alternated. Decode attention's old and new paths are compared by
``examples/bench_cpu_attention.py``. Figures move with the machine's load (printed).

    .venv/bin/python examples/bench_packed_linears.py [--threads 2] [--rows 20]
    .venv/bin/python examples/bench_packed_linears.py --small [ROWS ...]   # small weights by row count
    .venv/bin/python examples/bench_packed_linears.py --native [ROWS ...]  # oneDNN vs the native packed GEMM
    .venv/bin/python examples/bench_packed_linears.py --bf16-paths [ROWS ...]  # bf16: oneDNN vs each native path

``--native``: the packed oneDNN call against the native packed GEMM (``tgi_paged_kernels.gemm_packed``, what the
native decode layer and the LM head run) on the same cold 30-layer set, and on the LM heads alone (SmolLM2's
49152 x 576, the host-bound model's 49152 x 128), each call after a 256 MiB pass that evicts the caches.

``--bf16-paths``: the same cold 30 layers in bf16: oneDNN's bf16 linear (bf16 rows) against the native bf16 GEMM on
each path this host has (``widening``, ``dot``: vdpbf16ps, ``amx``; fp32 rows, as the native layer holds them),
with the fp32 native GEMM for scale; the host's CPU and ISA printed first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.peers.host import describe, host_info  # noqa: E402

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


HOSTBOUND_LAYER = [(256, 128), (128, 128), (512, 128), (128, 256)]
"""The host-bound model's fused q/k/v, o, gate/up and down weights: all below ``PACK_MIN_ELEMENTS``."""


def small_weights(rows_list: list[int], repeats: int) -> None:
    """30 layers of small weights at each row count: where packing starts to pay (``PACKED_MIN_ROWS``)."""
    print("small weights (the host-bound model's 4 per layer x 30 layers): F.linear (old) vs packed (new)")
    weights = [torch.randn(o, i) * 0.02 for o, i in HOSTBOUND_LAYER * 30]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    for rows in rows_list:
        inputs = {i: torch.randn(rows, i) for i in (128, 256)}

        def plain(inputs=inputs) -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def fast(inputs=inputs) -> None:
            for w, p in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

        _pair(f"{rows} rows", plain, fast, repeats)


def native_gemms(rows_list: list[int], repeats: int) -> None:
    """oneDNN's packed linear (old) vs the native packed GEMM (new), weights cold in cache."""
    from tgi_paged_kernels import gemm_packed, native_kernels, pack_weight

    native = native_kernels()
    if native is None:
        print("native kernels unavailable: nothing to compare")
        return
    print("GEMMs: packed oneDNN (old) vs the native packed GEMM (new), weights cold in cache")
    weights = [torch.randn(o, i) * 0.02 for o, i in SMOLLM2_LAYER * 30]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    ours = [pack_weight(w) for w in weights]
    evict = torch.zeros(64 << 20)
    for rows in rows_list:
        inputs = {i: torch.randn(rows, i) for i in (576, 1536)}

        def old(inputs=inputs) -> None:
            for w, p in zip(weights, onednn):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

        def new(inputs=inputs) -> None:
            for w, p in zip(weights, ours):
                gemm_packed(native, inputs[w.shape[1]], p, w.shape[0])

        _pair(f"30 layers, {rows} rows", old, new, repeats)
        for out_f, in_f in [(49152, 576), (49152, 128)]:
            w, x = torch.randn(out_f, in_f) * 0.02, torch.randn(rows, in_f)
            p_old, p_new = torch.ops.mkldnn._reorder_linear_weight(w, 32), pack_weight(w)

            def head_old(x=x, p=p_old) -> None:
                evict.add_(1.0)
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

            def head_new(x=x, p=p_new, n=out_f) -> None:
                evict.add_(1.0)
                gemm_packed(native, x, p, n)

            _pair(f"LM head {out_f}x{in_f}, {rows} rows (+ the eviction pass)", head_old, head_new, repeats)


def bf16_paths(rows_list: list[int], repeats: int) -> None:
    """oneDNN's bf16 linear vs the native bf16 GEMM's paths (and the fp32 one), weights cold in cache."""
    from tgi_paged_kernels import gemm_packed, native_kernels, pack_weight
    from tgi_paged_kernels.cpu_gemm import pack_weight_bf16, set_bf16_amx, set_bf16_dot

    native = native_kernels()
    if native is None:
        print("native kernels unavailable: nothing to compare")
        return
    print(describe(host_info(), "bfloat16"))
    weights = [torch.randn(o, i) * 0.02 for o, i in SMOLLM2_LAYER * 30]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32) for w in weights]
    fp32, bf16 = [pack_weight(w) for w in weights], [pack_weight_bf16(w) for w in weights]
    dot_default = set_bf16_dot(native)
    paths = {"widening": (False, False), "dot": (False, True), "amx": (True, False)}
    have = [
        name
        for name, (amx, dot) in paths.items()
        if set_bf16_amx(native, amx) == amx and set_bf16_dot(native, dot) == dot
    ]
    print(
        f"GEMMs of 30 SmolLM2 layers, ms (median of {repeats}; min): oneDNN bf16, native {', '.join(have)}, native fp32"
    )
    for rows in rows_list:
        inputs = {i: torch.randn(rows, i) for i in (576, 1536)}
        rows_bf16 = {i: x.bfloat16() for i, x in inputs.items()}

        def dnn(inputs=rows_bf16) -> None:
            for w, p in zip(weights, onednn):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

        def ours(packs: list[torch.Tensor], inputs=inputs) -> None:
            for w, p in zip(weights, packs):
                gemm_packed(native, inputs[w.shape[1]], p, w.shape[0])

        cells = [("oneDNN bf16", *_ms(dnn, repeats))]
        for name in have:
            amx, dot = paths[name]
            set_bf16_amx(native, amx)
            set_bf16_dot(native, dot)
            cells.append((name, *_ms(lambda: ours(bf16), repeats)))
        cells.append(("fp32", *_ms(lambda: ours(fp32), repeats)))
        print(f"  {rows:5d} rows: " + " | ".join(f"{n} {m:.2f} ({lo:.2f})" for n, m, lo in cells))
    set_bf16_amx(native, True)
    set_bf16_dot(native, dot_default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--small", type=int, nargs="*", default=None, metavar="ROWS",
        help="only the small-weight sweep, at these row counts (default 20 64 128 256 1118)",
    )  # fmt: skip
    parser.add_argument(
        "--native", type=int, nargs="*", default=None, metavar="ROWS",
        help="only oneDNN vs the native packed GEMM, at these row counts (default 1 20 128)",
    )  # fmt: skip
    parser.add_argument(
        "--bf16-paths", type=int, nargs="*", default=None, metavar="ROWS",
        help="only oneDNN bf16 vs the native bf16 GEMM's paths, at these row counts (default 1 20 32 64 256)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    if args.bf16_paths is not None:
        bf16_paths(args.bf16_paths or [1, 20, 32, 64, 256], args.repeats)
    elif args.native is not None:
        native_gemms(args.native or [1, 20, 128], args.repeats)
    elif args.small is not None:
        small_weights(args.small or [20, 64, 128, 256, 1118], args.repeats)
    else:
        gemms(args.rows, args.repeats)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
