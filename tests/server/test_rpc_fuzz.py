"""RPC fuzzing: random sequences of Prefill / Decode / FilterBatch / ClearCache against a live shard.

The shard is the real engine on a tiny Llama (one LoRA adapter loaded, ``--speculate 2``, prefix caching,
a 16-block pool of 4 tokens with swap space for 6 blocks, so preemption by swap and by recompute both
happen) behind the real gRPC server on a unix socket (``tests/helpers/live_shard.py``). A Hypothesis state
machine plays a router that lies: request ids fresh, duplicated, already live or ``U64_MAX``; batch ids
fresh, already cached, finished or unknown; empty batches; sampling parameters out of range (negative, zero,
NaN and infinite temperature, ``top_p``/``typical_p`` outside (0, 1], huge ``top_k``, penalties NaN or zero);
grammars valid and invalid (regex syntax, JSON schema, type and text that disagree, an unknown type); adapter
ids known, unknown and odd; ``truncate`` 0 / small / huge; stop sequences (the empty one included);
``max_new_tokens`` 0 / small / huge; ``top_n_tokens`` huge; ``cache_len`` / ``chunk_len`` out of range;
inputs with no chunk, an empty text, an image only, two texts, an image beside the text; router blocks
and slots that are right, too short, out of the advertised range, repeated, another request's, block 0,
or none at all. Between these it decodes every cached batch, cancels requests with FilterBatch and
clears batches.

Properties (checked by ``RouterBooks`` after every RPC, and at the end of each example):

- every call ends in a response or in ``INVALID_ARGUMENT`` / ``NOT_FOUND`` with a non-empty message (``INTERNAL``,
  ``UNKNOWN`` or a deadline is a failure), and responses keep the Generation rules;
- no request is lost: each request handed to a successful Prefill/Decode finished or is listed in the
  returned batch; the shard's cached batches are the router's and it holds no request outside them; the
  block books balance (``KVCacheManager.check_invariants``);
- no hang: at the end every admitted request runs to its end within a bounded number of Decodes;
- after ``ClearCache`` (all batches) no block is used or swapped (retained prefix blocks may stay: they are
  reclaimable), and a request that needs the whole pool (63 positions = 16 blocks) is served greedy-exact
  against HF ``generate``; the shard is alive throughout (Health, the router's liveness probe).

Each example starts from an empty shard with no retained prefix block, and the valid grammars are compiled
before the first one, so a failing sequence replays exactly and Hypothesis shrinks it.

Budget: ``TGI_PAGED_FUZZ_EXAMPLES`` examples (default 100, the CI budget: about 35 s on a loaded 2-core box)
of ``TGI_PAGED_FUZZ_STEPS`` actions each (default 20). Release runs use the long mode, e.g.
``TGI_PAGED_FUZZ_EXAMPLES=2000 pytest tests/server/test_rpc_fuzz.py`` (about 10 minutes there). A failure
prints the shrunk sequence of actions with every value drawn; ``--hypothesis-seed=<seed>`` reruns a seed, and
Hypothesis replays a failure it saved in ``.hypothesis/``.

Regressions of the bugs the fuzzer found are at the end of this file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from tests.helpers.live_shard import (
    U32_MAX,
    U64_MAX,
    ContractError,
    LiveShard,
    RouterBooks,
    chooser,
    decode_message,
    prefill_message,
    text_request,
    warmup,
)
from tests.helpers.lora_adapters import write_adapter
from tests.helpers.shard_driving import hf_greedy
from tests.helpers.tiny_models import TINY_CORPUS
from tgi_paged_backend.server.pb import generate_pb2 as pb

EXAMPLES = int(os.environ.get("TGI_PAGED_FUZZ_EXAMPLES", "100"))
STEPS = int(os.environ.get("TGI_PAGED_FUZZ_STEPS", "20"))

BLOCK_SIZE = 4
NUM_BLOCKS = 17  # 16 usable blocks = 64 token positions (block 0 is the scratch block)
BLOCK_BYTES = 3 * 2 * BLOCK_SIZE * 2 * 16 * 4  # tiny Llama: 3 layers, K and V, 2 KV heads of 16, float32
SWAP_BLOCKS = 6
MAX_INPUT, MAX_TOTAL, MAX_PREFILL = 24, 64, 32
ADAPTER = "tiny-lora"
FULL_POOL_TEXT = "Once upon a time, a small model"  # 20 prompt tokens + 44 new: 63 positions written
WORDS = " ".join(TINY_CORPUS).split()

# -- a request's fields: a router's values, or (a few fields per request) odd ones ------------------------

FIELDS = [
    "text", "truncate", "add_special_tokens", "max_new_tokens", "parameters", "grammar", "stop_sequences",
    "top_n_tokens", "cache_len", "adapter_id", "chunk_len", "blocks", "input",
]  # fmt: skip
IMAGE = pb.InputChunk(image=pb.Image(data=b"\x89PNG\r\n", mimetype="image/png"))
GOOD_GRAMMARS = [
    (pb.GRAMMAR_TYPE_REGEX, "[0-9]{1,4}"),
    (pb.GRAMMAR_TYPE_REGEX, "(yes|no)"),
    (pb.GRAMMAR_TYPE_REGEX, "[a-z ]{0,12}"),
    (pb.GRAMMAR_TYPE_JSON, '{"type": "integer"}'),
    (pb.GRAMMAR_TYPE_JSON, '{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}'),
]
BAD_GRAMMARS = [
    (pb.GRAMMAR_TYPE_REGEX, "(unclosed"),
    (pb.GRAMMAR_TYPE_REGEX, "[z-a]"),
    (pb.GRAMMAR_TYPE_REGEX, "a{5,2}"),
    (pb.GRAMMAR_TYPE_REGEX, "*"),
    (pb.GRAMMAR_TYPE_JSON, "{"),
    (pb.GRAMMAR_TYPE_JSON, '{"type": 5}'),
    (pb.GRAMMAR_TYPE_JSON, "[]"),
    (pb.GRAMMAR_TYPE_NONE, "[0-9]+"),  # text without a type
    (pb.GRAMMAR_TYPE_REGEX, ""),  # a type without text
    (7, "[0-9]+"),  # no such GrammarType
]
ACTIONS = [
    *["admit"] * 3, *["decode_all"] * 4, *["prefill"] * 4, "decode_some", *["filter_batch"] * 2, "clear_one",
    "clear_all", "liveness",
]  # fmt: skip
"""What one step of an example does (repeated entries weigh more)."""
ODD_BLOCKS = ["none", "short", "out_of_range", "repeated", "others", "zero", "misplaced", "huge"]
ODD_INPUTS = ["no_input", "image", "two_texts", "empty_chunk"]
ODD_ADAPTERS = ["no-such-adapter", "../..", "é", "x" * 300]

NAN, INF = math.nan, math.inf
odd_floats = st.sampled_from([0.0, -0.0, -1.0, NAN, INF, -INF, 1e-45, 1e-30, 1.5, 3e38])


def maybe_odd(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, odd_floats)


words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join) | st.just(FULL_POOL_TEXT)
odd_texts = st.sampled_from(["", " ", "\x00", "é漢字🙂", "a" * 300, "\n\n", "<s></s>"]) | st.text(max_size=20)
odd_stops = st.lists(st.sampled_from(["", "x" * 400, "\n"]) | st.text(max_size=5), min_size=1, max_size=3)
greedy = st.builds(chooser)
valid_sampling = st.builds(
    chooser,
    temperature=st.floats(0.1, 2.0),
    top_k=st.sampled_from([0, 1, 5, 50]),
    top_p=st.floats(0.1, 1.0),
    typical_p=st.floats(0.1, 1.0),
    do_sample=st.booleans(),
    seed=st.integers(0, U64_MAX),
    repetition_penalty=st.floats(0.5, 2.0),
    frequency_penalty=st.floats(-1.0, 1.0),
)
odd_parameters = st.one_of(
    st.builds(pb.NextTokenChooserParameters),  # every field unset: temperature 0
    st.builds(
        chooser,
        temperature=maybe_odd(st.floats(0.1, 2.0)),
        top_k=st.sampled_from([0, 1, U32_MAX]),
        top_p=maybe_odd(st.floats(0.1, 1.0)),
        typical_p=maybe_odd(st.floats(0.1, 1.0)),
        do_sample=st.booleans(),
        seed=st.sampled_from([0, U64_MAX]),
        repetition_penalty=maybe_odd(st.floats(0.5, 2.0)),
        frequency_penalty=st.one_of(st.floats(-1.0, 1.0), st.sampled_from([NAN, INF, -INF, 1e30, -1e30])),
    ),
)


RULES: dict[str, int] = {}
"""Actions run over all examples, printed at the end."""
TOTALS: dict[str, int] = {}
"""RPC outcomes of the actions over all examples (``rpc:OK`` or ``rpc:STATUS``), printed at the end."""

# ------------------------------------------------------------------------------------------- shard


@dataclass
class FuzzTarget:
    shard: LiveShard
    full_pool_max_new: int
    """``max_new_tokens`` of the full-pool request (``FULL_POOL_TEXT``'s prompt + it = ``MAX_TOTAL``)."""
    full_pool_reference: list[int]
    """HF ``generate``'s greedy tokens for it."""


def serve_full_pool_request(target: FuzzTarget, books: RouterBooks, rid: int, batch_id: int) -> None:
    """A request writing 63 positions (all 16 blocks) is served, token for token as HF ``generate``."""
    max_new = target.full_pool_max_new
    reserved = books.reserve(FULL_POOL_TEXT, max_new, MAX_INPUT)
    assert reserved is not None, "the router's virtual pool is whole again"
    blocks, slots = reserved
    assert -(-(len(slots)) // BLOCK_SIZE) == NUM_BLOCKS - 1, "the request needs every block of the pool"
    request = text_request(
        rid,
        FULL_POOL_TEXT,
        max_new_tokens=max_new,
        truncate=MAX_INPUT,
        ignore_eos_token=True,
        blocks=blocks,
        slots=slots,
    )
    outcome = books.prefill(prefill_message(batch_id, [request]), [blocks])
    assert outcome.ok, (outcome.code, outcome.details)
    for _ in range(2 * max_new):
        if batch_id not in books.batches:
            break
        books.decode([batch_id])
    assert books.done[rid].tokens == target.full_pool_reference, "the full-pool request is not greedy-exact"


@pytest.fixture(scope="module")
def fuzz_target(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared box: one intra-op thread is faster
    adapter = write_adapter(tiny_llama_dir, tmp_path_factory.mktemp("fuzz-lora") / ADAPTER, seed=5)
    env = {
        "TGI_PAGED_NUM_BLOCKS": str(NUM_BLOCKS),
        "TGI_PAGED_BLOCK_SIZE": str(BLOCK_SIZE),
        "TGI_PAGED_PREEMPTION": "swap",  # swap while the swap space has room, recompute after
        "TGI_PAGED_SWAP_SPACE_GB": repr(SWAP_BLOCKS * BLOCK_BYTES / 2**30),
        "PREFIX_CACHING": "1",
        "TGI_PAGED_SPECULATE_MAX_BATCH": "64",
        "LORA_ADAPTERS": f"{ADAPTER}={adapter}",
        "REQUEST_LOGPROBS": "1",
    }
    shard = LiveShard(tiny_llama_dir, env, speculate=2, rpc_timeout_s=60).start()
    try:
        answer = warmup(shard, max_input_tokens=MAX_INPUT, max_total_tokens=MAX_TOTAL, max_prefill_tokens=MAX_PREFILL)
        assert answer.max_total_tokens == MAX_TOTAL
        assert shard.engine.kv.num_total_blocks == NUM_BLOCKS - 1
        assert shard.engine.kv.stats().num_swap_total_blocks == SWAP_BLOCKS
        books = RouterBooks(shard)
        # Compile the valid grammars now (the shard caches them per regex): how long a compile takes must not
        # decide what a step does, or a failing sequence would not replay.
        for i, grammar in enumerate(GOOD_GRAMMARS, start=1):
            books.prefill(
                prefill_message(i, [text_request(i, "Hello", max_new_tokens=2, parameters=chooser(grammar=grammar))])
            )
        for _ in range(1000):
            if not books.batches:
                break
            books.decode(sorted(books.batches))
        books.assert_empty()
        max_new = MAX_TOTAL - books.prompt_len(FULL_POOL_TEXT, MAX_INPUT)
        (reference,) = hf_greedy(tiny_llama_dir, [FULL_POOL_TEXT], max_new)
        yield FuzzTarget(shard, max_new, reference)
    finally:
        assert shard.stop() == 0
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------- machine


class RpcFuzz(RuleBasedStateMachine):
    """One example: a fresh router view over the shared shard, which starts and ends empty."""

    target: FuzzTarget

    def __init__(self) -> None:
        super().__init__()
        self.shard = self.target.shard
        self.books = RouterBooks(self.shard)
        self.ids = iter(range(1, 2**62))  # fresh request and batch ids
        self.stale: list[int] = [12345]  # batch ids that were cached and are gone (and one never seen)
        self.stale_candidates: set[int] = set()
        self.idle_decodes = 0

    @initialize()
    def start_empty(self) -> None:
        """Every example starts from the same shard state, so a failing sequence replays exactly: nothing
        cached, no retained prefix block (they would change where preemption strikes)."""
        self.shard.call("ClearCache", pb.ClearCacheRequest())  # a failed example may have left requests
        self.books.assert_empty()
        self.shard.engine.kv.reset_prefix_cache()

    # -- helpers ----------------------------------------------------------------------------------

    def _fresh(self) -> int:
        return next(self.ids)

    def _batch_id(self, data, kinds: list[str]) -> int:
        kind = data.draw(st.sampled_from(kinds), label="batch id kind")
        if kind == "cached" and self.books.batches:
            return data.draw(st.sampled_from(sorted(self.books.batches)), label="cached batch")
        if kind == "stale":
            return data.draw(st.sampled_from(self.stale), label="stale batch")
        if kind == "u64max":
            return U64_MAX
        if kind == "zero":
            return 0
        return self._fresh()

    def _request_id(self, data, batch_ids: list[int]) -> int:
        kind = data.draw(st.sampled_from(["fresh"] * 8 + ["same", "live", "done", "u64max", "zero"]), label="id kind")
        if kind == "same" and batch_ids:
            return data.draw(st.sampled_from(batch_ids))
        if kind == "live" and self.books.live:
            return data.draw(st.sampled_from(sorted(self.books.live)))
        if kind == "done" and self.books.done:
            return data.draw(st.sampled_from(sorted(self.books.done)))
        if kind == "u64max":
            return U64_MAX
        if kind == "zero":
            return 0
        return self._fresh()

    def _request(self, data, rid: int, *, odd_fields: bool = True) -> tuple[pb.Request, list[int]]:
        """A request whose fields are what a router sends, except (``odd_fields``) a few drawn from the odd
        values (out of range, invalid, or valid extremes); the router blocks it took (given back when it
        leaves)."""
        odd: frozenset[str] = frozenset()
        if odd_fields:
            odd = data.draw(st.sets(st.sampled_from(FIELDS), min_size=1, max_size=2), label="odd fields")

        def pick(name: str, valid: st.SearchStrategy, unusual: st.SearchStrategy):
            return data.draw(unusual if name in odd else valid, label=name)

        text = pick("text", words, odd_texts)
        truncate = pick("truncate", st.sampled_from([MAX_INPUT, MAX_INPUT, 8, 3]), st.sampled_from([0, 1, U32_MAX]))
        add_special = pick("add_special_tokens", st.just(True), st.just(False))
        try:
            n_prompt = self.books.prompt_len(text, truncate, add_special)
        except Exception:  # noqa: BLE001 - the shard will refuse it: any length does
            n_prompt = 8
        room = max(1, MAX_TOTAL - n_prompt)
        max_new = pick("max_new_tokens", st.integers(1, min(room, 32)), st.sampled_from([0, room + 1, 200, U32_MAX]))
        params = pick("parameters", st.one_of(greedy, greedy, valid_sampling), odd_parameters)
        if "grammar" in odd or data.draw(st.integers(0, 7), label="with grammar") == 0:
            params.grammar_type, params.grammar = pick(
                "grammar", st.sampled_from(GOOD_GRAMMARS), st.sampled_from(BAD_GRAMMARS)
            )
        stops = pick("stop_sequences", st.sampled_from([[], [], [], [" the"], ["."], ["o", "\n"]]), odd_stops)
        fields = dict(
            truncate=truncate,
            parameters=params,
            stop_sequences=stops,
            ignore_eos_token=data.draw(st.booleans(), label="ignore_eos_token"),
            add_special_tokens=add_special,
            prefill_logprobs=data.draw(st.booleans(), label="prefill_logprobs"),
            top_n_tokens=pick("top_n_tokens", st.sampled_from([0, 0, 0, 1, 3]), st.sampled_from([512, U32_MAX])),
            cache_len=pick("cache_len", st.just(0), st.sampled_from([1, 4, 30, U32_MAX])),
        )
        adapter = pick("adapter_id", st.sampled_from([None, None, "", ADAPTER]), st.sampled_from(ODD_ADAPTERS))
        if adapter is not None:
            fields["adapter_id"] = adapter
        chunk_len = pick("chunk_len", st.sampled_from([None, None, None, 4, 8]), st.sampled_from([0, 1, U32_MAX]))
        if chunk_len is not None:
            fields["chunk_len"] = chunk_len
        mode = pick("blocks", st.just("router"), st.sampled_from(ODD_BLOCKS))
        blocks, slots, owned = self._blocks(mode, data, n_prompt + max_new - 1)
        request = text_request(rid, text, max_new_tokens=max_new, blocks=blocks, slots=slots, **fields)
        shape = pick("input", st.sampled_from(["text"] * 4 + ["inputs", "image_text"]), st.sampled_from(ODD_INPUTS))
        if shape != "text":
            request.ClearField("input_chunks")
            chunks = {
                "inputs": [],
                "no_input": [],
                "image": [IMAGE],
                "two_texts": [pb.InputChunk(text=text), pb.InputChunk(text=text)],
                "image_text": [IMAGE, pb.InputChunk(text=text)],
                "empty_chunk": [pb.InputChunk(text="")],
            }[shape]
            request.input_chunks.chunks.extend(chunks)
            if shape == "no_input":
                request.inputs = ""
        return request, owned

    def _blocks(self, mode: str, data, needed: int):
        """``(blocks, slots, owned)``: the router's reservation of ``needed`` positions, or a broken one."""
        books = self.books
        if mode == "none":
            return [], [], []
        if mode == "huge":
            return [U32_MAX], [U32_MAX], []
        got = books.blocks.allocate(min(max(needed, 1), 4 * MAX_TOTAL))
        if got is None:
            return [], [], []
        blocks, slots = got
        owned = list(blocks)
        if mode == "short":
            slots = slots[:-1]
        elif mode == "out_of_range":
            blocks = [books.blocks.num_blocks, *blocks[1:]]
        elif mode == "repeated":
            blocks = [blocks[0]] * len(blocks)
        elif mode == "zero":
            blocks = [0, *blocks[1:]]
        elif mode == "others" and books.live:
            other = books.live[data.draw(st.sampled_from(sorted(books.live)), label="whose blocks")].request
            blocks, slots = list(other.blocks), list(other.slots)
        if mode in ("out_of_range", "repeated", "zero", "misplaced"):
            slots = [blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(len(slots))]
            if mode == "misplaced" and slots:
                slots[-1] += BLOCK_SIZE
        return blocks, slots, owned

    # -- actions --------------------------------------------------------------------------------

    @rule(data=st.data())
    def act(self, data) -> None:
        """One action, drawn with the weights of :data:`ACTIONS` (one rule rather than one per action:
        Hypothesis' swarm testing would switch actions off at random, often the Decodes)."""
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        RULES[action] = RULES.get(action, 0) + 1
        getattr(self, action)(data)

    def admit(self, data) -> None:
        """What a router sends: fresh ids, fields in range, its reservations (a new batch, or merged into a
        cached one as the router does while chunking)."""
        n = data.draw(st.integers(1, 3), label="requests")
        cached = None
        if self.books.batches and data.draw(st.booleans(), label="with cached batch"):
            cached = data.draw(st.sampled_from(sorted(self.books.batches)), label="cached batch")
        requests, owned = [], []
        for _ in range(n):
            request, blocks = self._request(data, self._fresh(), odd_fields=False)
            requests.append(request)
            owned.append(blocks)
        outcome = self.books.prefill(prefill_message(self._fresh(), requests, cached), owned)
        assert outcome.ok, (outcome.code, outcome.details)
        self._note_stale()

    def prefill(self, data) -> None:
        """A Prefill with odd ids, an odd batch, or requests with a few odd fields."""
        n = data.draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3]), label="requests")
        batch_id = self._batch_id(data, ["fresh"] * 4 + ["cached", "stale", "u64max", "zero"])
        cached = None
        if data.draw(st.booleans(), label="with cached batch"):
            cached = self._batch_id(data, ["cached"] * 6 + ["stale", "fresh"])
        ids: list[int] = []
        requests, owned = [], []
        for _ in range(n):
            rid = self._request_id(data, ids)
            ids.append(rid)
            request, blocks = self._request(data, rid, odd_fields=data.draw(st.booleans(), label="odd request"))
            requests.append(request)
            owned.append(blocks)
        self.books.prefill(prefill_message(batch_id, requests, cached), owned)
        self._note_stale()

    def decode_some(self, data) -> None:
        """A Decode of random batch ids: cached ones, unknown, stale, repeated, or none at all."""
        cached = sorted(self.books.batches)
        ids = data.draw(st.lists(st.sampled_from(cached), unique=True) if cached else st.just([]), label="batches")
        extra = data.draw(st.sampled_from(["", "", "", "unknown", "stale", "repeat", "none"]), label="extra batch")
        if extra == "unknown":
            ids.insert(data.draw(st.integers(0, len(ids))), self._fresh())
        elif extra == "stale":
            ids.append(data.draw(st.sampled_from(self.stale)))
        elif extra == "repeat" and ids:
            ids.append(ids[0])
        elif extra == "none":
            ids = []
        self.books.decode(ids)
        self._note_stale()

    def decode_all(self, data) -> None:
        """The router's loop: every cached batch in one Decode, a few times."""
        steps = data.draw(st.integers(1, 6), label="steps")
        for _ in range(steps):
            if not self.books.batches:
                return
            before = self.books.stats.generations
            outcome = self.books.decode(sorted(self.books.batches))
            assert outcome.ok, (outcome.code, outcome.details)
            self.idle_decodes = 0 if self.books.stats.generations > before else self.idle_decodes + 1
            self._note_stale()
            if self.idle_decodes > 60:
                raise ContractError(f"no token in {self.idle_decodes} Decodes of every cached batch (hang)")

    def filter_batch(self, data) -> None:
        """Client cancellations (and nonsense): keep a random part of a batch, plus ids it never had."""
        batch_id = self._batch_id(data, ["cached"] * 5 + ["stale", "fresh"])
        current = self.books.batches.get(batch_id, [])
        keep = data.draw(st.lists(st.sampled_from(current), unique=True) if current else st.just([]), label="keep")
        others = [rid for b, ids in self.books.batches.items() if b != batch_id for rid in ids]
        extra = data.draw(st.sampled_from(["", "", "unknown", "other batch's", "repeat"]), label="extra ids")
        if extra == "unknown":
            keep.append(self._fresh())
        elif extra == "other batch's" and others:
            keep.append(data.draw(st.sampled_from(others)))
        elif extra == "repeat" and keep:
            keep.append(keep[0])
        self.books.filter_batch(batch_id, keep)
        self._note_stale()

    def clear_one(self, data) -> None:
        self.books.clear_cache(self._batch_id(data, ["cached"] * 3 + ["stale", "fresh", "u64max"]))
        self._note_stale()

    def clear_all(self, data) -> None:
        self.books.clear_cache(None)
        self._note_stale()
        self.books.assert_empty()

    def liveness(self, data) -> None:
        """The router's health check: ``Health``, then its probe Prefill on block 0."""
        self.books.health()
        probe = text_request(U64_MAX, "liveness", max_new_tokens=1, truncate=1, blocks=[0], slots=[0])
        probe.add_special_tokens = False
        outcome = self.books.prefill(prefill_message(U64_MAX, [probe]))
        # Refused only while a request of the probe's id (sent by this fuzzing router, never by a real one) is live.
        assert outcome.ok or U64_MAX in self.books.live, (outcome.code, outcome.details)

    # -- end of an example ------------------------------------------------------------------------

    def _note_stale(self) -> None:
        for b in self.stale_candidates:
            if b not in self.books.batches and b not in self.stale:
                self.stale.append(b)
        self.stale_candidates = set(self.books.batches)

    def teardown(self) -> None:
        books = self.books
        for key, n in books.stats.by_code.items():
            TOTALS[key] = TOTALS.get(key, 0) + n
        if not self.shard.alive:
            raise ContractError(f"the shard died: {self.shard.error!r}")
        # No hang: what was admitted runs to its end (each admitted request fits the pool, so this is
        # bounded by the tokens still to generate, plus room for grammar compiles and preemption).
        budget = 50 + 2 * sum(min(s.request.stopping_parameters.max_new_tokens, MAX_TOTAL) for s in books.live.values())
        for _ in range(budget):
            if not books.batches:
                break
            outcome = books.decode(sorted(books.batches))
            assert outcome.ok, (outcome.code, outcome.details)
        if books.batches:
            raise ContractError(f"requests {sorted(books.live)} did not finish in {budget} Decodes (hang)")
        if books.live:
            raise ContractError(f"requests {sorted(books.live)} left every batch without finishing (lost)")
        books.clear_cache(None)
        books.assert_empty()
        serve_full_pool_request(self.target, books, self._fresh(), self._fresh())
        books.assert_empty()
        self._note_stale()


