"""Issue 21's figures judged against its goals and floors (report only; never a CI gate).

Each figure is a ratio of this shard to vLLM's CPU build from the same run (best round of each, engines
alternated), or a share of the shard's own decode step:

- *float32 burst*: tokens/s on SmolLM2's 32-request burst, shard / vLLM; goal >= 1.0x, floor 0.85x (under the
  floor the issue is not done);
- *single-request ITL*: the mean gap between tokens of one request generating 128 tokens, shard / vLLM; goal
  <= 1.0x (lower is faster);
- *host-bound burst*: tokens/s on the host-bound model (:mod:`integration.peers.hostbound`), shard / vLLM;
  goal >= 1.5x, floor 1.0x: with the math negligible this is everything but the math, as on a GPU;
- *bfloat16 burst*: the burst ratio of a ``--dtype bfloat16`` run, reported (goal >= 1.0x) -- meaningful on a
  host that computes bf16 natively (AMX / AVX512-BF16, see :mod:`integration.peers.host`);
- *engine overhead*: everything but the forward, (sum of the step's parts - the shard's forward) / that sum;
  goal < 10 %;
- *forward / bare forward*: the shard's model forward over the bare HF forward at the same shape; goal <= 1.0x.

The floors of issue 21 are stated for the float32 run; a row measured in another dtype says so.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

from integration.peers.jobs import EngineResult
from tgi_paged_backend.planning.report import table
from tgi_paged_backend.telemetry.step_record import STEP_PARTS


@dataclass(frozen=True, slots=True)
class Goal:
    figure: str
    measured: float | None
    """The ratio (or share, 0-1); ``None``: not measured in this run (``note`` says why)."""
    goal: str
    """``>= 1.0x``, ``<= 1.0x`` or ``< 10 %``: read with :func:`judge`."""
    floor: str = ""
    """A bound that must hold for the issue to be done (empty: none)."""
    note: str = ""
    percent: bool = False
    """``measured`` is a share, printed in %."""

    @property
    def met(self) -> bool | None:
        return judge(self.measured, self.goal)

    @property
    def floor_held(self) -> bool | None:
        return judge(self.measured, self.floor) if self.floor else None

    def shown(self) -> str:
        if self.measured is None:
            return "n/a"
        return f"{100 * self.measured:.1f} %" if self.percent else f"{self.measured:.2f}x"


_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


def judge(value: float | None, bound: str) -> bool | None:
    """``value`` against ``">= 1.5x"``, ``"< 10 %"`` ...; ``None`` when there is no value or no bound."""
    if value is None or not bound or (isinstance(value, float) and math.isnan(value)):
        return None
    op, number = bound.split()[:2]
    target = float(number.rstrip("x%"))
    return _OPS[op](100 * value if bound.endswith("%") else value, target)


def engines_by_key(section: dict[str, Any] | None) -> dict[str, EngineResult]:
    """The section's engines that ran, by ``key`` (older reports: by the first word of the label)."""
    if not section:
        return {}
    out = {}
    for r in section["results"]:
        if not r.skipped:
            out[r.key or {"this": "shard"}.get(r.engine.split(" ")[0], r.engine.split(" ")[0])] = r
    return out


def ratio(section: dict[str, Any] | None, run: str) -> float | None:
    """shard / vLLM on ``run``: tokens/s, or the mean ITL for ``single``; ``None`` without both."""
    by = engines_by_key(section)
    shard, vllm = by.get("shard"), by.get("vllm")
    if not shard or not vllm or run not in shard.runs or run not in vllm.runs:
        return None
    attr = "itl_mean_s" if run == "single" else "tokens_per_s"
    a, b = getattr(shard.runs[run], attr), getattr(vllm.runs[run], attr)
    return a / b if b and not math.isnan(a) and not math.isnan(b) else None


