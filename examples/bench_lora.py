"""Multi-LoRA cost on SmolLM2: one 32-request burst with 0, 1, 4 and 16 adapters mixed, side by side in one run.

Two engines over the same model in one process: ``base`` without ``LORA_ADAPTERS``, and ``lora`` with 16
random rank-8 adapters on all seven projections (PEFT's on-disk format, written once under ``--out``).
Each scenario sends the same burst (``--requests`` prompts of 40-80 tokens, ``--max-new`` greedy tokens,
ignore EOS) straight to the engine (no router, no gRPC); request ``i`` uses adapter ``i % k``. Runs
alternate scenario by scenario for ``--repeats`` rounds; printed: median burst wall time, generated
tokens/s, median decode step, each against the base engine, and the KV blocks the adapters' bytes cost.
``--per-op`` adds, for each scenario with adapters used, the same burst with the native decode layers' LoRA
switched off (adapter rows on the per-op path, as before the deltas joined the native call), alternated with
the others; ``--used`` picks the scenarios.

    .venv/bin/python examples/bench_lora.py [--requests 32] [--max-new 32] [--repeats 3] [--threads 2]
        [--used 0,1,4,16] [--per-op] [--adapter-dtype float32|bfloat16] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.peers.host import describe, host_info  # noqa: E402
from integration.smollm2 import ensure_smollm2  # noqa: E402
from tgi_paged_backend.engine import build_engine  # noqa: E402
from tgi_paged_backend.engine.types import BatchSpec, RequestSpec, StoppingParams  # noqa: E402
from tgi_paged_backend.envs import build_config  # noqa: E402
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_ADAPTERS = 16
RANK = 8
WORDS = "the of and to in is was for on that with as by at from his her they this which model memory block".split()


def write_adapters(model_dir: Path, out: Path, count: int, dtype: torch.dtype = torch.float32) -> list[Path]:
    """``count`` random rank-8 PEFT adapters of ``model_dir`` (config and safetensors as PEFT writes them), their
    A and B saved in ``dtype`` (bf16: as PEFT saves adapters trained on a bf16 model)."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.AutoConfig.from_pretrained(model_dir)
    hidden, inter, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    head_dim = hidden // heads
    kv = config.num_key_value_heads * head_dim
    shapes = {  # (in, out) of each target
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    dirs = []
    for i in range(count):
        path = out / f"adapter-{i:02d}"
        dirs.append(path)
        if (path / "adapter_model.safetensors").is_file():
            continue
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for name, (n_in, n_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{name}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(RANK, n_in, generator=gen) / n_in**0.5).to(dtype)
                tensors[f"{key}.lora_B.weight"] = (0.01 * torch.randn(n_out, RANK, generator=gen)).to(dtype)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "r": RANK,
            "lora_alpha": 2 * RANK,
            "target_modules": list(TARGETS),
            "bias": "none",
            "base_model_name_or_path": str(model_dir),
        }
        (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return dirs


def burst(num: int, max_new: int, num_adapters: int, seed: int = 0) -> tuple[RequestSpec, ...]:
    rng = random.Random(seed)
    return tuple(
        RequestSpec(
            id=i + 1,
            text=" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 80))),
            truncate=4096,
            stopping=StoppingParams(max_new_tokens=max_new, ignore_eos_token=True),
            adapter_id=f"a{i % num_adapters:02d}" if num_adapters else "",
        )
        for i in range(num)
    )


@contextmanager
def native_lora(engine, on: bool):
    """The engine's native decode layers add the LoRA deltas in their call (``on``) or leave adapter rows to the
    per-op path."""
    layers = [m for m in engine.runner.model.modules() if isinstance(m, NativeDecoderLayer)]
    kept = [layer.lora for layer in layers]
    if not on:
        for layer in layers:
            layer.lora = None
    try:
        yield
    finally:
        for layer, lora in zip(layers, kept):
            layer.lora = lora


def run_burst(engine, requests: tuple[RequestSpec, ...], batch_id: int) -> tuple[float, int, list[float]]:
    """Wall seconds, generated tokens and decode step seconds of one burst, to the last token."""
    live = {r.id for r in requests}
    generated, decode_s = 0, []
    start = time.perf_counter()
    result = engine.prefill(BatchSpec(id=batch_id, requests=requests), None)
    while True:
        for g in result.generations:
            generated += len(g.tokens.ids)
            if g.generated_text is not None:
                live.discard(g.request_id)
        if not live:
            break
        t0 = time.perf_counter()
        result = engine.decode([batch_id])
        decode_s.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    engine.release_batches([batch_id])
    return wall, generated, decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/bench/lora"))
    parser.add_argument("--used", default="0,1,4,16", help="adapters used per scenario, comma-separated")
    parser.add_argument("--per-op", action="store_true", help="also each scenario with LoRA rows on the per-op path")
    parser.add_argument(
        "--adapter-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the adapter files (bfloat16: they stay bf16 on the fp32 model, half the bytes)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's --dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe(host_info(), args.dtype))
    model = ensure_smollm2(progress=False)
    dtype = getattr(torch, args.adapter_dtype)
    out = args.out if dtype == torch.float32 else args.out.with_name(f"{args.out.name}-{args.adapter_dtype}")
    adapters = write_adapters(model, out, NUM_ADAPTERS, dtype)
    knobs = {"TGI_PAGED_NUM_BLOCKS": "1024", "PREFIX_CACHING": "0"}
    served = {"model_id": str(model), "dtype": args.dtype}
    base = build_engine(build_config(served, knobs))
    lora_list = ",".join(f"a{i:02d}={path}" for i, path in enumerate(adapters))
    lora = build_engine(build_config(served, {**knobs, "LORA_ADAPTERS": lora_list}))
    runner = lora.runner
    print(
        f"{args.dtype} model, {NUM_ADAPTERS} {args.adapter_dtype} adapters, rank {RANK}, "
        f"7 projections x {runner.spec.num_layers} layers: "
        f"{runner.lora_bytes / 2**20:.1f} MiB = {runner.lora_bytes / runner.block_bytes:.0f} KV blocks of "
        f"{runner.block_size} tokens ({runner.block_bytes / 2**10:.0f} KiB each, {runner.kv_dtype})"
    )
    used = [int(k) for k in args.used.split(",")]
    scenarios = [("base engine (no LORA_ADAPTERS)", base, 0, True)]
    for k in used:
        scenarios.append((f"16 loaded, {k} used", lora, k, True))
        if args.per_op and k:
            scenarios.append((f"16 loaded, {k} used, per-op LoRA", lora, k, False))
    results: dict[str, list[tuple[float, int, list[float]]]] = {name: [] for name, _, _, _ in scenarios}
    for engine in (base, lora):
        engine.runner.warm_decode()  # as Warmup does: proves the native stack (one call for all layers a step)
    run_burst(base, burst(4, 4, 0), 999)  # first-call costs out of the figures
    run_burst(lora, burst(4, 4, 4), 999)
    batch_id = 1
    for _ in range(args.repeats):
        for name, engine, k, native in scenarios:
            with native_lora(engine, native):
                results[name].append(run_burst(engine, burst(args.requests, args.max_new, k), batch_id))
            batch_id += 1
    ref_wall = statistics.median(w for w, _, _ in results[scenarios[0][0]])
    ref_step = statistics.median(s for _, _, steps in results[scenarios[0][0]] for s in steps)
    print(f"\n{args.requests}-request burst, {args.max_new} new tokens each, median of {args.repeats} runs")
    print(f"{'scenario':34} {'burst s':>8} {'tok/s':>8} {'vs base':>8} {'decode ms':>10} {'vs base':>8}")
    for name, _, _, _ in scenarios:
        wall = statistics.median(w for w, _, _ in results[name])
        tokens = results[name][0][1]
        step = statistics.median(s for _, _, steps in results[name] for s in steps)
        print(
            f"{name:34} {wall:8.2f} {tokens / wall:8.1f} {ref_wall / wall:7.2f}x "
            f"{step * 1e3:10.1f} {ref_step / step:7.2f}x"
        )


if __name__ == "__main__":
    main()
