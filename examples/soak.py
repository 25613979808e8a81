"""A long soak of one shard: 10,000 requests through the real gRPC server, as a router sends them.

The shard is the real engine behind the real ``grpc_server.serve`` in this process (a tiny random Llama by
default, or ``--model-dir``), with two LoRA adapters, ``--speculate`` (n-gram drafts), prefix caching and a
small pool (32 blocks of 4 tokens, swap space for 16 blocks: preemption by swap while it has room, by
recompute after). It is driven like the RPC fuzzer drives it (``tests/helpers/live_shard.py``): every RPC's
outcome is checked against the router's books (the shard's batches are the router's, no request outside a
batch, ``check_invariants`` on the block books; ``--no-checks`` skips the last two).

Traffic: waves of 8-32 requests; about a third of each wave joins late, while the earlier ones decode (a
Prefill merged into the cached batch, as the v3 router does, or a batch of its own decoded beside it); the
router admits while its virtual blocks last and decodes every cached batch each step. Requests: greedy,
seeded sampling, regex and JSON-schema grammars, stop sequences, an adapter (either of the two, or an
unknown id: the base model), ``top_n_tokens``, prompt logprobs; about 5 % are cancelled by the client
after a random number of tokens (FilterBatch without them, or ClearCache when none is left).

Checked and reported: requests finished / cancelled / failed (any failed RPC fails the soak), preemptions
by mode; every greedy row (finished, or cancelled: its tokens so far) token for token against HF
transformers' greedy decoding (PEFT for the adapters; EOS not suppressed, as in the shard); sampled rows
repeated with the same seed give the same tokens; grammar rows that ended on EOS match their regex; rows
that ended on a stop sequence end with it; blocks held after everything finished (``used`` and ``swapped``
must be 0; ``retained``, the prefix cache's reclaimable blocks, is reported apart and then dropped); the
process RSS at the start, middle and end, and its growth from the first to the last thousand requests (the
shard runs in this process, so this is the shard's RSS plus the harness's, which keeps no per-request
state). The exit status is 0 only when every check holds.

    .venv/bin/python examples/soak.py [--requests 10000] [--seed 0] [--speculate 2] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import random
import re
import shlex
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from integration.peers.host import describe, host_info  # noqa: E402
from tests.helpers.live_shard import (  # noqa: E402
    LiveShard,
    RouterBooks,
    Sent,
    chooser,
    prefill_message,
    text_request,
    warmup,
)
from tests.helpers.lora_adapters import write_adapter  # noqa: E402
from tests.helpers.tiny_models import TINY_CORPUS, load_reference, write_tiny_model  # noqa: E402
from tgi_paged_backend.server.pb import generate_pb2 as pb  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS, SWAP_BLOCKS = 4, 33, 16
MAX_INPUT, MAX_TOTAL, MAX_PREFILL = 32, 80, 64
MAX_NEW = 40
MAX_LIVE = 32
NUM_PROMPTS = 32
ADAPTERS = ("soak-a", "soak-b")
REGEXES = ("[0-9]{1,4}", "(yes|no)", "[a-z ]{1,12}")
JSON_SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
STOPS = ([" the"], ["."], ["o", "e"])
SAMPLING = (
    dict(temperature=0.7, top_k=20, do_sample=True),
    dict(temperature=1.3, top_p=0.9, typical_p=0.95, do_sample=True),
    dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, do_sample=True),
)


@dataclass
class Plan:
    """One request as the client asks for it."""

    index: int
    prompt: int
    max_new: int
    kind: str  # greedy | sampled | regex | json
    adapter: str
    stops: list[str]
    ignore_eos: bool
    params: dict = field(default_factory=dict)
    grammar: tuple[int, str] | None = None
    top_n: int = 0
    prefill_logprobs: bool = False
    cancel_after: int | None = None

    @property
    def rid(self) -> int:
        return self.index + 1

    def key(self) -> tuple:
        """What decides a seeded request's tokens."""
        return (self.prompt, self.adapter, tuple(sorted(self.params.items())), self.max_new, self.ignore_eos)


