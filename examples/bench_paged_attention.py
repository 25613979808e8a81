"""Paged decode attention on a CUDA device: time and achieved memory bandwidth, against a contiguous
torch SDPA baseline on identical data (and FlashInfer's paged decode when it is importable).

    python examples/bench_paged_attention.py              # benchmark grid (< 5 minutes on an H100/H200)
    python examples/bench_paged_attention.py --check      # kernel-vs-reference checks on CUDA first
    python examples/bench_paged_attention.py --check-only # just the checks (a GPU-session smoke test)

Shapes: batch {1, 32, 256} x context {512, 4096, 32768}, fp16, 32 query heads / 8 KV heads,
head_dim 128, block size 16, physical blocks shuffled; then the same grid for latent (MLA) decode: 16 query
heads over one 576-wide latent entry whose first 512 columns are V (DeepSeek-V3 per rank at TP=8).
Decode reads every K/V byte of every request once, so bytes moved / time against the device's peak
DRAM bandwidth is the figure of merit. Shapes whose pool plus the baseline's contiguous copy do not fit
in free memory are skipped. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from tgi_paged_kernels import (
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    reference,
    store_kv,
    swap_blocks,
)
from tgi_paged_kernels.paged_decode import _launch_paged_decode, choose_num_splits
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv, query_start_loc

# Peak DRAM bandwidth in TB/s by device-name substring (lower case), first match wins, so more
# specific names come first ("gh200" before "h200" before "h20", "a100" before "a10", "l40" before "l4").
PEAK_TB_S = [
    ("gh200", 4.0), ("h200", 4.8), ("h100 pcie", 2.0), ("h100 nvl", 3.9), ("h100", 3.35), ("h800", 3.35),
    ("h20", 4.0), ("b200", 8.0), ("a100-sxm4-80gb", 2.039), ("a100 80gb pcie", 1.935), ("a100", 1.555),
    ("l40s", 0.864), ("l40", 0.864), ("a10g", 0.6), ("a10", 0.6), ("l4", 0.3), ("rtx 4090", 1.008),
    ("rtx 3090", 0.936), ("v100", 0.9), ("t4", 0.32), ("mi300x", 5.3),
]  # fmt: skip
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where the number comes from): the table, or a measured device-to-device copy."""
    name = torch.cuda.get_device_name(device)
    for key, tb_s in PEAK_TB_S:
        if key in name.lower():
            return tb_s * 1e12, f"{name}: {tb_s} TB/s (spec sheet)"
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    measured = 2 * src.numel() / (ms * 1e-3)  # a copy reads and writes every byte
    return measured, f"{name}: {measured / 1e12:.2f} TB/s (estimated from a 1 GiB copy; not in the table)"


# ---------------------------------------------------------------------------------------------
# --check: kernels against the fp32 references on CUDA, one axis varied at a time
# ---------------------------------------------------------------------------------------------

CHECK_CASES = [  # overrides of the base case: fp16, D=128, block 16, 32/8 heads, automatic split-K
    {}, {"num_splits": 1}, {"num_splits": 5},
    {"q_dtype": torch.bfloat16}, {"q_dtype": torch.float32},
    {"kv_dtype": torch.float8_e4m3fn}, {"q_dtype": torch.bfloat16, "kv_dtype": torch.float8_e5m2},
    {"kv_dtype": torch.float32},
    {"head_dim": 64}, {"head_dim": 80}, {"head_dim": 96}, {"head_dim": 256},
    {"block_size": 1}, {"block_size": 2}, {"block_size": 4}, {"block_size": 8}, {"block_size": 32},
    {"heads": (9, 3)}, {"heads": (8, 1)}, {"heads": (4, 4)},
    {"softcap": 30.0}, {"sliding_window": 100}, {"softcap": 5.0, "sliding_window": 1000, "num_splits": 4},
    {"interleaved": True},
    # multi-head latent attention (DeepSeek-V2/V3): one latent KV head of 576, V its first 512 columns
    {"heads": (16, 1), "head_dim": 576, "latent": 512}, {"heads": (16, 1), "head_dim": 576, "latent": 512,
    "kv_dtype": torch.float8_e4m3fn}, {"heads": (128, 1), "head_dim": 576, "latent": 512, "q_dtype": torch.bfloat16},
]  # fmt: skip


