"""The shard's Prometheus endpoint: scraped in-process, linted by promtool, and scraped by a real Prometheus.

The real-server test needs ``prometheus`` and ``promtool`` on PATH (``scripts/install_prometheus.sh``);
without them those tests skip with that hint. The endpoint tests themselves need nothing external.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import prometheus_client
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from telemetry_samples import BUDGET, EXAMPLES, memory_stats, sample_steps

from integration.net import free_port
from tgi_paged_backend.config import TelemetryConfig
from tgi_paged_backend.telemetry.recorder import METRIC_NAMES, OtelRecorder

INSTALL_HINT = "prometheus/promtool not on PATH: run scripts/install_prometheus.sh"


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _sample_names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M)}


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _alert_exprs() -> list[str]:
    rules = yaml.safe_load((EXAMPLES / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


@pytest.fixture
def recorder() -> Iterator[OtelRecorder]:
    rec = OtelRecorder(TelemetryConfig(metrics_port=0), rank=0)
    rec.record_budget(BUDGET)
    for record in sample_steps():
        rec.record_step(record)
    yield rec
    rec.shutdown()


def test_metrics_endpoint_serves_every_instrument(recorder: OtelRecorder) -> None:
    text = _get(f"http://127.0.0.1:{recorder.metrics_port}/metrics").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # prometheus_client's parser strips the counter suffix from family names
    assert {n.removesuffix("_total") for n in METRIC_NAMES} <= set(families)
    assert families["tgi_paged_preemptions"].type == "counter"
    assert families["tgi_paged_step_seconds"].type == "histogram"
    assert families["tgi_paged_kv_usage_ratio"].type == "gauge"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("tgi_paged_kv_usage_ratio", ())] == 0.75
    assert samples[("tgi_paged_preemptions_total", (("mode", "swap"),))] == 1
    assert samples[("tgi_paged_kv_blocks", (("state", "retained"),))] == 5
    held = (("group", "1"), ("state", "held"), ("window", "4096"))
    assert samples[("tgi_paged_kv_group_blocks", held)] == 15
    # group 1 holds 15 blocks of 16 slots with 40 unfilled; physical tokens count each position once
    assert samples[("tgi_paged_kv_group_waste_ratio", (("group", "1"), ("window", "4096")))] == 40 / (15 * 16)
    assert samples[("tgi_paged_kv_physical_tokens", ())] == 100 // 2 * 16
    assert samples[("tgi_paged_step_seconds_count", (("phase", "decode"),))] == 2
    assert samples[("tgi_paged_step_seconds_bucket", (("le", "0.025"), ("phase", "decode")))] == 2
    assert samples[("tgi_paged_step_seconds_bucket", (("le", "0.1"), ("phase", "prefill")))] == 0
    (info,) = [s for s in families["target_info"].samples]
    assert info.labels["service_name"] == "text-generation-inference.server"
    assert info.labels["tgi_paged_shard_rank"] == "0"


def test_kv_tier_metrics(recorder: OtelRecorder) -> None:
    """The tiers' cumulative snapshot of the last step, by tier, direction, state and reason."""
    text = _get(f"http://127.0.0.1:{recorder.metrics_port}/metrics").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert families["tgi_paged_kv_tier_hit_tokens"].type == "counter"
    hits = {t: samples[("tgi_paged_kv_tier_hit_tokens_total", (("tier", t),))] for t in ("pool", "host", "disk")}
    assert hits == {"pool": 16, "host": 8, "disk": 8}
    assert sum(hits.values()) == samples[("tgi_paged_prefix_hit_tokens_total", ())]
    assert samples[("tgi_paged_kv_tier_moved_bytes_total", (("direction", "spill"),))] == 5000
    assert samples[("tgi_paged_kv_tier_moved_seconds_total", (("direction", "fetch"),))] == 0.75
    assert samples[("tgi_paged_kv_host_tier_rows", (("state", "used"),))] == 30
    assert samples[("tgi_paged_kv_host_tier_rows", (("state", "total"),))] == 40
    assert samples[("tgi_paged_kv_disk_tier_files", ())] == 12
    assert samples[("tgi_paged_kv_disk_tier_bytes", (("state", "max"),))] == 16_000
    dropped = "tgi_paged_kv_tier_dropped_blocks_total"
    assert samples[(dropped, (("reason", "ignored"), ("tier", "disk")))] == 2
    assert samples[(dropped, (("reason", "no_room"), ("tier", "host")))] == 1
    assert samples[(dropped, (("reason", "evicted"), ("tier", "host")))] == 7
    assert samples[("tgi_paged_kv_tier_swap_kept_blocks_total", ())] == 5


