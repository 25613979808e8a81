"""GEMMs of a CPU decode step: ``F.linear`` (before issue 21) vs the fast-layer swap's packed oneDNN call.

A 30-layer set of distinct weights (SmolLM2-135M's shapes, plus its LM head), so every weight is cold in
cache as in a real step, run at ``--rows`` rows both ways; then single small and mid-size weights hot in
cache (the per-call cost that sets ``fast_layers.PACK_MIN_ELEMENTS``). Prints median and min ms per
repetition, the two ways alternated. Decode attention's old and new paths are compared by
``examples/bench_cpu_attention.py``. Figures move with the machine's load (printed).

    .venv/bin/python examples/bench_packed_linears.py [--threads 2] [--rows 20]
    .venv/bin/python examples/bench_packed_linears.py --small [ROWS ...]   # small weights by row count
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--small", type=int, nargs="*", default=None, metavar="ROWS",
        help="only the small-weight sweep, at these row counts (default 20 64 128 256 1118)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    if args.small is not None:
        small_weights(args.small or [20, 64, 128, 256, 1118], args.repeats)
    else:
        gemms(args.rows, args.repeats)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