def missing(section: dict[str, Any] | None, run: str, scenario: str) -> str:
    """Why :func:`ratio` has no value (empty when it has one)."""
    if section is None or run not in section.get("config", {}).get("runs", ["burst", "poisson"]):
        return f"not run (--scenarios {scenario})"
    by = engines_by_key(section)
    absent = [name for name in ("shard", "vllm") if name not in by or run not in by[name].runs]
    return f"{' and '.join(absent)} did not run (see skipped)" if absent else ""


def overhead(anatomy: dict[str, float], bare: dict[str, Any] | None) -> tuple[float, float] | None:
    """``(engine overhead share of the step, forward / bare forward)`` from the shard's burst anatomy."""
    if not anatomy or not anatomy.get("step") or not bare:
        return None
    total = sum(anatomy[p] for p in STEP_PARTS)
    return (total - anatomy["forward"]) / total if total else math.nan, anatomy["forward"] / bare["forward_s"]


def issue21_goals(report: dict[str, Any]) -> list[Goal]:
    sections = {s.get("key", "smollm2"): s for s in report.get("sections") or [report]}
    smol, hostbound = sections.get("smollm2"), sections.get("hostbound")
    dtype = report.get("dtype", "float32")
    native = getattr(report.get("host"), "native_bf16", None)
    burst = ratio(smol, "burst")
    fp32 = "" if dtype == "float32" else "run with --dtype float32"
    goals = [
        Goal(
            "float32 burst tokens/s vs vLLM (SmolLM2)",
            burst if dtype == "float32" else None,
            ">= 1.0x",
            ">= 0.85x",
            fp32 or missing(smol, "burst", "burst"),
        ),
        Goal(
            f"single request, {dtype}: mean ITL vs vLLM (lower = faster)",
            ratio(smol, "single"),
            "<= 1.0x",
            note=missing(smol, "single", "single"),
        ),
        Goal(
            f"host-bound burst, {dtype}: tokens/s vs vLLM",
            ratio(hostbound, "burst"),
            ">= 1.5x",
            ">= 1.0x",
            missing(hostbound, "burst", "hostbound") or (fp32 and f"{dtype}: the floor is for float32"),
        ),
    ]
    if dtype == "bfloat16":
        note = f"host computes bf16 natively ({native})" if native else "host has no native bf16: not the goal's host"
        note = "; ".join(filter(None, (missing(smol, "burst", "burst"), note)))
        goals.append(Goal("bfloat16 burst tokens/s vs vLLM (reported)", burst, ">= 1.0x", note=note))
    else:
        host = "" if native is None else f"; this host: {'native bf16, ' + native if native else 'no native bf16'}"
        goals.append(
            Goal("bfloat16 burst tokens/s vs vLLM (reported)", None, ">= 1.0x", note="run --dtype bfloat16" + host)
        )
    shard = engines_by_key(smol).get("shard")
    measured = overhead(shard.anatomy, smol.get("bare")) if shard and smol else None
    batch = f", batch {smol['bare']['batch']}" if measured and smol.get("bare") else ""
    share, fwd = measured or (None, None)
    note = "" if measured else "needs this shard's SmolLM2 burst and the bare forward"
    goals += [
        Goal(f"engine overhead share of the decode step{batch}", share, "< 10 %", note=note, percent=True),
        Goal(f"engine forward / bare HF forward{batch}", fwd, "<= 1.0x", note=note),
    ]
    return goals


def goals_table(goals: list[Goal], title: str = "issue-21 goals (report only)") -> str:
    def status(ok: bool | None, yes: str, no: str) -> str:
        return "n/a" if ok is None else yes if ok else no

    rows = [
        [
            g.figure,
            g.shown(),
            g.goal,
            status(g.met, "met", "MISSED"),
            g.floor or "-",
            status(g.floor_held, "held", "BELOW") if g.floor else "-",
        ]
        for g in goals
    ]
    notes = [f"  {g.figure}: {g.note}" for g in goals if g.note]
    return "\n".join([f"{title}:", table(["figure", "measured", "goal", "", "floor", ""], rows), *notes])
