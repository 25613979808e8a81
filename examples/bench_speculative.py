"""Speculative decoding (``--speculate N``, n-gram drafts) on SmolLM2: N = 0, 2, 4 side by side in one run.

Three engines over the same model in one process (``speculate`` 0, 2 and 4, prefix caching off). Two
workloads of SmolLM2-135M-Instruct chat prompts (its own chat template), greedy, EOS honoured unless
``--ignore-eos``, at most ``--max-new`` tokens:

- ``repetitive``: outputs that copy the input (repeat a paragraph, fix the typos in a function and return
  the whole file, summarise quoting key sentences);
- ``chat``: short open questions.

Each workload runs as one batch of ``--requests`` requests, and request by request (``--single`` of them,
batch 1: where latency matters most), straight on the engine (prefill, then decode until the batch is
gone). Printed per (workload, mode, N), over the whole run:

- ``accept``: accepted / proposed draft tokens (``engine.stats``);
- ``tok/gen``: generated tokens / Generations, i.e. tokens per request per forward step (one Generation is
  one request's share of one step; 1.0 without speculation);
- ``tok/s``: generated tokens / wall time (prefill included), and its ratio to N=0;
- ``ITL p50/p99``: per-token gaps, each request's tokens in arrival order after its first token; a token's
  gap is the time since the previous token arrived, so the tokens of one multi-token Generation arrive
  together (the first carries the step's gap, the others 0 ms), as a streaming client sees them;
- ``step``: median time between a request's successive Generations (the cost of one forward as a request
  sees it: decode path at N=0, the multi-position verify path with a draft), and its ratio to N=0.

Every row runs ``--repeats`` times (interleaved with the other rows, so drift hits all alike); timings are
the runs' medians and ``range`` is the min-max of the per-run tok/s ratio to N=0 (on 2 shared cores the
batched ratios move by +-20 % between runs).

Engines: N = 0, 2, 4 with the default ``TGI_PAGED_SPECULATE_MAX_BATCH`` (on CPU: a step drafts only when
one request decodes), and ``4 all``: N = 4 drafting at every batch size (what the limit avoids).

Correctness oracle: every request's greedy tokens at N=2 and N=4 must equal N=0's token for token; any
mismatch is printed loudly and the script exits 1.

    .venv/bin/python examples/bench_speculative.py [--requests 8] [--single 4] [--max-new 96] [--threads 2]
        [--repeats 3] [--ignore-eos]
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
from integration.smollm2 import ensure_smollm2  # noqa: E402
from tgi_paged_backend.engine import build_engine  # noqa: E402
from tgi_paged_backend.engine.types import BatchSpec, RequestSpec, StoppingParams  # noqa: E402
from tgi_paged_backend.envs import build_config  # noqa: E402

SPECULATE = {"0": (0, None), "2": (2, None), "4": (4, None), "4 all": (4, 1024)}
"""Engine label -> (``--speculate``, ``TGI_PAGED_SPECULATE_MAX_BATCH``): the defaults (on CPU a step drafts
only when one request decodes), and N = 4 drafting at every batch size."""
PARA_A = (
    "The lighthouse at the end of the harbour was built in 1873 from granite quarried on the island. For "
    "almost a century its keepers climbed one hundred and twelve steps every evening to light the lamp. "
    "In 1968 the light was automated, and the keepers' cottage became a small museum. Today the museum "
    "shows the original lens, the keepers' logbooks and a model of the ships that were wrecked nearby."
)
PARA_B = (
    "Bread dough rises because yeast feeds on the sugars in the flour and releases carbon dioxide. The gas "
    "is trapped by a network of gluten, which forms when the flour is mixed with water and kneaded. A "
    "warm kitchen speeds the process up, while a cold one slows it down. Many bakers let the dough rise "
    "slowly overnight in the fridge, because a long rise gives the bread a deeper flavour."
)
CODE_A = '''def average_scores(students):
    """Return the average score of each student."""
    results = {}
    for name, scores in students.items():
        if not scores:
            results[name] = 0.0
            contniue
        total = 0
        for score in scroes:
            total += score
        results[name] = total / len(scores)
    return resutls


def best_student(students):
    averages = average_scores(students)
    best_name = None
    best_score = -1.0
    for name, score in averages.itmes():
        if score > best_score:
            best_name, best_score = name, score
    retrun best_name
'''
CODE_B = '''def parse_config(path):
    """Read key=value lines from a file into a dictionary."""
    config = {}
    with open(path) as handel:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            config[key.strip()] = value.stirp()
    return config


def get_int(config, key, default=0):
    value = config.get(key)
    if value is None:
        return defualt
    try:
        return int(vlaue)
    except ValueError:
        return default
'''
WORKLOADS = {
    "repetitive": [
        f"Repeat the following text exactly:\n\n{PARA_A}",
        f"Fix the typos in this code and return the whole file:\n\n{CODE_A}",
        f"Summarise, quoting the key sentences:\n\n{PARA_B}",
        f"Fix the typos in this code and return the whole file:\n\n{CODE_B}",
        f"Repeat the following text exactly:\n\n{PARA_B}",
        f"Summarise, quoting the key sentences:\n\n{PARA_A}",
        f"Add a comment above every loop in this code and return the whole file:\n\n{CODE_B}",
        f"Rewrite this paragraph, keeping every sentence but putting it in a bulleted list:\n\n{PARA_A}",
    ],
    "chat": [
        "What are three good habits for staying healthy?",
        "Why is the sky blue?",
        "Give me some ideas for a birthday party for a ten-year-old.",
        "How does a refrigerator keep food cold?",
        "What should I pack for a weekend hiking trip?",
        "Explain what a computer program is to a child.",
        "What are the pros and cons of working from home?",
        "How can I get better at remembering people's names?",
    ],
}


def requests(texts: list[str], max_new: int, ignore_eos: bool, first_id: int) -> tuple[RequestSpec, ...]:
    stopping = StoppingParams(max_new_tokens=max_new, ignore_eos_token=ignore_eos)
    return tuple(
        RequestSpec(id=first_id + i, text=t, truncate=4096, add_special_tokens=False, stopping=stopping)
        for i, t in enumerate(texts)
    )


def run_batch(engine, reqs: tuple[RequestSpec, ...], batch_id: int):
    """Token ids per request, (arrival time, n tokens) per Generation per request, wall seconds."""
    live = {r.id for r in reqs}
    tokens: dict[int, list[int]] = {r.id: [] for r in reqs}
    arrivals: dict[int, list[tuple[float, int]]] = {r.id: [] for r in reqs}
    start = time.perf_counter()
    result = engine.prefill(BatchSpec(id=batch_id, requests=reqs), None)
    while True:
        now = time.perf_counter()
        for g in result.generations:
            tokens[g.request_id].extend(g.tokens.ids)
            arrivals[g.request_id].append((now, len(g.tokens.ids)))
            if g.generated_text is not None:
                live.discard(g.request_id)
        if not live:
            break
        result = engine.decode([batch_id])
    wall = time.perf_counter() - start
    engine.release_batches([batch_id])
    return tokens, arrivals, wall


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def measure(engine, batches: list[tuple[RequestSpec, ...]], batch_id: int) -> dict:
    """Run ``batches`` one after the other; the figures over all of them."""
    before = (engine.stats.draft_tokens, engine.stats.accepted_tokens, engine.stats.num_steps)
    tokens, gaps, step_gaps, wall, generations = {}, [], [], 0.0, 0
    for i, reqs in enumerate(batches):
        toks, arrivals, w = run_batch(engine, reqs, batch_id + i)
        tokens.update(toks)
        wall += w
        for arr in arrivals.values():
            generations += len(arr)
            for (t0, _), (t1, n) in zip(arr, arr[1:]):
                gaps.extend([t1 - t0] + [0.0] * (n - 1))
                step_gaps.append(t1 - t0)
    drafted = engine.stats.draft_tokens - before[0]
    generated = sum(len(t) for t in tokens.values())
    return {
        "tokens": tokens,
        "accept": (engine.stats.accepted_tokens - before[1]) / drafted if drafted else float("nan"),
        "drafted": drafted,
        "tok_per_gen": generated / generations,
        "steps": engine.stats.num_steps - before[2],
        "generated": generated,
        "tok_s": generated / wall,
        "itl50": percentile(gaps, 0.5),
        "itl99": percentile(gaps, 0.99),
        "step": statistics.median(step_gaps),
    }


def _median_run(runs: list[dict]) -> dict:
    """The first run's counts and tokens (identical in every run: greedy) with the runs' median timings."""
    first = dict(runs[0])
    for key in ("tok_s", "itl50", "itl99", "step"):
        first[key] = statistics.median(r[key] for r in runs)
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="requests in the batched run")
    parser.add_argument("--single", type=int, default=4, help="prompts run alone, one after the other")
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of every row (interleaved); medians shown")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe(host_info(), "float32"))
    model = ensure_smollm2(progress=False)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)

    def chat(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    knobs = {"TGI_PAGED_NUM_BLOCKS": "1024", "PREFIX_CACHING": "0"}
    engines = {
        label: build_engine(
            build_config(
                {"model_id": str(model), "speculate": n},
                {**knobs, "TGI_PAGED_SPECULATE_MAX_BATCH": str(max_batch or "")},
            )
        )
        for label, (n, max_batch) in SPECULATE.items()
    }
    for engine in engines.values():
        engine.runner.warm_decode()  # as Warmup does: proves the native stack (decode, verify) and direct decode
    for engine in engines.values():  # first-call costs out of the figures
        run_batch(engine, requests([chat("Repeat: one two three, one two three.")] * 2, 8, True, 1), 999)
    eos = "ignore EOS" if args.ignore_eos else "stop at EOS"
    print(
        f"SmolLM2-135M-Instruct float32, {args.threads} threads, greedy, max_new {args.max_new}, {eos}; "
        f"batch = {args.requests} requests at once, single = {args.single} requests one at a time"
    )
    runs: dict[tuple, list[dict]] = {}
    batch_id = 1
    for rep in range(args.repeats):
        for workload, prompts in WORKLOADS.items():
            texts = [chat(prompts[i % len(prompts)]) for i in range(max(args.requests, args.single))]
            if rep == 0:
                lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
                print(f"{workload}: prompts of {min(lengths)}-{max(lengths)} tokens")
            modes = {
                "batch": [requests(texts[: args.requests], args.max_new, args.ignore_eos, 1)],
                "single": [
                    requests([t], args.max_new, args.ignore_eos, 1 + i) for i, t in enumerate(texts[: args.single])
                ],
            }
            for mode, batches in modes.items():
                for n, engine in engines.items():  # N interleaved per (workload, mode): drift hits all alike
                    runs.setdefault((workload, mode, n), []).append(measure(engine, batches, batch_id))
                    batch_id += len(batches)
    results = {key: _median_run(rs) for key, rs in runs.items()}
    print(
        f"\n{args.repeats} runs per row; timings are medians, tok/s range = min-max of the per-run ratio to N=0\n"
        f"{'workload':10} {'mode':6} {'N':>5} {'accept':>7} {'tok/gen':>7} {'steps':>5} {'tokens':>6} "
        f"{'tok/s':>7} {'vs N=0':>6} {'range':>11} {'ITL p50':>8} {'ITL p99':>8} {'step ms':>8} {'vs N=0':>6}"
    )
    mismatches = []
    for (workload, mode, n), r in results.items():
        ref = results[workload, mode, "0"]
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[workload, mode, n], runs[workload, mode, "0"])]
        accept = "-" if r["drafted"] == 0 else f"{100 * r['accept']:6.1f}%"
        print(
            f"{workload:10} {mode:6} {n:>5} {accept:>7} {r['tok_per_gen']:7.2f} {r['steps']:5} {r['generated']:6} "
            f"{r['tok_s']:7.1f} {statistics.median(ratios):5.2f}x {min(ratios):5.2f}-{max(ratios):4.2f}x "
            f"{r['itl50'] * 1e3:8.1f} {r['itl99'] * 1e3:8.1f} {r['step'] * 1e3:8.1f} {r['step'] / ref['step']:5.2f}x"
        )
        for rid, ids in r["tokens"].items():
            if ids != ref["tokens"][rid]:
                at = next((i for i, (a, b) in enumerate(zip(ids, ref["tokens"][rid])) if a != b), None)
                at = min(len(ids), len(ref["tokens"][rid])) if at is None else at
                mismatches.append(
                    f"{workload}/{mode} N={n} request {rid}: differs from N=0 at token {at} "
                    f"(N={n}: {ids[at : at + 5]}, N=0: {ref['tokens'][rid][at : at + 5]})"
                )
    checked = sum(len(r["tokens"]) for (_, _, n), r in results.items() if n != "0")
    if mismatches:
        print("\n" + "!" * 100 + "\nGREEDY OUTPUT MISMATCH vs N=0:\n" + "\n".join(mismatches) + "\n" + "!" * 100)
        sys.exit(1)
    print(f"\noracle: all {checked} N>0 greedy outputs equal N=0's token for token")


if __name__ == "__main__":
    main()
