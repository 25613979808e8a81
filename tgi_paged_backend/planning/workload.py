"""Seeded request traces: prompt and output lengths, arrival times, and the ``max_new_tokens`` users set.

A trace is a list of :class:`TraceRequest` ``(prompt_tokens, output_tokens, arrival, max_new_tokens)``.
``output_tokens`` is how long the answer really is (where the model would stop); ``max_new_tokens``
is the cap the client sent, which is what the stock router reserves for. The gap between the two is
the reservation waste this backend avoids.

Length distributions (documented so traces can be reproduced without this code):

- every length is a **lognormal** clipped to ``[low, high]`` and rounded to an integer; ``sigma`` is
  fixed per distribution and ``mu`` is solved so that the mean *after clipping* equals the target
  (:func:`fit_lognormal_mu`, closed form of ``E[clip(X, low, high)]`` plus bisection);
- the output length is further capped at the request's ``max_new_tokens``.

=========  ==============================  ==============================  ===============
workload   prompt tokens                   output tokens                   max_new_tokens
=========  ==============================  ==============================  ===============
sharegpt   mean 161.3, sigma 1.0, [4, 2048]  mean 338.0, sigma 0.9, [1, 1024]  1024
alpaca     mean 19.3, sigma 0.6, [2, 512]    mean 58.5, sigma 0.8, [1, 1024]   1024
tiny       mean 24, sigma 0.5, [4, 96]       mean 20, sigma 0.8, [2, 64]       96
=========  ==============================  ==============================  ===============

The ShareGPT and Alpaca means are the ones the vLLM paper reports for those datasets (161.31 / 337.99
and 19.31 / 58.45 tokens); the sigmas give ShareGPT its long tail and Alpaca its short, narrow prompts.
``tiny`` is sized for the end-to-end CPU run: short prompts and answers, and a 96-token cap chosen so
that the worst-case reservation is ~3.5x the average finished request, as for ShareGPT with a 1024 cap
(1182 / 499 reserved vs finished tokens; the live footprint ratio is higher still).

Arrivals: ``burst`` (everything at t = 0: the pool saturates, the memory-bound case) or ``poisson``
(exponential inter-arrival times at ``rate`` requests per second).

Traces are saved and loaded as JSONL, one request per line:
``{"prompt_tokens": 161, "output_tokens": 338, "arrival": 0.0, "max_new_tokens": 1024}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ARRIVALS: tuple[str, ...] = ("burst", "poisson")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    prompt_tokens: int
    """Prompt length in tokens (what the router counts as ``input_length``)."""
    output_tokens: int
    """Tokens the answer really has (the model stops there); ``<= max_new_tokens``."""
    arrival: float
    """Seconds since the start of the trace."""
    max_new_tokens: int
    """The cap the client sent: the stock router reserves ``prompt_tokens + max_new_tokens - 1``."""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"lengths must be >= 1: {self}")
        if self.output_tokens > self.max_new_tokens:
            raise ValueError(f"output_tokens {self.output_tokens} > max_new_tokens {self.max_new_tokens}")
        if self.arrival < 0:
            raise ValueError(f"arrival must be >= 0: {self}")

    @property
    def total_tokens(self) -> int:
        """Prompt plus output: the request's final length."""
        return self.prompt_tokens + self.output_tokens

    @property
    def reserved_tokens(self) -> int:
        """What the stock router reserves (``speculate = 0``)."""
        return self.prompt_tokens + self.max_new_tokens - 1


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A lognormal clipped to ``[low, high]`` whose clipped mean is ``mean``."""

    mean: float
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not (1 <= self.low < self.mean < self.high) or self.sigma <= 0:
            raise ValueError(f"invalid length distribution {self}")

    @property
    def mu(self) -> float:
        """``mu`` of the underlying normal (solved, see :func:`fit_lognormal_mu`)."""
        return fit_lognormal_mu(self.mean, self.sigma, self.low, self.high)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths."""
        raw = rng.lognormal(self.mu, self.sigma, n)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Prompt and output length distributions plus the ``max_new_tokens`` clients send."""

    name: str
    prompt: LengthDist
    output: LengthDist
    max_new_tokens: int


WORKLOADS: dict[str, WorkloadSpec] = {
    "sharegpt": WorkloadSpec("sharegpt", LengthDist(161.3, 1.0, 4, 2048), LengthDist(338.0, 0.9, 1, 1024), 1024),
    "alpaca": WorkloadSpec("alpaca", LengthDist(19.3, 0.6, 2, 512), LengthDist(58.5, 0.8, 1, 1024), 1024),
    "tiny": WorkloadSpec("tiny", LengthDist(24.0, 0.5, 4, 96), LengthDist(20.0, 0.8, 2, 64), 96),
}


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """``E[clip(X, low, high)]`` for ``X ~ LogNormal(mu, sigma)`` (closed form)."""
    a, b = math.log(low), math.log(high)
    # E[X; a < ln X < b] = exp(mu + s^2/2) * (Phi((b - mu - s^2)/s) - Phi((a - mu - s^2)/s))
    body = math.exp(mu + sigma**2 / 2) * (_phi((b - mu - sigma**2) / sigma) - _phi((a - mu - sigma**2) / sigma))
    return low * _phi((a - mu) / sigma) + body + high * (1.0 - _phi((b - mu) / sigma))


def fit_lognormal_mu(mean: float, sigma: float, low: float, high: float) -> float:
    """The ``mu`` whose lognormal, clipped to ``[low, high]``, has mean ``mean`` (bisection)."""
    lo, hi = math.log(low) - 10 * sigma, math.log(high) + 10 * sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        if clipped_lognormal_mean(mid, sigma, low, high) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def arrival_times(rng: np.random.Generator, n: int, arrival: str, rate: float | None) -> np.ndarray:
    """Arrival offsets in seconds, sorted: all 0 for ``burst``; a Poisson process for ``poisson``."""
    if arrival == "burst":
        return np.zeros(n)
    if arrival == "poisson":
        if rate is None or rate <= 0:
            raise ValueError("poisson arrivals need rate > 0 (requests per second)")
        return np.cumsum(rng.exponential(1.0 / rate, n)) - 0.0
    raise ValueError(f"arrival={arrival!r} is invalid: allowed {ARRIVALS}")


def generate_trace(
    workload: str | WorkloadSpec = "sharegpt",
    num_requests: int = 1000,
    *,
    arrival: str = "burst",
    rate: float | None = None,
    max_new_tokens: int | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """A seeded trace.

    Args:
        workload: A name of :data:`WORKLOADS` or a spec.
        num_requests: Requests in the trace.
        arrival: ``burst`` or ``poisson``.
        rate: Requests per second for ``poisson``.
        max_new_tokens: The cap clients send (default: the workload's); outputs are capped at it.
        seed: Seed of the numpy generator (same seed, same trace).
    """
    spec = WORKLOADS[workload] if isinstance(workload, str) else workload
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    cap = spec.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if cap < 1:
        raise ValueError("max_new_tokens must be >= 1")
    rng = np.random.default_rng(seed)
    prompts = spec.prompt.sample(rng, num_requests)
    outputs = np.minimum(spec.output.sample(rng, num_requests), cap)
    arrivals = arrival_times(rng, num_requests, arrival, rate)
    return [TraceRequest(int(p), int(o), float(t), cap) for p, o, t in zip(prompts, outputs, arrivals)]


def save_trace(path: str | Path, trace: Iterable[TraceRequest]) -> Path:
    """Write ``trace`` as JSONL (one request per line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for request in trace:
            fh.write(json.dumps(asdict(request)) + "\n")
    return path


def load_trace(path: str | Path, *, default_max_new_tokens: int = 1024) -> list[TraceRequest]:
    """Read a JSONL trace; ``max_new_tokens`` defaults to ``default_max_new_tokens`` when absent.

    Requests are returned sorted by arrival (stable).
    """
    out = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                cap = int(row.get("max_new_tokens", default_max_new_tokens))
                out.append(
                    TraceRequest(
                        int(row["prompt_tokens"]),
                        min(int(row["output_tokens"]), cap),
                        float(row.get("arrival", 0.0)),
                        cap,
                    )
                )
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{path}:{lineno}: not a trace request ({err}): {line.strip()[:200]}") from None
    if not out:
        raise ValueError(f"{path}: empty trace")
    return sorted(out, key=lambda r: r.arrival)


def summarize(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """Means and extremes of a trace (for reports)."""
    prompts = np.array([r.prompt_tokens for r in trace])
    outputs = np.array([r.output_tokens for r in trace])
    caps = np.array([r.max_new_tokens for r in trace])
    reserved = np.array([r.reserved_tokens for r in trace])
    return {
        "requests": len(trace),
        "prompt_mean": float(prompts.mean()),
        "prompt_max": int(prompts.max()),
        "output_mean": float(outputs.mean()),
        "output_max": int(outputs.max()),
        "max_new_tokens_mean": float(caps.mean()),
        "reserved_mean": float(reserved.mean()),
        "duration_s": float(max(r.arrival for r in trace)),
    }