CHECK_SEQ_LENS = [1, 17, 97, 1000, 5000]
CHECK_QUERY_LENS = [1, 17, 5, 300, 64]  # prefill: fresh, fresh, extend, chunk over a prefix, extend


def check_attention_case(kind: str, case: dict, device: torch.device) -> None:
    q_dtype = case.get("q_dtype", torch.float16)
    kv_dtype = case.get("kv_dtype", q_dtype)
    num_q_heads, num_kv_heads = case.get("heads", (32, 8))
    head_dim = case.get("head_dim", 128)
    seq_lens, query_lens = CHECK_SEQ_LENS, CHECK_QUERY_LENS
    latent = case.get("latent")  # V is the first `latent` columns of K (one stored entry, one scale)
    scales = (0.5, 0.5 if latent else 2.0) if kv_dtype != q_dtype else (1.0, 1.0)
    kv = make_paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=case.get("block_size", 16),
        kv_dtype=kv_dtype, device=device, k_scale=scales[0], v_scale=scales[1],
        interleaved=case.get("interleaved", False), latent_v_head_dim=latent,
    )  # fmt: skip
    kwargs = dict(scale=head_dim**-0.5, softcap=case.get("softcap", 0.0), sliding_window=case.get("sliding_window"),
                  k_scale=kv.k_scale, v_scale=kv.v_scale)  # fmt: skip
    tables = (kv.k_cache, kv.v_cache, kv.block_tables)
    if kind == "decode":
        query = torch.randn(len(seq_lens), num_q_heads, head_dim, device=device).to(q_dtype)
        out = _launch_paged_decode(query, *tables, kv.seq_lens, num_splits=case.get("num_splits"), **kwargs)
        expected = reference.paged_decode_attention_reference(query, *tables, kv.seq_lens, **kwargs)
    else:
        starts = query_start_loc(query_lens, device)
        query = torch.randn(sum(query_lens), num_q_heads, head_dim, device=device).to(q_dtype)
        out = paged_prefill_attention(query, *tables, starts, kv.seq_lens, **kwargs)
        expected = reference.paged_prefill_attention_reference(query, *tables, starts, kv.seq_lens, **kwargs)
    assert_attention_close(out, expected, q_dtype)


def check_cache_ops(device: torch.device) -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        pools = [torch.full((8, 16, 8, 128), float("nan"), device=device).to(dtype) for _ in range(4)]
        refs = [p.clone() for p in pools]
        src_dtype = torch.float16 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
        key, value = (torch.randn(50, 8, 128, device=device).to(src_dtype) for _ in range(2))
        slots = torch.randperm(128, device=device)[:50]
        slots[::7] = -1
        store_kv(key, value, pools[0], pools[1], slots, k_scale=0.25, v_scale=4.0)
        reference.store_kv_reference(key, value, refs[0], refs[1], slots, k_scale=0.25, v_scale=4.0)
        src, dst = torch.tensor([1, 3, 1], device=device), torch.tensor([6, 0, 7], device=device)
        copy_blocks(pools[:2], pools[2:], src, dst)
        reference.copy_blocks_reference(refs[:2], refs[2:], src, dst)
        for actual, expected in zip(pools, refs):
            assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), f"store/copy {dtype}"
    swap_space = [torch.zeros(4, 16, 8, 128, dtype=torch.float16).pin_memory() for _ in range(2)]
    pool = [torch.randn(8, 16, 8, 128, device=device).half() for _ in range(2)]
    swap_blocks(pool, swap_space, torch.tensor([5, 2]), torch.tensor([3, 0]))
    assert all(torch.equal(s[[3, 0]], p[[5, 2]].cpu()) for s, p in zip(swap_space, pool)), "swap out"
    swap_blocks(swap_space, pool, torch.tensor([3, 0]), torch.tensor([1, 7]))
    assert all(torch.equal(p[[1, 7]].cpu(), s[[3, 0]]) for s, p in zip(swap_space, pool)), "swap in"


