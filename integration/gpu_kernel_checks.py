"""Phase a of the GPU check (``integration/gpu_check.py``): the Triton kernels against their references
on CUDA, then decode bandwidth.

The attention and cache cases are ``examples/bench_paged_attention.py``'s ``--check`` list (store_kv,
paged decode single pass and split-K, paged prefill, copy/swap blocks; fp16/bf16/fp32/fp8 caches),
run here one by one under a time limit; fp8_linear and int4/int8 int_linear are checked at model
shapes against the fp32 references in ``tgi_paged_kernels``; the host tier's copy-stream moves against
the inline copies.
"""

from __future__ import annotations

import importlib.util
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
KERNEL_CHECKS_S = 180.0
"""At most this long (and 40 % of the budget) for the attention checks; the rest are reported as not run."""


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_paged_attention", REPO / "examples/bench_paged_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LINEAR_TOLERANCE = {torch.float16: 8 * 2.0**-11, torch.bfloat16: 8 * 2.0**-8}
"""Max |Triton - fp32 reference| over the reference's RMS: 8 ulps of the activation dtype (weights and
output are rounded to it once each; the K-long fp32 sums differ only in order)."""


def check_linears(device: torch.device) -> int:
    """fp8_linear and int4/int8 int_linear against their fp32 references at SmolLM2/Llama-like shapes."""
    from tgi_paged_backend.runner.quant.fp8 import quantize_fp8_per_channel
    from tgi_paged_kernels import fp8_linear, int_linear
    from tgi_paged_kernels.fp8_gemm import fp8_linear_reference
    from tgi_paged_kernels.int_gemm import int_linear_reference, pack_codes

    failures, group = 0, 64
    for dtype in (torch.float16, torch.bfloat16):
        for m, n, k in ((1, 1536, 576), (37, 576, 1536), (256, 4096, 4096)):
            torch.manual_seed(m + n + k)
            x = torch.randn(m, k, device=device).to(dtype)
            bias = (0.1 * torch.randn(n, device=device)).to(dtype)
            qweight, scale = (t.to(device) for t in quantize_fp8_per_channel(torch.randn(n, k) * 0.02))
            # partial binds this iteration's tensors now (a lambda would read the loop variables late).
            cases = {
                "fp8_linear": (
                    partial(fp8_linear, x, qweight, scale, bias),
                    partial(fp8_linear_reference, x, qweight, scale, bias),
                )
            }
            for bits in (4, 8):
                codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
                args = (
                    pack_codes(codes, bits).to(device),
                    (torch.rand(n, k // group) * 0.04 / (1 << bits)).to(device),  # |w| ~ 0.02
                    torch.randint(0, 1 << bits, (n, k // group), dtype=torch.uint8).to(device),
                    (torch.arange(k) // group).to(torch.int32).to(device),
                    bits,
                )
                cases[f"int{bits}_linear"] = (
                    partial(int_linear, x, *args, bias),
                    partial(int_linear_reference, x, *args, bias),
                )
            for name, (run, ref) in cases.items():
                try:
                    got, want = run().float(), ref().float()
                    assert got.shape == want.shape, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
                    ratio = ((got - want).abs().max() / want.pow(2).mean().sqrt()).item()
                    status = "ok" if ratio <= LINEAR_TOLERANCE[dtype] else "FAIL"
                    status += f" (max err / rms {ratio:.1e}, bound {LINEAR_TOLERANCE[dtype]:.1e})"
                except Exception as error:  # noqa: BLE001 - report each case and go on
                    status = f"FAIL {type(error).__name__}: " + (str(error).splitlines() or [""])[0][:120]
                failures += status.startswith("FAIL")
                print(f"  check {name:12s} {str(dtype)[6:]:8s} M={m} N={n} K={k}: {status}", flush=True)
    return failures


def attention_checks(bench, device: torch.device, deadline: float) -> tuple[int, int]:
    """The bench's ``--check`` cases (same list and order as its ``run_checks``), stopped at ``deadline``.

    Returns ``(failures, cases not run)``; every case prints ``ok`` or ``FAIL`` with the reason.
    """
    cases = [
        (kind, case)
        for kind in ("decode", "prefill")
        for case in bench.CHECK_CASES
        if not (kind == "prefill" and "num_splits" in case and len(case) == 1)
    ]
    cases.append(("cache ops", None))
    failures = 0
    for done, (kind, case) in enumerate(cases):
        if time.monotonic() > deadline:
            print(f"  {len(cases) - done} check cases NOT RUN: the kernel phase's time is spent")
            return failures, len(cases) - done
        torch.manual_seed(0)
        try:
            bench.check_cache_ops(device) if case is None else bench.check_attention_case(kind, case, device)
            status = "ok"
        except Exception as error:  # noqa: BLE001 - report every case (compile errors too) and go on
            failures += 1
            status = f"FAIL {type(error).__name__}: " + (str(error).splitlines() or [""])[0][:120]
        print(f"  check {kind:9s} {case or ''}: {status}", flush=True)
    return failures, 0


def check_tier_copies(device: torch.device) -> int:
    """The host tier's copy-stream moves against the inline copies (``tests/offload/test_tier_copies.py``)."""
    from tests.offload.test_tier_copies import check_stream_copies

    try:
        check_stream_copies(device)
    except Exception as error:  # noqa: BLE001 - reported with the other kernel checks
        print(f"  check tier copies (copy stream vs inline): FAIL {type(error).__name__}: {error}", flush=True)
        return 1
    print("  check tier copies (copy stream vs inline): ok", flush=True)
    return 0


def phase_kernels(budget, device: torch.device) -> bool:
    """``budget``: the driver's ``Budget`` (``phase``, ``allows``, ``total_s``)."""
    bench = load_bench()
    with budget.phase("a. kernels vs references (CUDA)"):
        deadline = time.monotonic() + min(KERNEL_CHECKS_S, budget.total_s * 0.4)
        failures, not_run = attention_checks(bench, device, deadline)
        print(f"attention and cache checks: {failures} failed, {not_run} not run")
        linear_failures = check_linears(device)
        print(f"linear checks: {linear_failures} failed")
        linear_failures += check_tier_copies(device)
    if budget.allows("a. decode bandwidth", 60):
        with budget.phase("a. decode bandwidth (fp16, 32 q / 8 kv heads, D=128, block 16)"):
            peak, source = bench.peak_bandwidth(device)
            print(f"peak {source}")
            for batch, context in ((1, 32768), (32, 4096), (256, 4096), (64, 32768)):
                bench.bench_shape(batch, context, device, peak, use_flashinfer=True)
            print("latent (MLA) decode, 16 q heads, 576/512:")
            for batch, context in ((32, 4096), (64, 32768)):
                bench.bench_latent_shape(batch, context, device, peak)
    torch.cuda.empty_cache()  # leave the device's memory to the shard's Warmup
    return failures == 0 and not_run == 0 and linear_failures == 0
