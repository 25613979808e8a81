"""``/metrics``: the stock router's Prometheus series, as far as the router replay can feed them.

The stock router renders with ``metrics-exporter-prometheus``, whose counters keep their bare name
(``tgi_request_count``, no ``_total`` suffix) and whose histograms have explicit buckets. The
``prometheus_client`` renderer appends ``_total`` to every counter, so this module renders the text
format itself (names, labels and types only; HELP lines are the stock descriptions, shortened).

Two sources:

* request-level series recorded by the HTTP handlers (``tgi_request_*``), with the stock bucket
  layouts (35 geometric buckets from 0.00015 s for durations; 100 linear buckets up to
  ``max_input_tokens`` / ``max_total_tokens`` for token counts);
* router-level series read from ``RouterStats`` / ``RouterInfo`` at scrape time: ``tgi_queue_size``,
  ``tgi_batch_current_size`` (entries inside the batching loop), ``tgi_batch_max_total_tokens``,
  ``tgi_batch_inference_{count,success,failure}{method}``, ``tgi_batch_concat{reason}``.

Series the replay cannot observe (``tgi_batch_current_max_tokens``, the per-batch forward/decode/filter
durations, ``tgi_batch_next_size``) are not rendered.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = tuple(0.00015 * 1.5**k for k in range(35))
FAILURE_REASONS = ("validation", "overloaded", "template", "incomplete", "dropped", "generation")

_HELP = {
    "tgi_request_count": "Total number of requests",
    "tgi_request_success": "Number of successful requests",
    "tgi_request_failure": "Number of failed requests",
    "tgi_request_duration": "Total time spent processing the request",
    "tgi_request_validation_duration": "Time spent validating the request",
    "tgi_request_queue_duration": "Time spent in the queue per request",
    "tgi_request_inference_duration": "Request inference duration",
    "tgi_request_mean_time_per_token_duration": "Mean time per token per request",
    "tgi_request_input_length": "Input token length per request",
    "tgi_request_generated_tokens": "Generated tokens per request",
    "tgi_request_max_new_tokens": "Maximum new tokens per request",
    "tgi_queue_size": "Current queue size",
    "tgi_batch_current_size": "Current batch size",
    "tgi_batch_max_total_tokens": "Maximum amount of tokens in total",
    "tgi_batch_inference_count": "Inference calls per method (prefill or decode)",
    "tgi_batch_inference_success": "Number of successful inference calls per method (prefill or decode)",
    "tgi_batch_inference_failure": "Inference failures per method (prefill or decode)",
    "tgi_batch_concat": "Number of batch concatenates",
}


def _fmt(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + body + "}"


class _Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> Iterable[str]:
        cumulative = 0
        for bound, count in zip(self.bounds, self.counts):
            cumulative += count
            yield f'{name}_bucket{{le="{_fmt(bound)}"}} {cumulative}'
        yield f'{name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{name}_sum {_fmt(self.sum)}"
        yield f"{name}_count {self.count}"


class HttpMetrics:
    """Request counters and histograms, plus a scrape-time view of the router replay."""

    def __init__(self, router: Any, *, max_input_tokens: int, max_total_tokens: int) -> None:
        self._router = router
        self._lock = threading.Lock()
        self._counters: dict[str, float] = defaultdict(float)
        self._failures: dict[str, float] = {}
        input_buckets = [max_input_tokens / 100 * (i + 1) for i in range(100)]
        total_buckets = [max_total_tokens / 100 * (i + 1) for i in range(100)]
        self._histograms: dict[str, _Histogram] = {
            name: _Histogram(DURATION_BUCKETS)
            for name in (
                "tgi_request_duration",
                "tgi_request_validation_duration",
                "tgi_request_queue_duration",
                "tgi_request_inference_duration",
                "tgi_request_mean_time_per_token_duration",
            )
        }
        self._histograms["tgi_request_input_length"] = _Histogram(input_buckets)
        self._histograms["tgi_request_generated_tokens"] = _Histogram(total_buckets)
        self._histograms["tgi_request_max_new_tokens"] = _Histogram(total_buckets)

    # -- recording (handlers) -----------------------------------------------------------------

    def request(self) -> None:
        self._inc("tgi_request_count")

    def failure(self, reason: str) -> None:
        with self._lock:
            self._failures[reason] = self._failures.get(reason, 0) + 1

    def success(
        self,
        *,
        total_s: float,
        validation_s: float,
        queue_s: float,
        inference_s: float,
        generated_tokens: int,
        input_length: int,
        max_new_tokens: int | None,
    ) -> None:
        per_token = inference_s / generated_tokens if generated_tokens else 0.0
        with self._lock:
            self._counters["tgi_request_success"] += 1
            for name, value in (
                ("tgi_request_duration", total_s),
                ("tgi_request_validation_duration", validation_s),
                ("tgi_request_queue_duration", queue_s),
                ("tgi_request_inference_duration", inference_s),
                ("tgi_request_mean_time_per_token_duration", per_token),
                ("tgi_request_generated_tokens", generated_tokens),
                ("tgi_request_input_length", input_length),
            ):
                self._histograms[name].observe(max(value, 0.0))
            if max_new_tokens is not None:
                self._histograms["tgi_request_max_new_tokens"].observe(max_new_tokens)

    def _inc(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counters[name] += value

    # -- rendering ----------------------------------------------------------------------------

    def render(self) -> str:
        out: list[str] = []

        def family(name: str, kind: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
            out.append(f"# HELP {name} {_HELP.get(name, name)}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{_labels(labels)} {_fmt(value)}")

        with self._lock:
            counters = dict(self._counters)
            failures = dict(self._failures)
            histograms = {name: (h.bounds, list(h.counts), h.sum, h.count) for name, h in self._histograms.items()}
        family("tgi_request_count", "counter", [({}, counters.get("tgi_request_count", 0))])
        family("tgi_request_success", "counter", [({}, counters.get("tgi_request_success", 0))])
        if failures:
            family("tgi_request_failure", "counter", [({"err": k}, v) for k, v in sorted(failures.items())])

        stats, info = self._router.stats, self._router.info
        in_loop = (
            stats.requests_scheduled
            - stats.requests_finished
            - stats.requests_failed
            - stats.requests_dropped
            - stats.requests_dropped_at_pop
            - stats.requests_incomplete
            - stats.queue_length
        )
        family("tgi_queue_size", "gauge", [({}, stats.queue_length)])
        family("tgi_batch_current_size", "gauge", [({}, max(in_loop, 0))])
        family("tgi_batch_max_total_tokens", "gauge", [({}, info.max_batch_total_tokens)])
        calls = {"prefill": stats.prefill_calls, "decode": stats.decode_calls}
        failed = {"prefill": stats.prefill_failures, "decode": stats.decode_failures}
        family("tgi_batch_inference_count", "counter", [({"method": m}, v) for m, v in calls.items()])
        family("tgi_batch_inference_success", "counter", [({"method": m}, calls[m] - failed[m]) for m in calls])
        family("tgi_batch_inference_failure", "counter", [({"method": m}, v) for m, v in failed.items()])
        if stats.batch_concat:
            family("tgi_batch_concat", "counter", [({"reason": k}, v) for k, v in sorted(stats.batch_concat.items())])

        for name, (bounds, counts, total, count) in histograms.items():
            out.append(f"# HELP {name} {_HELP.get(name, name)}")
            out.append(f"# TYPE {name} histogram")
            histogram = _Histogram(bounds)
            histogram.counts, histogram.sum, histogram.count = counts, total, count
            out.extend(histogram.lines(name))
        return "\n".join(out) + "\n"