def test_rpc_fuzz(fuzz_target: FuzzTarget) -> None:
    RpcFuzz.target = fuzz_target
    shard = fuzz_target.shard
    run_state_machine_as_test(
        RpcFuzz,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    stats = shard.engine.stats
    print(f"fuzz: {EXAMPLES} examples x {STEPS} steps; preemptions {stats.preemptions}, steps {stats.num_steps}")
    print("fuzz: outcomes", dict(sorted(TOTALS.items())))
    print("fuzz: rules", dict(sorted(RULES.items())))
    assert shard.alive
    assert shard.call("Health", pb.HealthRequest()).ok
    assert shard.call("Decode", decode_message([U64_MAX - 1])).code == grpc.StatusCode.NOT_FOUND


# ------------------------------------------------------------------------------------------- regressions
# Bugs the fuzzer found, each fixed in the engine (shard_engine.PagedShardEngine.prefill / _add_requests).


def running_batch(books: RouterBooks, batch_id: int, rid: int, max_new: int = 8) -> None:
    blocks, slots = books.reserve("The quick brown fox", max_new, MAX_INPUT)
    request = text_request(
        rid,
        "The quick brown fox",
        max_new_tokens=max_new,
        truncate=MAX_INPUT,
        blocks=blocks,
        slots=slots,
        ignore_eos_token=True,
    )
    assert books.prefill(prefill_message(batch_id, [request]), [blocks]).ok
    assert books.batches == {batch_id: [rid]}


def test_a_new_batch_reusing_a_cached_batch_id_is_refused(fuzz_target: FuzzTarget) -> None:
    """BUG (fixed): a Prefill whose new batch id was already a cached batch (not merged into it) replaced that
    batch: its requests stayed in the shard with their blocks, owned by no batch (ClearCache of the id could
    not free them; only ClearCache of everything did), and their ids stayed taken."""
    books = RouterBooks(fuzz_target.shard)
    fuzz_target.shard.call("ClearCache", pb.ClearCacheRequest())
    running_batch(books, 7, 70)
    blocks, slots = books.reserve("Hello world", 4, MAX_INPUT)
    request = text_request(71, "Hello world", max_new_tokens=4, truncate=MAX_INPUT, blocks=blocks, slots=slots)
    outcome = books.prefill(prefill_message(7, [request]), [blocks])  # checks: no request outside a batch
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and "batch 7 is already cached" in outcome.details
    assert books.batches == {7: [70]}  # the running batch is untouched and finishes
    while books.batches:
        books.decode([7])
    assert len(books.done[70].tokens) == 8
    books.clear_cache(None)
    books.assert_empty()


@pytest.mark.parametrize("with_router_blocks", [True, False])
def test_a_request_that_can_never_fit_the_pool_is_refused(fuzz_target: FuzzTarget, with_router_blocks: bool) -> None:
    """BUG (fixed): a request whose ``prompt + max_new_tokens - 1`` positions need more blocks than the whole
    pool was accepted (router reservations in the overcommitted virtual space pass every other check, and a
    request without blocks is not checked at all). Once the oldest, it preempted everyone else and then waited
    forever with the pool in hand: no request ever got a token again (a hang for the router)."""
    books = RouterBooks(fuzz_target.shard)
    fuzz_target.shard.call("ClearCache", pb.ClearCacheRequest())
    text, max_new = "Hello world! How are", 100  # 14 prompt tokens + 99 positions: 29 blocks > 16
    blocks, slots = books.reserve(text, max_new, MAX_INPUT) if with_router_blocks else ([], [])
    request = text_request(1, text, max_new_tokens=max_new, truncate=MAX_INPUT, blocks=blocks, slots=slots)
    outcome = books.prefill(prefill_message(1, [request]), [blocks])
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, (outcome.code, outcome.details)
    assert "needs 29 KV blocks at its peak, more than the 16 of the pool" in outcome.details
    books.assert_empty()
    serve_full_pool_request(fuzz_target, books, 2, 2)  # the largest request that fits is served
    books.assert_empty()