def test_dashboard_and_alerts_use_only_exported_names(recorder: OtelRecorder) -> None:
    exported = _sample_names(recorder.prometheus.render().decode())
    used = {name for expr in _dashboard_exprs() + _alert_exprs() for name in re.findall(r"tgi_paged_\w+", expr)}
    assert used, "no tgi_paged_* metric found in the examples"
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    # every instrument appears on the dashboard
    assert {n for n in METRIC_NAMES} <= {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}


def test_port_is_offset_by_rank_and_registries_are_private() -> None:
    port = free_port()
    a = OtelRecorder(TelemetryConfig(metrics_port=port - 1), rank=1)
    b = OtelRecorder(TelemetryConfig(metrics_port=0), rank=0)
    try:
        assert a.metrics_port == port
        a.record_step(sample_steps()[0])
        b.record_step(replace(sample_steps()[0], memory=memory_stats(num_used_blocks=10)))
        assert b"tgi_paged_kv_usage_ratio 0.6" in _get(f"http://127.0.0.1:{port}/metrics")
        assert b"tgi_paged_kv_usage_ratio 0.1" in _get(f"http://127.0.0.1:{b.metrics_port}/metrics")
        assert b"tgi_paged" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
        with pytest.raises(OSError, match="TGI_PAGED_METRICS_PORT"):
            OtelRecorder(TelemetryConfig(metrics_port=port - 1), rank=1)  # taken
        with pytest.raises(OSError, match="65537"):
            OtelRecorder(TelemetryConfig(metrics_port=65535), rank=2)
    finally:
        a.shutdown()
        b.shutdown()
    with pytest.raises(OSError):
        _get(f"http://127.0.0.1:{port}/metrics", timeout=1)  # stopped with the recorder


# -- promtool and a real Prometheus ---------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(INSTALL_HINT)
    return path


def test_promtool_lints_the_exposition(recorder: OtelRecorder, promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "metrics"], input=recorder.prometheus.render(), capture_output=True, timeout=30
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_promtool_checks_and_unit_tests_the_alert_rules(promtool: str) -> None:
    check = subprocess.run(
        [promtool, "check", "rules", str(EXAMPLES / "alerts.yml")], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 3 rules found" in check.stdout
    unit = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"], cwd=EXAMPLES, capture_output=True, text=True, timeout=60
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr


class PrometheusServer:
    """A throwaway Prometheus on 127.0.0.1 scraping one target every second."""

    def __init__(self, binary: str, workdir: Path, target_port: int) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(EXAMPLES / "alerts.yml")],
            "scrape_configs": [
                {"job_name": "tgi-paged", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = workdir / "prometheus.log"

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            return json.loads(_get(url))
        except urllib.error.HTTPError as err:  # 400 for a bad query still carries a JSON body
            return json.loads(err.read())

    def wait_for(self, query: str, predicate, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        result: list[dict] = []
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log_path.read_text()[-3000:]}"
            try:
                answer = self.api("query", query=query)
                result = answer["data"]["result"] if answer.get("status") == "success" else []
            except OSError:
                result = []
            if result and predicate(result):
                return result
            time.sleep(0.25)
        raise AssertionError(
            f"{query!r} never satisfied the check; last result {result}\n{self.log_path.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def prometheus(recorder: OtelRecorder, tmp_path: Path, promtool: str) -> Iterator[PrometheusServer]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(INSTALL_HINT)
    server = PrometheusServer(binary, tmp_path, recorder.metrics_port)
    yield server
    server.stop()


def test_real_prometheus_scrapes_the_pool_usage_and_runs_the_examples(recorder, prometheus) -> None:
    def value(result: list[dict]) -> float:
        return float(result[0]["value"][1])

    prometheus.wait_for("tgi_paged_kv_usage_ratio", lambda r: value(r) == 0.75)
    # a later step is picked up by the next scrape
    recorder.record_step(replace(sample_steps()[2], memory=memory_stats(num_used_blocks=96, num_free_blocks=1)))
    prometheus.wait_for("tgi_paged_kv_usage_ratio", lambda r: value(r) == 0.96)
    swap = prometheus.wait_for('tgi_paged_preemptions_total{mode="swap"}', lambda r: True)
    assert value(swap) == 1
    assert swap[0]["metric"]["job"] == "tgi-paged"
    prometheus.wait_for("tgi_paged_step_seconds_count", lambda r: len(r) == 2)

    # every dashboard query is valid PromQL for the real engine (Grafana variables filled in)
    for expr in _dashboard_exprs():
        query = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        answer = prometheus.api("query", query=query)
        assert answer["status"] == "success", (expr, answer)
    # the alert rules load and evaluate without errors ("unknown" until first evaluated)
    deadline = time.monotonic() + 15
    while True:
        rules = [r for g in prometheus.api("rules")["data"]["groups"] for r in g["rules"]]
        if len(rules) == 3 and all(r["health"] == "ok" for r in rules):
            break
        assert time.monotonic() < deadline and not any(r["health"] == "err" for r in rules), rules
        time.sleep(0.5)
