"""Which runs each engine process serves, in which alternated round, and how the rounds become one figure.

Scenarios (``--scenarios``): ``burst`` (the 32-request burst of SmolLM2), ``poisson`` (the same requests at
Poisson arrivals), ``single`` (one request, 128 new tokens: per-token latency) and ``hostbound`` (the burst
on the host-bound model, :mod:`integration.peers.hostbound`). The first three share one section (SmolLM2,
one process per engine and round), ``hostbound`` is a section of its own per layer form (``--hostbound-forms``:
``hostbound`` for the Llama form, ``hostbound-qwen3`` ...), and each ``--models`` directory a burst section
(``model:<name>``). ``prefill`` is SmolLM2 once more: one request at a time at 128-2,048 prompt tokens, one new
token each (time to first token; transformers' continuous batching does not serve it).

Rounds: this shard and vLLM alternate, ``shard, vLLM, shard, vLLM, ...`` for ``--repeats`` rounds, a fresh
process each time, so a slow spell of the shared box hits both engines rather than one. Every round serves
the burst and the single request; the Poisson run (arrival-bound, ~45 s per engine) only the first round.
transformers' continuous batching, a reference point and no goal, serves every run once, after round one.
Per engine and run the report shows the *best* round (highest tokens/s; lowest mean ITL for the single
request), since a shared box only ever slows a run down, and lists every round beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from integration.peers.jobs import EngineResult, RunFigures

SCENARIOS = ("burst", "poisson", "single", "hostbound", "prefill")
SMOLLM2_RUNS = ("burst", "poisson", "single")
ONCE = frozenset({"poisson"})
"""Runs served in the first round only."""
ALTERNATED = ("shard", "vllm")
"""Engines that alternate round by round; the others run once."""


@dataclass(frozen=True, slots=True)
class Section:
    key: str
    """``smollm2``, ``hostbound`` (the Llama form), ``hostbound-<form>`` or ``model:<directory name>``."""
    runs: tuple[str, ...]
    """Run names this section serves, in order."""
    form: str = ""
    """The host-bound model's layer form (host-bound sections only)."""
    model_dir: str = ""
    """The model directory (``--models`` sections only)."""

    @property
    def hostbound(self) -> bool:
        return bool(self.form)


def sections(scenarios: Sequence[str], forms: Sequence[str] = ("llama",), models: Sequence[str] = ()) -> list[Section]:
    """The sections that ``scenarios`` need, SmolLM2 first, then one per host-bound ``forms`` (when ``hostbound`` is
    a scenario) and one burst per ``models`` directory (unknown scenario names raise ``ValueError``)."""
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}: choose from {SCENARIOS}")
    out = []
    smol = tuple(r for r in SMOLLM2_RUNS if r in scenarios)
    if smol:
        out.append(Section("smollm2", smol))
    if "prefill" in scenarios:
        out.append(Section("prefill", ("prefill",)))
    if "hostbound" in scenarios:
        for form in dict.fromkeys(forms):
            out.append(Section("hostbound" if form == "llama" else f"hostbound-{form}", ("burst",), form=form))
    for model in dict.fromkeys(models):
        out.append(Section(f"model:{Path(model).name}", ("burst",), model_dir=str(model)))
    return out


@dataclass(frozen=True, slots=True)
class Slot:
    round: int
    """0-based round; engines that run once have round 0."""
    engine: str
    runs: tuple[str, ...]


def schedule(runs: Sequence[str], engines: Sequence[str], repeats: int) -> list[Slot]:
    """The process order of one section: alternated engines round by round, then the run-once engines.

    >>> [(s.round, s.engine, s.runs) for s in schedule(("burst", "poisson"), ("shard", "vllm", "transformers"), 2)]
    ... # doctest: +NORMALIZE_WHITESPACE
    [(0, 'shard', ('burst', 'poisson')), (0, 'vllm', ('burst', 'poisson')),
     (0, 'transformers', ('burst', 'poisson')), (1, 'shard', ('burst',)), (1, 'vllm', ('burst',))]
    """
    out: list[Slot] = []
    for k in range(max(1, repeats)):
        these = tuple(r for r in runs if k == 0 or r not in ONCE)
        if not these:
            break
        out += [Slot(k, e, these) for e in ALTERNATED if e in engines]
        if k == 0:
            out += [Slot(0, e, tuple(runs)) for e in engines if e not in ALTERNATED]
    return out


def headline(run: str, figures: RunFigures) -> float:
    """The figure a run is judged by, larger = better: tokens/s, or minus the mean ITL for ``single``."""
    if run == "prefill":
        value = -float(np.mean(figures.ttft_each_s)) if figures.ttft_each_s else math.nan
    else:
        value = -figures.itl_mean_s if run == "single" else figures.tokens_per_s
    return -math.inf if value is None or math.isnan(value) else value


def merge_rounds(rounds: Sequence[EngineResult]) -> EngineResult:
    """One engine's rounds (each a process, in the order they ran) as one result.

    ``runs[name]`` is the best round of that run by :func:`headline`, ``rounds[name]`` every round; the burst's
    best round also gives the anatomy and peak memory reported; notes are kept per round.
    """
    ran = [r for r in rounds if not r.skipped]
    if not ran:
        return rounds[0]
    merged = EngineResult(engine=ran[0].engine, key=ran[0].key)
    for name in dict.fromkeys(n for r in ran for n in r.runs):
        have = [r for r in ran if name in r.runs]
        merged.rounds[name] = [r.runs[name] for r in have]
        merged.runs[name] = max(merged.rounds[name], key=lambda f, name=name: headline(name, f))
    best = max(ran, key=lambda r: headline("burst", r.runs["burst"]) if "burst" in r.runs else -math.inf)
    merged.anatomy, merged.anatomies = best.anatomy, best.anatomies
    merged.peak_rss_bytes = max(r.peak_rss_bytes for r in ran)
    merged.setup_s = min(r.setup_s for r in ran)
    multi = len(rounds) > 1
    for k, r in enumerate(rounds):
        prefix = f"round {k + 1}: " if multi else ""
        merged.notes += [prefix + n for n in r.notes]
        if r.skipped:
            merged.notes.append(f"{prefix}skipped: {r.skipped}")
    return merged