def run_checks(device: torch.device) -> bool:
    failures = 0
    cases = [(kind, case) for kind in ("decode", "prefill") for case in CHECK_CASES if not (
        kind == "prefill" and "num_splits" in case and len(case) == 1)]  # fmt: skip
    start = time.perf_counter()
    for kind, case in [*cases, ("cache ops", None)]:
        torch.manual_seed(0)
        try:
            check_cache_ops(device) if case is None else check_attention_case(kind, case, device)
            status = "ok"
        except Exception as error:  # noqa: BLE001 - report every case (compile errors too) and go on
            failures += 1
            status = f"FAIL {type(error).__name__}: " + (str(error).splitlines() or [""])[0][:120]
        print(f"  check {kind:9s} {case or ''}: {status}", flush=True)
    print(f"checks: {len(cases) + 1 - failures} passed, {failures} failed in {time.perf_counter() - start:.0f} s")
    return failures == 0


# ---------------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------------


def flashinfer_decode(kv, query, device):
    """A callable running FlashInfer's paged decode on the same pool, or the reason there is none."""
    try:
        import flashinfer
    except ImportError:
        return None, "not installed"
    try:
        num_blocks = (kv.seq_lens.long() + BLOCK_SIZE - 1) // BLOCK_SIZE
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), num_blocks.cumsum(0)]).int()
        used = torch.arange(kv.block_tables.shape[1], device=device)[None, :] < num_blocks[:, None]
        indices = kv.block_tables[used].int()
        last_page_len = ((kv.seq_lens - 1) % BLOCK_SIZE + 1).int()
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last_page_len, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                     q_data_type=torch.float16, kv_data_type=torch.float16)  # fmt: skip
        return (lambda: wrapper.run(query, (kv.k_cache, kv.v_cache))), ""
    except Exception as error:  # noqa: BLE001 - any API mismatch just means "no FlashInfer column"
        return None, f"{type(error).__name__}: {error}"[:80]


