"""What grammar constraints cost a decode step, and whether a new schema's compile stalls anyone.

SmolLM2-135M on this machine, the shard engine driven directly (no gRPC), greedy, EOS ignored so every
request decodes for the whole run:

1. **Mask cost**: the median decode-step time of 32 requests with 0, 1 and 8 of them constrained by a
   JSON schema, side by side in one run (ratios against 0).
2. **Compile stall**: 31 unconstrained requests decode while a 32nd arrives with a large schema that was
   never seen: the longest gap between two tokens of the others during its compile, against their
   median step; then the first-token time of that request with the schema new (compile) versus cached.

Usage::

    python examples/bench_grammar.py [--requests 32] [--steps 24] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration.smollm2 import ensure_smollm2  # noqa: E402
from tgi_paged_backend.engine import build_engine  # noqa: E402
from tgi_paged_backend.engine.types import (  # noqa: E402
    BatchSpec,
    GrammarSpec,
    RequestSpec,
    SamplingParams,
    StoppingParams,
)
from tgi_paged_backend.envs import build_config  # noqa: E402

SCHEMA = GrammarSpec(
    "json",
    json.dumps(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age"],
        }
    ),
)


def large_schema(seed: int) -> GrammarSpec:
    """A schema with many fields (its automaton takes a while to build over a 49k vocabulary)."""
    props = {f"field_{seed}_{i}": {"type": ["string", "integer", "number", "boolean"][i % 4]} for i in range(40)}
    return GrammarSpec("json", json.dumps({"type": "object", "properties": props, "required": sorted(props)}))


def request(rid: int, max_new: int, grammar: GrammarSpec | None = None) -> RequestSpec:
    return RequestSpec(
        id=rid,
        text=f"Request {rid}: describe a person as JSON.",
        truncate=1024,
        sampling=SamplingParams(grammar=grammar),
        stopping=StoppingParams(max_new_tokens=max_new, ignore_eos_token=True),
    )


def decode_times(engine, batch, steps: int) -> tuple[list[float], object]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = engine.decode([batch.id])
        times.append(time.perf_counter() - t0)
        batch = result.batch
    return times, batch


def mask_cost(engine, n: int, steps: int) -> dict[int, float]:
    medians = {}
    for constrained in (0, 1, 8):
        reqs = [request(1000 * constrained + i, steps + 4, SCHEMA if i < constrained else None) for i in range(n)]
        result = engine.prefill(BatchSpec(id=constrained + 1, requests=tuple(reqs)), None)
        batch = result.batch
        while any(engine.requests[r.id].grammar is not None and not engine.requests[r.id].grammar.ready for r in reqs):
            batch = engine.decode([batch.id]).batch  # let the schema compile (first run only)
        times, batch = decode_times(engine, batch, steps)
        medians[constrained] = statistics.median(times)
        engine.clear_cache(None)
    return medians


def compile_stall(engine, n: int, steps: int) -> dict[str, float]:
    others = [request(5000 + i, 4 * steps, None) for i in range(n - 1)]
    batch = engine.prefill(BatchSpec(id=50, requests=tuple(others)), None).batch
    base, batch = decode_times(engine, batch, steps)
    t_arrive = time.perf_counter()
    new = request(6000, 4, large_schema(0))
    result = engine.prefill(BatchSpec(id=51, requests=(new,)), batch.id)
    gaps, first_token_s = [time.perf_counter() - t_arrive], None
    batch = result.batch
    while first_token_s is None:
        t0 = time.perf_counter()
        result = engine.decode([batch.id])
        gaps.append(time.perf_counter() - t0)
        batch = result.batch
        if any(g.request_id == 6000 for g in result.generations):
            first_token_s = time.perf_counter() - t_arrive
    engine.clear_cache(None)
    # The same schema again: cached.
    others = [request(7000 + i, 8, None) for i in range(n - 1)]
    batch = engine.prefill(BatchSpec(id=52, requests=tuple(others)), None).batch
    t_arrive = time.perf_counter()
    result = engine.prefill(BatchSpec(id=53, requests=(request(8000, 4, large_schema(0)),)), batch.id)
    cached_s = None
    while cached_s is None:
        if any(g.request_id == 8000 for g in result.generations):
            cached_s = time.perf_counter() - t_arrive
            break
        result = engine.decode([result.batch.id])
    engine.clear_cache(None)
    return {
        "median_step_s": statistics.median(base),
        "admit_step_s": gaps[0],
        "max_decode_during_compile_s": max(gaps[1:], default=0.0),
        "ttft_new_schema_s": first_token_s,
        "ttft_cached_schema_s": cached_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    model = args.model or str(ensure_smollm2())
    engine = build_engine(build_config({"model_id": model}, {"TGI_PAGED_NUM_BLOCKS": "2048"}))
    engine.runner.warm_decode()  # as Warmup does: proves the native stack and direct decode
    engine.prefill(BatchSpec(id=0, requests=(request(1, 2, SCHEMA),)), None)  # vocabulary scan, warm caches
    engine.clear_cache(None)

    medians = mask_cost(engine, args.requests, args.steps)
    print(f"decode step, {args.requests} requests (median of {args.steps} steps)")
    for constrained, seconds in medians.items():
        print(f"  {constrained:2d} constrained: {seconds * 1e3:7.1f} ms   x{seconds / medians[0]:.3f} vs none")
    stall = compile_stall(engine, args.requests, args.steps)
    print(f"new large schema arriving while {args.requests - 1} requests decode")
    print(f"  others' median step         {stall['median_step_s'] * 1e3:7.1f} ms")
    print(
        f"  the Prefill that admits it     {stall['admit_step_s'] * 1e3:7.1f} ms"
        f"   x{stall['admit_step_s'] / stall['median_step_s']:.2f} the median (its prompt, the early-error wait)"
    )
    print(
        f"  others' longest decode step during its compile {stall['max_decode_during_compile_s'] * 1e3:7.1f} ms"
        f"   x{stall['max_decode_during_compile_s'] / stall['median_step_s']:.2f} the median"
    )
    print(
        f"  its first token: new schema {stall['ttft_new_schema_s']:.2f} s,"
        f" cached {stall['ttft_cached_schema_s']:.2f} s"
    )
    engine.close()


if __name__ == "__main__":
    main()
