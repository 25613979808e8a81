"""A mixed text + image burst on LLaVA-NeXT (issue 40): tokens/s and TTFT, with and without prefix hits on a
repeated image.

Writes the tiny random LLaVA-NeXT of the tests (CLIP tower, Llama language model), starts the shard engine,
serves one request with an image (it fills the prefix cache), then a burst admitted in one Prefill: half
text-only, half with the same text before an image. ``repeated``: every image request carries the image of
the first request (its blocks hit, the tower does not run); ``distinct``: each carries an image of its own
with the same size (the same placeholders; only the text before the image hits, each image is encoded).
Greedy tokens of the image requests must differ between the runs (other images) and the text-only ones must
not. The burst is one Prefill, so every request's first token comes from the same step (TTFT is that step's
time for image and text requests alike). CPU figures of a tiny model: the harness and the prefix effect,
not a serving claim.

Usage::

    python examples/bench_vlm_burst.py [--requests 12] [--max-new-tokens 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.engine.conftest import make_engine, make_text  # noqa: E402
from tests.helpers.llava_next_models import png_bytes, write_llava_next_model  # noqa: E402
from tgi_paged_backend.engine.types import BatchSpec, ImageInput, RequestSpec, StoppingParams  # noqa: E402


def _request(rid: int, prefix: str, image: bytes | None, max_new: int) -> RequestSpec:
    chunks = (prefix, ImageInput(image, "image/png"), " what is it?") if image is not None else ()
    text = prefix + (" what is it?" if image is not None else "")
    stopping = StoppingParams(max_new_tokens=max_new, ignore_eos_token=True)
    return RequestSpec(id=rid, text=text, truncate=10_000, chunks=chunks, stopping=stopping)


def run(model_dir: Path, mode: str, num_requests: int, max_new: int, seed: int) -> dict:
    engine = make_engine(model_dir, num_blocks=512, block_size=8)
    engine.runner.warm_decode()  # as Warmup does: proves the native stack and direct decode
    prefix = make_text(1, 12)
    first = png_bytes(64, 64, 100)
    engine.prefill(BatchSpec(id=1, requests=(_request(1, prefix, first, 1),)), None)  # fills the prefix cache
    engine.clear_cache(None)
    specs = []
    for i in range(num_requests):
        rid = 100 + i
        if i % 2:
            specs.append(_request(rid, make_text(rid + seed, 12), None, max_new))
        else:
            specs.append(_request(rid, prefix, first if mode == "repeated" else png_bytes(64, 64, rid + seed), max_new))
    hits_before = engine.stats.prefix_hit_tokens
    first_token: dict[int, float] = {}
    tokens: dict[int, list[int]] = {s.id: [] for s in specs}
    start = time.perf_counter()
    result = engine.prefill(BatchSpec(id=2, requests=tuple(specs)), None)
    while True:
        now = time.perf_counter() - start
        for g in result.generations:
            first_token.setdefault(g.request_id, now)
            tokens[g.request_id].extend(g.tokens.ids)
        if result.batch is None:
            break
        result = engine.decode([result.batch.id])
    wall = time.perf_counter() - start
    image_ttft = [first_token[s.id] for s in specs if s.chunks]
    text_ttft = [first_token[s.id] for s in specs if not s.chunks]
    return {
        "tokens_per_s": sum(len(t) for t in tokens.values()) / wall,
        "ttft_image_ms": 1000 * statistics.median(image_ttft),
        "ttft_text_ms": 1000 * statistics.median(text_ttft),
        "prefix_hit_tokens": engine.stats.prefix_hit_tokens - hits_before,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_llava_next_model(Path(tmp) / "llava")
        results: dict[str, list[dict]] = {"repeated": [], "distinct": []}
        for _ in range(args.repeats):  # alternated, so host load hits both alike
            for mode in results:
                results[mode].append(run(model_dir, mode, args.requests, args.max_new_tokens, seed=0))
    print(f"{args.requests} requests (half with a 64x64 image, 88 placeholders), {args.max_new_tokens} new tokens")
    print("| image | tokens/s | TTFT image req. (ms) | TTFT text req. (ms) | prefix-hit tokens |")
    print("|---|---|---|---|---|")
    for mode, runs in results.items():
        best = max(runs, key=lambda r: r["tokens_per_s"])
        ttft_image = statistics.median(r["ttft_image_ms"] for r in runs)
        ttft_text = statistics.median(r["ttft_text_ms"] for r in runs)
        hits = best["prefix_hit_tokens"]
        print(f"| {mode} | {best['tokens_per_s']:.0f} | {ttft_image:.1f} | {ttft_text:.1f} | {hits} |")
    rep, dis = results["repeated"][0]["tokens"], results["distinct"][0]["tokens"]
    text_same = all(rep[k] == dis[k] for k in rep if (k - 100) % 2)
    image_differ = any(rep[k] != dis[k] for k in rep if (k - 100) % 2 == 0)
    print(f"text-only tokens identical across runs: {text_same}; image requests' tokens differ: {image_differ}")
    return 0 if text_same and image_differ else 1


if __name__ == "__main__":
    raise SystemExit(main())