def contiguous_copy(kv, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline's K and V: [batch, kv_heads, context, head_dim], gathered one request at a time."""
    num_blocks = -(-context // BLOCK_SIZE)
    shape = (batch, NUM_KV_HEADS, num_blocks * BLOCK_SIZE, HEAD_DIM)
    k_contig = torch.empty(shape, device=kv.k_cache.device, dtype=kv.k_cache.dtype)
    v_contig = torch.empty_like(k_contig)
    for b in range(batch):
        blocks = kv.block_tables[b, :num_blocks].long()
        k_contig[b] = kv.k_cache[blocks].flatten(0, 1).transpose(0, 1)
        v_contig[b] = kv.v_cache[blocks].flatten(0, 1).transpose(0, 1)
    return k_contig[:, :, :context], v_contig[:, :, :context]


def bench_shape(batch: int, context: int, device: torch.device, peak: float, use_flashinfer: bool) -> None:
    import triton.testing

    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, fp16
    free, _ = torch.cuda.mem_get_info(device)
    if 2 * kv_bytes * 1.1 > free:  # the pool plus SDPA's contiguous copy, with 10 % headroom
        print(f"{batch:6d} {context:8d}  skipped: needs {2 * kv_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
        return
    kv = make_paged_kv([context] * batch, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                       kv_dtype=torch.float16, device=device, poison=False, num_spare_blocks=0)  # fmt: skip
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=torch.float16)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    moved = kv_bytes + 2 * query.numel() * 2 + kv.block_tables.numel() * 4  # K/V + query + output + table
    k_contig, v_contig = contiguous_copy(kv, batch, context)
    grouped_query = query.view(batch, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM)  # a group's heads as rows

    runners = {
        "paged": lambda: paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                                scale=scale, out=out),
        "sdpa": lambda: F.scaled_dot_product_attention(grouped_query, k_contig, v_contig, scale=scale),
    }  # fmt: skip
    max_diff = (runners["paged"]() - runners["sdpa"]().reshape(out.shape)).abs().max().item()
    notes = [f"max|paged-sdpa| {max_diff:.1e}"]
    if use_flashinfer:
        flashinfer_run, why_not = flashinfer_decode(kv, query, device)
        if flashinfer_run is None:
            notes.append(f"flashinfer: {why_not}")
        else:
            runners["flashinfer"] = flashinfer_run
    columns = []
    for name, fn in runners.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        bandwidth = moved / (ms * 1e-3)
        columns.append(f"{name} {ms * 1e3:8.1f} us {bandwidth / 1e9:6.0f} GB/s {100 * bandwidth / peak:5.1f} %")
    splits = choose_num_splits(batch * NUM_KV_HEADS, kv.block_tables.shape[1] * BLOCK_SIZE,
                               torch.cuda.get_device_properties(device).multi_processor_count)  # fmt: skip
    print(f"{batch:6d} {context:8d} {splits:6d}  " + " | ".join(columns + notes), flush=True)
    # Free the pool and the copies before empty_cache: the runners (FlashInfer's holds its own reference)
    # first, then the names the lambdas close over (rebound, not `del`eted, since closures read them).
    runners.clear()
    kv = k_contig = v_contig = None
    torch.cuda.empty_cache()


LATENT_HEADS, LATENT_DK, LATENT_DV = 16, 576, 512
"""DeepSeek-V3's latent decode per rank at TP=8: 16 query heads over one 576-wide latent entry, V its first 512."""


def bench_latent_shape(batch: int, context: int, device: torch.device, peak: float) -> None:
    """Latent (MLA) decode: bytes moved (the latent once, query, output) over time, against the peak."""
    import triton.testing

    kv_bytes = batch * context * LATENT_DK * 2
    if kv_bytes * 1.1 > torch.cuda.mem_get_info(device)[0]:
        print(f"{batch:6d} {context:8d}  skipped: needs {kv_bytes / 2**30:.0f} GiB")
        return
    kv = make_paged_kv([context] * batch, num_kv_heads=1, head_dim=LATENT_DK, block_size=BLOCK_SIZE,
                       kv_dtype=torch.float16, device=device, poison=False, num_spare_blocks=0,
                       latent_v_head_dim=LATENT_DV)  # fmt: skip
    query = torch.randn(batch, LATENT_HEADS, LATENT_DK, device=device, dtype=torch.float16)
    out = torch.empty(batch, LATENT_HEADS, LATENT_DV, device=device, dtype=torch.float16)
    moved = kv_bytes + (query.numel() + out.numel()) * 2 + kv.block_tables.numel() * 4
    ms = triton.testing.do_bench(
        lambda: paged_decode_attention(
            query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=192**-0.5, out=out
        ),  # fmt: skip
        warmup=10,
        rep=50,
        return_mode="median",
    )
    bandwidth = moved / (ms * 1e-3)
    share = 100 * bandwidth / peak
    print(f"{batch:6d} {context:8d}  latent {ms * 1e3:8.1f} us {bandwidth / 1e9:6.0f} GB/s {share:5.1f} %")
    kv = None
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="run kernel-vs-reference checks on CUDA first")
    parser.add_argument("--check-only", action="store_true", help="run the checks and stop")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096, 32768])
    parser.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer column")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: nothing to benchmark (the kernel tests run on CPU under TRITON_INTERPRET=1).")
        return 0
    device = torch.device("cuda")
    if (args.check or args.check_only) and not run_checks(device):
        return 1
    if args.check_only:
        return 0
    peak, source = peak_bandwidth(device)
    print(f"peak bandwidth {source}; fp16, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, D={HEAD_DIM}, block {BLOCK_SIZE}")
    print(f"{'batch':>6s} {'context':>8s} {'splits':>6s}  time, achieved bandwidth, share of peak")
    start = time.perf_counter()
    for batch in args.batch:
        for context in args.context:
            bench_shape(batch, context, device, peak, not args.no_flashinfer)
    print(f"latent (MLA) decode: {LATENT_HEADS} q heads over one {LATENT_DK}-wide latent, V {LATENT_DV}, fp16")
    for batch in args.batch:
        for context in args.context:
            bench_latent_shape(batch, context, device, peak)
    print(f"benchmark took {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
