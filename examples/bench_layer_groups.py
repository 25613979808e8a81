"""KV layer groups end to end: admitted concurrency on a tiny Gemma 3 with long generations, groups on vs off.

Writes a tiny random Gemma 3 (6 layers, 5 sliding-window layers to 1 full-attention layer, window 16 by
default), then drives the real shard engine through the router protocol
(``tgi_paged_backend.bench.layer_groups_concurrency``) twice on the same pool bytes: with one page map
per KV layer group (``TGI_PAGED_LAYER_GROUPS=1``: a block holds one layer, the sliding groups give back
blocks behind their window) and with one page map for all layers (``TGI_PAGED_LAYER_GROUPS=0``: a block
holds all 6 layers, so the same bytes are a sixth of the blocks). Short prompts, many new tokens (several
times the window), every request queued at once; the pool holds ``--fit`` whole requests with groups off.
Once with the router booking each request's worst case (``TGI_PAGED_OVERCOMMIT=1``: what it admits runs
without preemption) and once with the shard's default overcommit (the router admits more, the shard
preempts when pages run out). The figures are counts (requests, steps, blocks), not timings. Greedy: the
two runs must generate the same tokens, which the bench checks (exit status 1 otherwise).
About 30 s on 2 cores.

Usage::

    python examples/bench_layer_groups.py [--requests 16] [--max-new-tokens 160] [--window 16]
        [--block-size 8] [--fit 3] [--overcommit 1,6]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration.peers.host import describe, host_info  # noqa: E402
from tgi_paged_backend.bench.layer_groups_concurrency import (  # noqa: E402
    Comparison,
    Workload,
    compare_layer_groups,
    comparison_table,
    describe_workload,
)
from tgi_paged_backend.config import DEFAULT_OVERCOMMIT  # noqa: E402


def write_tiny_gemma3(path: Path, *, window: int, num_layers: int = 6, full_every: int = 6) -> Path:
    """The family matrix's tiny Gemma 3 (``tests/helpers/family_models.py``) with ``num_layers`` layers, every
    ``full_every``-th one full attention (Gemma 3's 5:1), the others a sliding window of ``window`` tokens."""
    from tests.helpers.family_models import FAMILY_BY_NAME, family_config
    from tests.helpers.tiny_models import write_model_from_config

    family = FAMILY_BY_NAME["Gemma3"]
    layer_types = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(num_layers)]
    overrides = {**family.overrides, "num_hidden_layers": num_layers, "sliding_window": window}
    overrides["layer_types"] = layer_types
    config = family_config(dataclasses.replace(family, overrides=overrides))
    return write_model_from_config(config, path, seed=0)


def make_prompts(num_requests: int, seed: int = 0) -> tuple[str, ...]:
    """Short prompts (2-4 words of the tiny tokenizer's corpus)."""
    from tests.helpers.tiny_models import TINY_CORPUS

    words = " ".join(TINY_CORPUS).split()
    rng = random.Random(seed)
    return tuple(" ".join(rng.choice(words) for _ in range(rng.randint(2, 4))) for _ in range(num_requests))


def prompt_lengths(model_dir: Path, prompts: tuple[str, ...]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [len(tokenizer(p).input_ids) for p in prompts]


def run(
    model_dir: Path,
    *,
    requests: int,
    max_new_tokens: int,
    block_size: int,
    fit: int,
    overcommits: list[float],
    max_prefill_tokens: int = 32,
) -> tuple[list[Comparison], str]:
    """Every comparison and the printed text (the workload line and the table)."""
    prompts = make_prompts(requests)
    lengths = prompt_lengths(model_dir, prompts)
    per_request = -(-(max(lengths) + max_new_tokens) // block_size)
    pool_blocks = fit * per_request + 2  # ``fit`` whole requests in all layers, the scratch block, one spare
    comparisons = []
    for overcommit in overcommits:
        workload = Workload(prompts, max_new_tokens, block_size, max_prefill_tokens, overcommit)
        comparisons.append(compare_layer_groups(model_dir, workload, pool_blocks=pool_blocks))
    text = "\n".join(
        [
            describe_workload(comparisons[0].workload, requests, lengths),
            f"pool: the same bytes both ways, {pool_blocks} blocks of all layers with groups off "
            f"(room for {fit} whole requests of {per_request} blocks)",
            "",
            comparison_table(comparisons),
        ]
    )
    return comparisons, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--window", type=int, default=16, help="sliding window of the 5 sliding layers (tokens)")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--fit", type=int, default=3, help="whole requests the pool holds with groups off")
    parser.add_argument(
        "--overcommit", default=f"1,{DEFAULT_OVERCOMMIT:g}", help="TGI_PAGED_OVERCOMMIT values, comma-separated"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: fastest on a tiny model)")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    import transformers
    from loguru import logger

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    logger.remove()  # the shard's Warmup and pressure lines would interleave with the table
    logger.add(sys.stderr, level="ERROR")

    print(describe(host_info(), "float32"))
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; torch threads: {args.threads}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tiny-gemma3-") as tmp:
        model_dir = write_tiny_gemma3(Path(tmp), window=args.window)
        print(
            f"model: tiny random Gemma 3, 6 layers (5 sliding-window of {args.window} tokens : 1 full), "
            "hidden 64, 2 KV heads x 16"
        )
        comparisons, text = run(
            model_dir,
            requests=args.requests,
            max_new_tokens=args.max_new_tokens,
            block_size=args.block_size,
            fit=args.fit,
            overcommits=[float(x) for x in args.overcommit.split(",")],
        )
    print(text)
    print(f"({time.monotonic() - started:.0f} s; the figures are counts, not timings)")
    if not all(c.same_tokens for c in comparisons):
        print("ERROR: groups on and off generated different tokens", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
