"""Grammar-constrained decoding: regex automata from ``outlines-core``, applied as logits masks.

The stock router sends ``NextTokenChooserParameters.grammar`` with ``GRAMMAR_TYPE_REGEX`` (it has
already turned a JSON schema into a regex with outlines-core); older routers send the schema itself
with ``GRAMMAR_TYPE_JSON``, converted here the same way.

- :class:`TokenVocabulary`: the tokenizer's tokens as raw bytes (byte-level BPE and sentencepiece
  spellings undone), special tokens other than EOS left out, built once per engine.
- :class:`GrammarCompiler`: one ``outlines_core.Index`` per distinct regex, compiled in a child
  process (:class:`CompileProcess`; outlines-core holds the GIL while it builds) and kept in a bounded
  LRU cache, so a large schema delays only its own request.
- :class:`GrammarState`: one request's automaton (an ``outlines_core.Guide``), owned by its
  ``RequestState``: preemption does not touch it (swap and recompute keep the generated tokens and
  so the automaton's position), it advances once per generated token.
- :func:`apply_grammar_masks`: one batched ``masked_fill`` over the constrained rows of a step.

EOS is allowed exactly where the automaton accepts (the index lists it in final states); a request
whose ``max_new_tokens`` comes first ends with ``length``, as stock does.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from pathlib import Path

import numpy as np
import outlines_core
import torch

from tgi_paged_backend.engine.types import GrammarSpec, InvalidRequestError

EARLY_ERROR_WAIT_S = 0.05
"""How long admission waits on a new regex's compile: enough for a syntax error to surface (parsing is
microseconds), far less than building a large automaton, which goes on in the background."""
WORKER_START_TIMEOUT_S = 60.0
"""The first grammar request waits (once) for the compile process to start."""
DEFAULT_CACHE_SIZE = 64
MAX_DRAFT = 32
"""Draft tokens a grammar row verifies at most per step (the automaton keeps this many states to step back)."""


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: printable stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kinds(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if "type" in node:
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(backend.to_str()).get("decoder"))
    return found


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Raw bytes of every non-special token (byte-level BPE: GPT-2's stand-in characters mapped back;
    sentencepiece: ``▁`` is a space and ``<0xNN>`` one byte)."""
    kinds = _decoder_kinds(tokenizer)
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
    }
    added = {i for i in getattr(tokenizer, "added_tokens_decoder", {})}
    table = _byte_level_decoder()
    out: dict[int, bytes] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special:
            continue
        if token_id in added:
            out[token_id] = token.encode()
        elif "ByteLevel" in kinds and all(ch in table for ch in token):
            out[token_id] = bytes(table[ch] for ch in token)
        elif "ByteFallback" in kinds and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out[token_id] = bytes([int(token[3:5], 16)])
        else:
            out[token_id] = token.replace("\u2581", " ").encode()
    return out


class TokenVocabulary:
    """The tokenizer's vocabulary as outlines-core sees it (built once; a few hundred ms for 50k tokens)."""

    def __init__(self, tokenizer, eos_token_id: int) -> None:
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in token_bytes(tokenizer).items():
            if raw and token_id != eos_token_id:
                by_bytes.setdefault(raw, []).append(token_id)
        self.eos_token_id = eos_token_id
        self.vocabulary = outlines_core.Vocabulary(eos_token_id, by_bytes)


def grammar_regex(spec: GrammarSpec) -> str:
    """The regex to compile: the router's regex as is, a JSON schema converted as the stock router does."""
    if spec.kind == "regex":
        return spec.value
    try:
        return outlines_core.json_schema.build_regex_from_schema(spec.value)
    except (ValueError, TypeError) as err:
        raise InvalidRequestError(f"invalid JSON schema: {err}") from err


class CompileProcess:
    """The child interpreter that builds indexes (``engine.grammar_worker``); used from one thread."""

    def __init__(self, vocabulary: outlines_core.Vocabulary) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tgi_paged_backend.engine.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._call("vocabulary", vocabulary)

    def _call(self, kind: str, payload):
        requests, replies = self._proc.stdin, self._proc.stdout
        assert requests is not None and replies is not None  # both are pipes (stdin=stdout=PIPE)
        try:
            pickle.dump((kind, payload), requests, protocol=pickle.HIGHEST_PROTOCOL)
            requests.flush()
            status, value = pickle.load(replies)
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            raise RuntimeError(f"the grammar compile process died (exit {self._proc.poll()})") from err
        if status != "ok":
            raise ValueError(value)
        return value

    def compile(self, regex: str) -> outlines_core.Index:
        return self._call("compile", regex)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()  # EOF: the child returns
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()


