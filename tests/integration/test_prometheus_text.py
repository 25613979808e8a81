"""The harness's one Prometheus text parser (``integration/prometheus_text.py``): what the demo's poller, the
end-to-end bench and the peer runs read from the shard's ``/metrics``."""

from __future__ import annotations

import asyncio
import math

import pytest

from integration.net import free_port
from integration.prometheus_text import counter_delta, parse_prometheus, sample_value, scrape, scrape_every
from tests.telemetry.telemetry_samples import memory_stats
from tgi_paged_backend.config import TelemetryConfig
from tgi_paged_backend.telemetry.recorder import OtelRecorder
from tgi_paged_backend.telemetry.step_record import StepRecord

TEXT = r"""# HELP req_seconds Request latency
# TYPE req_seconds histogram
req_seconds_bucket{phase="decode",le="0.1"} 3.0
req_seconds_bucket{phase="decode",le="+Inf"} 5.0
req_seconds_sum{phase="decode"} 0.75
req_seconds_count{phase="decode"} 5.0
# HELP jobs_total Jobs done
# TYPE jobs_total counter
jobs_total{mode="re,compute"} 4.0
jobs_created{mode="re,compute"} 1.7e9
# TYPE odd gauge
odd{path="a}b",quote="say \"hi\"",nl="x\ny"} NaN
odd{path="c"} +Inf
odd{path="d"} -Inf
bare 2
untyped_thing{a="b"} 1 1700000000000
"""


def test_every_sample_by_name_and_sorted_labels() -> None:
    values = parse_prometheus(TEXT)
    assert values[("req_seconds_bucket", (("le", "0.1"), ("phase", "decode")))] == 3.0
    assert values[("req_seconds_bucket", (("le", "+Inf"), ("phase", "decode")))] == 5.0
    assert values[("req_seconds_sum", (("phase", "decode"),))] == 0.75
    assert values[("req_seconds_count", (("phase", "decode"),))] == 5.0
    assert values[("jobs_total", (("mode", "re,compute"),))] == 4.0
    assert values[("jobs_created", (("mode", "re,compute"),))] == 1.7e9
    # Escaped quotes and newlines, a brace in a value; NaN and both infinities.
    assert math.isnan(values[("odd", (("nl", "x\ny"), ("path", "a}b"), ("quote", 'say "hi"')))])
    assert values[("odd", (("path", "c"),))] == math.inf and values[("odd", (("path", "d"),))] == -math.inf
    assert values[("bare", ())] == 2.0 and values[("untyped_thing", (("a", "b"),))] == 1.0  # timestamp dropped
    assert not any(name.startswith("#") for name, _ in values)
    assert len(values) == 11


def test_a_text_it_cannot_read_raises() -> None:
    with pytest.raises(ValueError):
        parse_prometheus("half_a_line{ 1\n")


def test_sample_value_matches_a_subset_of_the_labels() -> None:
    values = parse_prometheus(TEXT)
    assert sample_value(values, "req_seconds_count", phase="decode") == 5.0
    assert sample_value(values, "req_seconds_bucket", le="+Inf") == 5.0
    assert sample_value(values, "jobs_total") == 4.0  # any labels
    assert sample_value(values, "jobs_total", mode="swap") == 0.0 and sample_value(values, "missing") == 0.0
    later = parse_prometheus(TEXT.replace('jobs_total{mode="re,compute"} 4.0', 'jobs_total{mode="re,compute"} 9.0'))
    assert counter_delta(values, later, "jobs_total", mode="re,compute") == 5.0


def test_the_shards_recorder_over_http() -> None:
    """The names and labels the shard's recorder exports (a histogram's buckets among them), scraped as the
    harness does; a port nothing listens on is an ``OSError`` and :func:`scrape_every` skips it."""
    rec = OtelRecorder(TelemetryConfig(metrics_port=0), rank=0)
    try:
        rec.record_step(
            StepRecord(
                phase="decode", step_s=0.01, batch_size=4, tokens_computed=4, num_running=4, memory=memory_stats()
            )
        )
        values = scrape(rec.metrics_port)
        taken: list[dict] = []

        async def two_ports() -> None:
            tasks = [asyncio.create_task(scrape_every(p, 0.01, taken.append)) for p in (rec.metrics_port, free_port())]
            while not taken:
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(asyncio.wait_for(two_ports(), 10))
    finally:
        rec.shutdown()
    assert sample_value(values, "tgi_paged_step_seconds_count", phase="decode") == 1.0
    assert sample_value(values, "tgi_paged_step_seconds_bucket", phase="decode", le="+Inf") == 1.0
    assert sample_value(values, "tgi_paged_requests", state="running") == 4.0
    assert sample_value(values, "tgi_paged_kv_blocks", state="free") == 17.0
    assert taken and taken[0].keys() == values.keys()
    with pytest.raises(OSError):
        scrape(free_port(), timeout=1)