@dataclass
class Tally:
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    greedy_exact: int = 0
    greedy_partial_exact: int = 0
    greedy_mismatch: list[str] = field(default_factory=list)
    sampled_repeats: int = 0
    sampled_mismatch: int = 0
    grammar_rows: int = 0
    grammar_checked: int = 0
    grammar_mismatch: list[str] = field(default_factory=list)
    stop_rows: int = 0
    stop_mismatch: int = 0
    waves: int = 0
    late_joiners: int = 0
    merged_prefills: int = 0
    multi_batch_decodes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_reason: dict[int, int] = field(default_factory=dict)


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers' greedy continuations (``MAX_NEW`` tokens): the model's own forward with its KV cache,
    as ``generate`` runs it, argmax at every step. EOS is taken like any other token, as the shard does
    (``generate`` with ``min_new_tokens`` would forbid it, and without it would stop there)."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            step = model(input_ids=torch.tensor([ids]), use_cache=True)
            tokens: list[int] = []
            for _ in range(MAX_NEW):
                tokens.append(int(step.logits[0, -1].argmax()))
                step = model(
                    input_ids=torch.tensor([tokens[-1:]]), past_key_values=step.past_key_values, use_cache=True
                )
            out.append(tokens)
    return out


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_prompts(rng: random.Random) -> list[str]:
    words = " ".join(TINY_CORPUS).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 14))) for _ in range(NUM_PROMPTS)]


def make_plan(index: int, rng: random.Random) -> Plan:
    roll = rng.random()
    kind = "greedy" if roll < 0.55 else "sampled" if roll < 0.82 else "regex" if roll < 0.95 else "json"
    adapter = rng.choice(["", "", "", "", ADAPTERS[0], ADAPTERS[1], "unknown-adapter"])
    plan = Plan(
        index=index,
        prompt=rng.randrange(NUM_PROMPTS),
        max_new=rng.randint(1, MAX_NEW),
        kind=kind,
        adapter=adapter,
        stops=rng.choice(STOPS) if rng.random() < 0.15 else [],
        ignore_eos=kind in ("greedy", "sampled") and rng.random() < 0.5,
        top_n=rng.choice([0, 0, 0, 0, 0, 0, 0, 0, 2, 5]),
        prefill_logprobs=rng.random() < 0.1,
    )
    if kind == "sampled":  # from a small space, so that the same seeded request comes back now and then
        plan.params = dict(rng.choice(SAMPLING), seed=rng.randrange(4))
        plan.prompt, plan.max_new, plan.stops = rng.randrange(8), rng.choice([8, 16, 24]), []
        plan.adapter = rng.choice(["", ADAPTERS[0]])
    elif kind == "regex":
        plan.grammar = (pb.GRAMMAR_TYPE_REGEX, rng.choice(REGEXES))
    elif kind == "json":
        plan.grammar = (pb.GRAMMAR_TYPE_JSON, JSON_SCHEMA)
    if rng.random() < 0.05:
        plan.cancel_after = rng.randrange(plan.max_new)
    return plan