class GrammarCompiler:
    """Regex -> ``Future[outlines_core.Index]``, LRU-bounded. One thread feeds the compiles, in order,
    to one :class:`CompileProcess` (started with the compiler; restarted if it dies)."""

    def __init__(self, vocabulary: TokenVocabulary, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.vocabulary = vocabulary
        self.cache_size = cache_size
        self.cache_hits = 0
        """Requests whose regex was compiled (or compiling) already."""
        self._compile_s: list[float] = []
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tgi-grammar")
        self._process: CompileProcess | None = None
        self._started = self._executor.submit(self._ensure_process)

    def _ensure_process(self) -> CompileProcess:
        if self._process is None or not self._process.alive:
            self._process = CompileProcess(self.vocabulary.vocabulary)
        return self._process

    def submit(self, regex: str) -> Future:
        with self._lock:
            future = self._cache.get(regex)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(regex)
                self.cache_hits += 1
                return future
            future = self._executor.submit(self._compile, regex)
            self._cache[regex] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, regex: str):
        start = time.perf_counter()
        try:
            return self._ensure_process().compile(regex)
        finally:
            with self._lock:
                self._compile_s.append(time.perf_counter() - start)

    def take_compile_seconds(self) -> tuple[float, ...]:
        """Durations of the compiles finished since the last call (for the telemetry histogram)."""
        with self._lock:
            done, self._compile_s = tuple(self._compile_s), []
        return done

    def start(self, request_id: int, spec: GrammarSpec) -> GrammarState:
        """A request's automaton; raises :class:`InvalidRequestError` naming the request when the
        grammar is rejected at once (bad schema, regex syntax). A large regex compiles on."""
        try:
            future = self.submit(grammar_regex(spec))
        except InvalidRequestError as err:
            raise InvalidRequestError(f"request {request_id}: {err}") from err
        self._started.result(timeout=WORKER_START_TIMEOUT_S)  # instant once the process is up
        try:
            future.result(timeout=EARLY_ERROR_WAIT_S)
        except FutureTimeout:
            pass
        except Exception as err:  # noqa: BLE001 - outlines-core raises ValueError for bad regexes
            raise InvalidRequestError(f"request {request_id}: invalid grammar regex: {err}") from err
        return GrammarState(request_id, future, self.vocabulary.eos_token_id)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.close()  # a compile still running in it fails its request


class GrammarState:
    """One request's position in its automaton."""

    __slots__ = ("request_id", "_future", "_guide", "_eos_token_id")

    def __init__(self, request_id: int, future: Future, eos_token_id: int) -> None:
        self.request_id = request_id
        self._future = future
        self._guide: outlines_core.Guide | None = None
        self._eos_token_id = eos_token_id

    @property
    def ready(self) -> bool:
        """The index is built (or failed: :meth:`guide` then raises)."""
        return self._guide is not None or self._future.done()

    def guide(self) -> outlines_core.Guide:
        if self._guide is None:
            try:
                self._guide = outlines_core.Guide(self._future.result(), max_rollback=MAX_DRAFT)
            except Exception as err:  # noqa: BLE001 - a late compile failure (automaton too large)
                raise InvalidRequestError(f"request {self.request_id}: grammar failed to compile: {err}") from err
        return self._guide

    def advance(self, token_id: int) -> None:
        """Move past ``token_id``. EOS leaves the automaton where it is: it is only ever allowed where the
        automaton accepts, and a request that ignores EOS goes on from there. (``Guide.is_finished`` is
        true in every accepting state, where more tokens may still follow: it is no reason to stop.)"""
        if token_id != self._eos_token_id:
            self.guide().advance(token_id)

    def _walk(self, draft: Sequence[int]) -> Generator[int, None, None]:
        """Walk the automaton along ``draft``, yielding before each token the number of tokens passed;
        stops at the first token it forbids or after an EOS, then steps back to where it was."""
        guide, advanced = self.guide(), 0
        try:
            for i, token in enumerate(draft[:MAX_DRAFT]):
                yield i
                if token == self._eos_token_id:
                    if not guide.is_finished():
                        return
                    yield i + 1  # EOS ends the text: nothing after it is a valid draft
                    return
                try:
                    guide.advance(token, return_tokens=False)
                except ValueError:  # a token the automaton forbids here
                    return
                advanced += 1
            yield min(len(draft), MAX_DRAFT)
        finally:
            if advanced:
                guide.rollback_state(advanced)

    def valid_draft(self, draft: Sequence[int]) -> list[int]:
        """The longest prefix of ``draft`` the automaton allows from here (``[]`` before its index is built:
        a request drafts only once the automaton has constrained a token)."""
        if self._guide is None:
            return []
        *_, n = self._walk(draft)  # the walk's last step: the tokens it passed
        return list(draft[:n])

    def write_draft_masks(self, out: np.ndarray, draft: Sequence[int]) -> None:
        """Row ``i`` of ``out`` (``len(draft) + 1`` rows of packed int32 words): the allowed tokens after
        ``draft[:i]``. Rows past a token the automaton forbids repeat the last allowed state (they cannot
        be accepted)."""
        assert len(draft) <= MAX_DRAFT, "grammar drafts are cut to MAX_DRAFT by valid_draft"
        guide, words = self.guide(), out.shape[1]
        row = -1
        with contextlib.closing(self._walk(draft)) as walk:  # steps back even if a mask write raises
            for row in walk:
                guide.write_mask_into(out[row].ctypes.data, words, 4)
        out[row + 1 :] = out[row]


def apply_grammar_masks(
    logits: torch.Tensor,
    rows: Sequence[int],
    states: Sequence[GrammarState],
    drafts: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """``logits`` with every token the automaton forbids set to ``-inf`` in the constrained ``rows``
    (in place; other rows untouched). With ``drafts``, state ``j`` owns ``len(drafts[j]) + 1`` consecutive
    rows: its mask after each draft prefix (speculative verification). Columns past the tokenizer (padded
    lm_head) are always forbidden in constrained rows. The bitmasks are written and unpacked with numpy
    (one thread, microseconds), then applied with one ``masked_fill_``."""
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bits = np.zeros((len(rows), words), dtype=np.int32)
    j = 0
    for state, draft in zip(states, drafts if drafts is not None else [()] * len(states)):
        if draft:
            state.write_draft_masks(bits[j : j + len(draft) + 1], draft)
        else:
            state.guide().write_mask_into(bits[j].ctypes.data, words, 4)
        j += len(draft) + 1
    assert j == len(rows), "one row per state and draft position"
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = torch.from_numpy(allowed == 0).to(logits.device)
    if list(rows) == list(range(len(rows))):  # the usual case: constrained rows first, contiguous
        logits[: len(rows)].masked_fill_(forbidden, -torch.inf)
        return logits
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, -torch.inf))
    return logits
