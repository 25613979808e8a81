"""One CPU decode step of the model forward, variant against variant in one process (ratios, one run).

Builds one :class:`ModelRunner` per variant over the same model, runs the same decode batch (``--rows``
requests, contexts drawn in 40..200, block 16) through each, alternating a step of each for ``--steps``
rounds, and prints median and min ms per step with the host's CPU and load. Variants:

- ``default``: what serving runs (native C++ kernels, fused attention and MLP blocks, native decode layers
  where they apply, packed linears);
- ``per-layer``: the default with one native call per layer (the model's stack of native layers, one call per
  decode step, kept off: ``runner.native.stack``);
- ``per-op``: the default without the native decode layers (``TGI_PAGED_NATIVE_LAYERS=0``);
- ``unfused``: without the block fusion (``runner.cpu.fused_blocks``, hence no native decode layers either);
- ``no-amx``: the default with the bf16 GEMM's AMX tiles and vdpbf16ps off (``cpu_gemm.set_bf16_amx``,
  ``set_bf16_dot``: the widening path), switched per step;
- ``all-packed``: the default with every linear packed for any row count (no ``F.linear`` below
  ``fast_layers.PACK_MIN_ELEMENTS``);
- ``compiled`` / ``sdpa``: ``TGI_PAGED_CPU_DECODE=compiled`` / ``sdpa`` decode attention, unfused, with
  torch's RMSNorm: the forward as it was before the native kernels (``compiled`` was the default).

    .venv/bin/python examples/bench_forward.py [--model smollm2|hostbound|hostbound-qwen3|...|DIR] [--rows 20]
        [--threads 2] [--variants default per-layer per-op unfused compiled] [--prefill TOKENS] [--quantize gptq]
        [--dtypes float32 bfloat16]

``--prefill TOKENS`` times a prefill step of fresh prompts (17-156 tokens each, about TOKENS in all) instead.
``--dtypes``: each variant in each model dtype (``bfloat16``: bf16 weights and KV pool; the native layers then run
bf16-packed weights), printed as ``variant/dtype``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.peers.host import describe, host_info  # noqa: E402
from integration.peers.hostbound import HostBoundSpec, ensure_hostbound_model  # noqa: E402
from integration.peers.hostbound_forms import FORMS  # noqa: E402
from tgi_paged_backend.bench.decode_step import random_decode_step, random_prefill_step  # noqa: E402
from tgi_paged_backend.config import CacheConfig, ModelConfig  # noqa: E402
from tgi_paged_backend.runner import model_runner  # noqa: E402
from tgi_paged_backend.runner.cpu import fast_layers  # noqa: E402
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites  # noqa: E402
from tgi_paged_kernels import cpu_native  # noqa: E402
from tgi_paged_kernels.cpu_gemm import set_bf16_amx, set_bf16_dot  # noqa: E402

BLOCK_SIZE = 16
SMOLLM2 = Path.home() / ".cache" / "tgi-paged-backend" / "SmolLM2-135M-Instruct"
VARIANTS = ("default", "per-layer", "per-op", "unfused", "compiled", "sdpa", "all-packed", "no-amx")


def _model_dir(name: str) -> str:
    if name == "smollm2":
        return str(SMOLLM2)
    if name == "hostbound" or (name.startswith("hostbound-") and name[10:] in FORMS):  # hostbound-qwen3: a form
        spec = HostBoundSpec(form=name.removeprefix("hostbound-") if name != "hostbound" else "llama")
        return str(ensure_hostbound_model(Path("out/bench"), SMOLLM2, spec))  # where bench_peers.py keeps it
    return name


def build(variant: str, model: str, quantize: str | None = None, dtype: str = "float32") -> model_runner.ModelRunner:
    """A runner of ``variant`` (see the module docstring)."""
    real_min = fast_layers.PACK_MIN_ELEMENTS
    native_layers = variant in ("default", "per-layer", "all-packed", "no-amx")
    without = () if native_layers else ("fuse",)
    if variant == "all-packed":
        fast_layers.PACK_MIN_ELEMENTS = 0
    try:
        kernel = variant if variant in ("compiled", "sdpa") else "native"
        runner = model_runner.ModelRunner(
            ModelConfig(
                model_id=model,
                cpu_decode=kernel,
                native_layers=native_layers,
                quantize=quantize,
                dtype=dtype,
            ),
            CacheConfig(block_size=BLOCK_SIZE),
            rewrites=model_rewrites(without=without),
        )
    finally:
        fast_layers.PACK_MIN_ELEMENTS = real_min
    if variant in ("compiled", "sdpa"):
        for module in runner.model.modules():
            if isinstance(module, fast_layers.FusedRMSNorm):
                module.native = None
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, hostbound or a model directory")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["default", "per-op", "unfused", "compiled"])
    parser.add_argument("--prefill", type=int, default=0, help="time a prefill step of about this many tokens")
    parser.add_argument("--quantize", default=None, help="--quantize of a quantized checkpoint (gptq, ...)")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe(host_info(), "/".join(args.dtypes)))
    model = _model_dir(args.model)
    names = [v if args.dtypes == ["float32"] else f"{v}/{d}" for d in args.dtypes for v in args.variants]
    pairs = [(v, d) for d in args.dtypes for v in args.variants]
    runners = {n: build(v, model, args.quantize, d) for n, (v, d) in zip(names, pairs)}
    step = random_prefill_step(args.prefill, BLOCK_SIZE) if args.prefill else random_decode_step(args.rows, BLOCK_SIZE)
    batch = step.batch
    native = cpu_native.native_kernels()

    dot_default = set_bf16_dot(native) if native is not None else False

    def amx_for(name: str) -> None:
        if native is not None:
            set_bf16_amx(native, not name.startswith("no-amx"))
            set_bf16_dot(native, dot_default and not name.startswith("no-amx"))

    for name, runner in runners.items():
        amx_for(name)
        runner.allocate_kv_cache(step.num_blocks)
        runner.warm_decode()
        for stack in runner.native_layers.stacks if name.startswith("per-layer") and runner.native_layers else ():
            stack.enabled = False
        for _ in range(3):
            runner.forward(batch)
    times: dict[str, list[float]] = {variant: [] for variant in runners}
    for _ in range(args.steps):
        for variant, runner in runners.items():
            amx_for(variant)
            start = time.perf_counter()
            runner.forward(batch)
            times[variant].append(1000 * (time.perf_counter() - start))
    shape = f"prefill step, {batch.num_tokens} tokens" if args.prefill else f"decode step, {args.rows} rows"
    print(f"{shape}, {args.model}, {args.threads} threads, {args.steps} steps each, alternated:")
    first = statistics.median(times[names[0]])
    for variant, ts in times.items():
        median = statistics.median(ts)
        print(f"  {variant:9s} median {median:7.2f} ms, min {min(ts):7.2f} ms  ({median / first:.2f}x {names[0]})")


if __name__ == "__main__":
    main()