class Soak:
    def __init__(self, args: argparse.Namespace, model_dir: Path, adapters: dict[str, Path]) -> None:
        self.args = args
        self.model_dir = model_dir
        self.rng = random.Random(args.seed)
        env = {
            "TGI_PAGED_NUM_BLOCKS": str(NUM_BLOCKS),
            "TGI_PAGED_BLOCK_SIZE": str(BLOCK_SIZE),
            "TGI_PAGED_PREEMPTION": "swap",  # swap while the swap space has room, recompute after
            "TGI_PAGED_SWAP_SPACE_GB": repr(args.swap_gb),
            "PREFIX_CACHING": "1",
            "TGI_PAGED_SPECULATE_MAX_BATCH": "64",  # draft in batched steps too (the CPU default: alone only)
            "LORA_ADAPTERS": ",".join(f"{name}={path}" for name, path in adapters.items()),
            "REQUEST_LOGPROBS": "1",
        }
        self.adapters = adapters
        self.shard = LiveShard(model_dir, env, speculate=args.speculate, rpc_timeout_s=300).start()
        answer = warmup(
            self.shard, max_input_tokens=MAX_INPUT, max_total_tokens=MAX_TOTAL, max_prefill_tokens=MAX_PREFILL
        )
        self.engine = self.shard.engine
        self.tally = Tally()
        self.plans: dict[int, Plan] = {}
        self.sampled: dict[tuple, tuple[int, ...]] = {}
        self.books = RouterBooks(self.shard, check_books=not args.no_checks, keep_done=False, on_finish=self._finished)
        self.prompts = make_prompts(self.rng)
        self.prompt_ids = [self.engine.prompt_tokenizer.encode(p, MAX_INPUT, True) for p in self.prompts]
        self.tokenizer = self.engine.runner.tokenizer
        self.eos = set(self.engine.eos_ids)
        self.warmup_answer = answer

    # -- references -----------------------------------------------------------------------------

    def compute_references(self) -> None:
        """HF greedy continuations (``MAX_NEW`` tokens) of every prompt, by the base model and each adapter."""
        self.refs: dict[str, list[list[int]]] = {"": hf_greedy(load_reference(self.model_dir), self.prompt_ids)}
        from peft import PeftModel

        for name, path in self.adapters.items():
            model = PeftModel.from_pretrained(load_reference(self.model_dir), str(path)).eval()
            self.refs[name] = hf_greedy(model, self.prompt_ids)
        self.refs["unknown-adapter"] = self.refs[""]

    # -- per-request checks ---------------------------------------------------------------------

    def _check_greedy(self, plan: Plan, tokens: list[int], *, partial: bool) -> None:
        ref = self.refs[plan.adapter][plan.prompt][: len(tokens)]
        if tokens == ref:
            if partial:
                self.tally.greedy_partial_exact += 1
            else:
                self.tally.greedy_exact += 1
        else:
            self.tally.greedy_mismatch.append(f"request {plan.rid} ({plan.adapter or 'base'}): {tokens} != {ref}")

    def _finished(self, rid: int, sent: Sent) -> None:
        plan = self.plans.pop(rid)
        tally = self.tally
        tally.finished += 1
        reason = sent.final.finish_reason
        tally.by_kind[plan.kind] = tally.by_kind.get(plan.kind, 0) + 1
        tally.by_reason[reason] = tally.by_reason.get(reason, 0) + 1
        tokens = list(sent.tokens)
        if plan.kind == "greedy":
            self._check_greedy(plan, tokens, partial=False)
        elif plan.kind == "sampled":
            key = plan.key()
            seen = self.sampled.get(key)
            if seen is None:
                self.sampled[key] = tuple(tokens)
            else:
                tally.sampled_repeats += 1
                tally.sampled_mismatch += seen != tuple(tokens)
        else:
            tally.grammar_rows += 1
            if plan.kind == "regex" and reason == pb.FINISH_REASON_EOS_TOKEN:
                text = self.tokenizer.decode([t for t in tokens if t not in self.eos], skip_special_tokens=True)
                tally.grammar_checked += 1
                if not re.fullmatch(plan.grammar[1], text):
                    tally.grammar_mismatch.append(f"request {rid}: {text!r} !~ {plan.grammar[1]}")
        if reason == pb.FINISH_REASON_STOP_SEQUENCE:
            tally.stop_rows += 1
            text = "".join(sent.texts)
            tally.stop_mismatch += not any(text.endswith(s) or text.endswith(s + "\n") for s in plan.stops)

    # -- the router -----------------------------------------------------------------------------

    def request(self, plan: Plan, blocks: list[int], slots: list[int]) -> pb.Request:
        fields = {}
        if plan.adapter:
            fields["adapter_id"] = plan.adapter
        return text_request(
            plan.rid,
            self.prompts[plan.prompt],
            max_new_tokens=plan.max_new,
            truncate=MAX_INPUT,
            parameters=chooser(**plan.params, grammar=plan.grammar),
            stop_sequences=plan.stops,
            ignore_eos_token=plan.ignore_eos,
            blocks=blocks,
            slots=slots,
            top_n_tokens=plan.top_n,
            prefill_logprobs=plan.prefill_logprobs,
            **fields,
        )

    def _ok(self, outcome, what: str) -> None:
        if not outcome.ok:
            self.tally.errors.append(f"{what}: {outcome.code.name} {outcome.details}")

    def run(self) -> dict[str, float]:
        n, rng, books = self.args.requests, self.rng, self.books
        chunk = max(1, min(1000, n // 10))
        rss = {"start": rss_mib()}
        next_mark, marks = chunk, {}
        queue: deque[Plan] = deque()
        late: list[tuple[int, Plan]] = []
        made = step = 0
        next_wave = 0
        next_batch_id = 1
        while True:
            done = self.tally.finished + self.tally.cancelled + self.tally.failed
            while done >= next_mark:
                gc.collect()
                marks[next_mark] = rss_mib()
                next_mark += chunk
            if done >= n:
                break
            # Waves, about a third of each joining late.
            if made < n and (len(books.live) + len(queue) < 4 or step >= next_wave):
                for _ in range(min(rng.randint(8, 32), n - made)):
                    plan = make_plan(made, rng)
                    self.plans[plan.rid] = plan
                    made += 1
                    if rng.random() < 0.35:
                        late.append((step + rng.randint(1, 25), plan))
                        self.tally.late_joiners += 1
                    else:
                        queue.append(plan)
                next_wave = step + rng.randint(30, 80)
                self.tally.waves += 1
            arrived = [p for s, p in late if s <= step]
            late = [(s, p) for s, p in late if s > step]
            queue.extend(arrived)
            # Admission while the router's virtual blocks last.
            admitted, owned = [], []
            while queue and len(books.live) + len(admitted) < MAX_LIVE and len(admitted) < 8:
                plan = queue[0]
                reserved = books.reserve(self.prompts[plan.prompt], plan.max_new, MAX_INPUT)
                if reserved is None:
                    break
                queue.popleft()
                admitted.append(self.request(plan, *reserved))
                owned.append(reserved[0])
            if admitted:
                cached = None
                if books.batches and rng.random() < 0.7:  # the v3 router: merge into the running batch
                    cached = rng.choice(sorted(books.batches))
                    self.tally.merged_prefills += 1
                before = set(books.live)
                outcome = books.prefill(prefill_message(next_batch_id, admitted, cached), owned)
                next_batch_id += 1
                self._ok(outcome, "Prefill")
                if not outcome.ok:
                    self._failed(before, admitted)
            elif books.batches:
                self.tally.multi_batch_decodes += len(books.batches) > 1
                before = set(books.live)
                outcome = books.decode(sorted(books.batches))
                self._ok(outcome, "Decode")
                if not outcome.ok:
                    self._failed(before, [])
            elif late:
                step = min(s for s, _ in late)
                continue
            self._cancel()
            step += 1
        rss.update({f"after {k}": v for k, v in marks.items()})
        rss["end"] = rss_mib()
        self.first_mark, self.last_mark = chunk, max(marks) if marks else chunk
        return rss

    def _failed(self, before: set[int], admitted: list[pb.Request]) -> None:
        gone = (before | {r.id for r in admitted}) - set(self.books.live)
        for rid in gone:
            if rid in self.plans:
                self.plans.pop(rid)
                self.tally.failed += 1

    def _cancel(self) -> None:
        """Clients that go away: FilterBatch without them (ClearCache when nobody is left)."""
        books = self.books
        going = {
            rid
            for rid, sent in books.live.items()
            if (p := self.plans.get(rid)) is not None
            and p.cancel_after is not None
            and len(sent.tokens) >= p.cancel_after
        }
        if not going:
            return
        for rid in going:
            plan = self.plans.pop(rid)
            if plan.kind == "greedy":
                self._check_greedy(plan, list(books.live[rid].tokens), partial=True)
            self.tally.cancelled += 1
        for batch_id, ids in list(books.batches.items()):
            keep = [rid for rid in ids if rid not in going]
            if len(keep) == len(ids):
                continue
            outcome = books.filter_batch(batch_id, keep) if keep else books.clear_cache(batch_id)
            self._ok(outcome, "FilterBatch" if keep else "ClearCache")

    def close(self) -> int | None:
        return self.shard.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculate", type=int, default=2, help="n-gram draft tokens per step (0: off)")
    parser.add_argument("--model-dir", type=Path, help="a local model (default: a tiny random Llama)")
    parser.add_argument("--swap-gb", type=float, help="swap space (default: 16 blocks of the tiny Llama)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-checks", action="store_true", help="skip the per-RPC block-book checks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(describe(host_info(), "float32"))

    work = Path(tempfile.mkdtemp(prefix="tgi-soak-"))
    model_dir = args.model_dir or write_tiny_model("llama", work / "model", seed=0)
    if args.swap_gb is None:
        args.swap_gb = SWAP_BLOCKS * (3 * 2 * BLOCK_SIZE * 2 * 16 * 4) / 2**30  # tiny Llama: 3 layers, fp32
    adapters = {name: write_adapter(model_dir, work / name, seed=21 + i) for i, name in enumerate(ADAPTERS)}
    t0 = time.perf_counter()
    soak = Soak(args, model_dir, adapters)
    soak.compute_references()
    gc.collect()
    stats0 = soak.engine.kv.stats()
    print(
        f"model {model_dir}; pool {stats0.num_total_blocks} blocks x {BLOCK_SIZE} tokens "
        f"(+ scratch), swap {stats0.num_swap_total_blocks} blocks; max_input {MAX_INPUT}, max_total {MAX_TOTAL}, "
        f"router budget {soak.warmup_answer.max_supported_total_tokens} tokens; speculate {args.speculate}; "
        f"adapters {', '.join(ADAPTERS)}; setup {time.perf_counter() - t0:.1f} s"
    )
    t1 = time.perf_counter()
    try:
        rss = soak.run()
        wall = time.perf_counter() - t1
        books, engine, tally = soak.books, soak.engine, soak.tally
        lost = sorted(books.live) + sorted(soak.plans)
        mem = engine.kv.stats()
        used, swapped, retained = mem.num_used_blocks, mem.num_swapped_blocks, mem.num_retained_blocks
        dropped = engine.kv.reset_prefix_cache()
        after_reset = engine.kv.stats()
    finally:
        exit_code = soak.close()

    es = engine.stats
    calls = books.stats
    print(f"\nrequests: {args.requests} in {wall:.1f} s ({args.requests / wall:.1f} req/s), {es.num_steps} steps")
    print(
        f"  finished {tally.finished}, cancelled by the client {tally.cancelled}, failed {tally.failed}, "
        f"lost {len(lost)}"
    )
    print(
        f"  finished by kind {dict(sorted(tally.by_kind.items()))}; by finish reason "
        f"{dict(sorted(tally.by_reason.items()))} (0 length, 1 eos, 2 stop sequence)"
    )
    print(
        f"  {tally.waves} waves, {tally.late_joiners} late joiners; {tally.merged_prefills} Prefills merged into a "
        f"cached batch, {tally.multi_batch_decodes} Decodes of several batches"
    )
    print(f"  RPCs: {calls.calls} ({dict(sorted(calls.by_code.items()))})")
    print(
        f"  preemptions: recompute {es.preemptions.get('recompute', 0)}, swap {es.preemptions.get('swap', 0)}; "
        f"recomputed tokens {es.recomputed_tokens} of {es.computed_tokens}; swapped out/in "
        f"{es.swap_bytes['out'] // 1024}/{es.swap_bytes['in'] // 1024} KiB"
    )
    print(
        f"  speculation: {es.accepted_tokens} of {es.draft_tokens} draft tokens accepted; prefix cache hit "
        f"{es.prefix_hit_tokens} of {es.prefix_query_tokens} prompt tokens; generated {es.generated_tokens} tokens"
    )
    print(
        f"greedy rows exact vs HF transformers greedy: {tally.greedy_exact} finished + "
        f"{tally.greedy_partial_exact} cancelled (their tokens so far); mismatches {len(tally.greedy_mismatch)}"
    )
    for line in tally.greedy_mismatch[:5]:
        print("   ", line)
    print(
        f"sampled rows repeated with the same seed: {tally.sampled_repeats}, different tokens {tally.sampled_mismatch}"
    )
    print(
        f"grammar rows: {tally.grammar_rows}; regex rows ended on EOS matching their regex "
        f"{tally.grammar_checked - len(tally.grammar_mismatch)} of {tally.grammar_checked}"
    )
    for line in tally.grammar_mismatch[:5]:
        print("   ", line)
    print(f"stop-sequence rows: {tally.stop_rows}, not ending with their stop {tally.stop_mismatch}")
    print(
        f"blocks after everything finished: used {used}, swapped {swapped} (must be 0); retained {retained} "
        f"(prefix cache, reclaimable; not counted as used); after dropping the prefix cache ({dropped} blocks): "
        f"free {after_reset.num_free_blocks} of {after_reset.num_total_blocks}"
    )
    first, last = rss[f"after {soak.first_mark}"], rss["end"]
    middle_key = min((k for k in rss if k.startswith("after ")), key=lambda k: abs(int(k[6:]) - args.requests // 2))
    growth = 100 * (last - first) / first
    print(
        f"RSS (this process: shard + harness): start {rss['start']:.1f} MiB, middle ({middle_key} requests) "
        f"{rss[middle_key]:.1f} MiB, end {last:.1f} MiB; growth from the first {soak.first_mark} requests to the "
        f"end {growth:+.2f} %"
    )
    print("  every mark:", ", ".join(f"{k.removeprefix('after ')}: {v:.1f}" for k, v in rss.items()))
    print(f"shard exit code {exit_code}")
    for line in tally.errors[:10]:
        print("ERROR", line)
    ok = (
        not tally.errors
        and not tally.failed
        and not lost
        and used == 0
        and swapped == 0
        and not tally.greedy_mismatch
        and not tally.sampled_mismatch
        and not tally.grammar_mismatch
        and not tally.stop_mismatch
        and exit_code == 0
    )
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
