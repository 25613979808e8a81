"""Sliding-window block reclaim: peak KV blocks with and without it on long requests (no model, no GPU).

Mistral-7B-v0.1 (every layer windowed, 4096) on long prompts and long generations, and Gemma-2-9B /
Gemma-3-27B / gpt-oss-20b (sliding layers mixed with full ones), each simulated through the real
``KVCacheManager`` with the reclaim window the engine would use for one page map and without one
(``tgi_paged_backend.bench.sliding_window``). For the mixed models, the analytic share one page map per
layer group saves at the final length, and the measured one: the same run through the manager with the
engine's KV layer groups (KV bytes saved at the peak and at the end). About 15 s.

Usage::

    python examples/bench_sliding_window.py [--block-size 16] [--max-prefill-tokens 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tgi_paged_backend.bench.sliding_window import long_run_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-prefill-tokens", type=int, default=4096)
    args = parser.parse_args()
    print(long_run_table(block_size=args.block_size, max_prefill_tokens=args.max_prefill_tokens))


if __name__ == "__main__":
    main()
