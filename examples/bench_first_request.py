"""The first token after start: where a request's TTFT goes, the first request after Warmup against later ones.

Spawns the shard as the TGI launcher does (SmolLM2-135M), connects the v3 router replay and the HTTP
stand-in, and sends ``--requests`` streaming chat requests one at a time (``--prompt-tokens`` in, a few
out), as a client such as guidellm does at concurrency 1. For each it prints the TTFT the client saw and
how much of it the shard spent in prefill steps (``tgi_paged_step_seconds{phase="prefill"}``, scraped
before and after); the rest is the stand-in's HTTP and router path plus the gRPC hop, which production
replaces with TGI's Rust router. The first row is the first request after start: if Warmup paid every
first-use cost, it matches the others. The client library's own first call (its lazy imports and HTTP client:
~20 ms on host E) is paid before timing, against a closed port (:func:`warm_client`): it is not the server's.

Usage::

    python examples/bench_first_request.py [--requests 8] [--prompt-tokens 128] [--max-new-tokens 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jovial kings".split()


def prompt_of(tokenizer, index: int, num_tokens: int) -> str:
    """A distinct prompt of about ``num_tokens`` tokens (no prefix shared with another index)."""
    words = [f"q{index}:"]
    step = 3 + index
    while len(tokenizer(" ".join(words)).input_ids) < num_tokens:
        words.append(WORDS[(len(words) * step) % len(WORDS)])
    return " ".join(words)


def prefill_seconds(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith('tgi_paged_step_seconds_sum{phase="prefill"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def warm_client() -> None:
    """One streaming chat call of the client library to a closed local port: its first-call costs, no server."""
    from huggingface_hub import InferenceClient

    from integration.net import free_port

    client = InferenceClient(base_url=f"http://127.0.0.1:{free_port()}", timeout=5)
    try:
        for _ in client.chat_completion([{"role": "user", "content": "hi"}], model="tgi", max_tokens=1, stream=True):
            pass
    except Exception:  # noqa: BLE001 - connection refused is the point
        pass


def ttft_of_chat(base_url: str, content: str, max_new_tokens: int) -> float:
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=base_url, timeout=900)
    start = time.perf_counter()
    first = None
    for _ in client.chat_completion(
        [{"role": "user", "content": content}], model="tgi", max_tokens=max_new_tokens, temperature=0, stream=True
    ):
        if first is None:
            first = time.perf_counter() - start
    assert first is not None, "no chunk streamed"
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from integration.http_api import ApiConfig, HttpStack
    from integration.launcher_spawn import LaunchedShards, LauncherOptions
    from integration.net import free_port
    from integration.peers.host import describe, host_info
    from integration.smollm2 import ensure_smollm2

    print(describe(host_info(), "float32"), flush=True)
    model = str(args.model or ensure_smollm2(progress=False))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [prompt_of(tokenizer, i, args.prompt_tokens) for i in range(args.requests)]
    metrics_port = free_port()
    uds = tempfile.mkdtemp(prefix="tgs", dir="/tmp") + "/tgs"
    env = {
        "TGI_PAGED_METRICS_PORT": str(metrics_port),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    warm_client()
    started = time.monotonic()
    with LaunchedShards(model, LauncherOptions(uds_path=uds, env=env), ready_timeout=900):
        ready = time.monotonic() - started
        with HttpStack(uds, model, config=ApiConfig(model_id="tgi")) as stack:
            rows = []
            for content in prompts:
                before = prefill_seconds(metrics_port)
                ttft = ttft_of_chat(stack.base_url, content, args.max_new_tokens)
                shard = prefill_seconds(metrics_port) - before
                rows.append((ttft, shard))
    print(f"shard ready (Warmup included) in {ready:.1f} s; {args.prompt_tokens}-token chat prompts, one at a time")
    print(f"{'request':>8} {'TTFT ms':>9} {'shard prefill ms':>17} {'stand-in + gRPC ms':>19}")
    for i, (ttft, shard) in enumerate(rows):
        label = "first" if i == 0 else str(i)
        print(f"{label:>8} {ttft * 1e3:9.0f} {shard * 1e3:17.0f} {(ttft - shard) * 1e3:19.0f}")
    later = rows[1:] or rows
    first_ttft, first_shard = rows[0]
    median_ttft = statistics.median(t for t, _ in later)
    median_shard = statistics.median(s for _, s in later)
    print(
        f"first / median of the rest: TTFT {first_ttft / median_ttft:.2f}x, shard prefill "
        f"{first_shard / max(median_shard, 1e-9):.2f}x; the stand-in's share of the median TTFT "
        f"{(median_ttft - median_shard) / median_ttft:.0%}"
    )


if __name__ == "__main__":
    main()
