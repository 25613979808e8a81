"""The shard's Prometheus endpoint as the harness reads it: the text exposition as samples keyed by name
and labels, one scrape over HTTP, one value by name and a subset of labels.

prometheus_client's own parser reads the text (the package depends on it): comments and ``# HELP`` /
``# TYPE`` lines, label values with escapes, a histogram's ``_bucket`` (``le`` stays a label: ``"+Inf"``
for the last), ``_sum`` and ``_count`` samples, a counter's ``_total`` and ``_created``, and ``NaN`` /
``+Inf`` / ``-Inf`` values. A text it cannot read raises ``ValueError``.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""``{(sample name, sorted (label, value) pairs): value}``: every sample of one scrape."""


def parse_prometheus(text: str) -> Samples:
    """Every sample of a text exposition, by its name (``_bucket``/``_sum``/``_count``/``_total`` included)
    and its sorted labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def scrape(port: int, timeout: float = 2.0) -> Samples:
    """:func:`parse_prometheus` of ``http://127.0.0.1:PORT/metrics`` (``OSError`` when nothing answers)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        return parse_prometheus(resp.read().decode("utf-8"))


def sample_value(values: Samples, name: str, **labels: str) -> float:
    """The first sample named ``name`` whose labels include ``labels`` (it may have others); 0.0 when none."""
    want = tuple(sorted(labels.items()))
    for (n, lab), v in values.items():
        if n == name and all(item in lab for item in want):
            return v
    return 0.0


def counter_delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much ``name`` (with ``labels``, as :func:`sample_value` matches them) grew from one scrape to a later one."""
    return sample_value(after, name, **labels) - sample_value(before, name, **labels)


async def scrape_every(port: int, interval_s: float, take: Callable[[Samples], None]) -> None:
    """Scrape ``port`` every ``interval_s`` seconds (in a thread: the event loop keeps serving) and hand each
    scrape to ``take``; a scrape that nothing answers is skipped. Runs until cancelled."""
    while True:
        try:
            values = await asyncio.to_thread(scrape, port)
        except OSError:
            values = None
        if values is not None:
            take(values)
        await asyncio.sleep(interval_s)
