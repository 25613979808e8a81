"""Static checks of examples/observability (the PromQL itself is checked by test_prometheus.py)."""

from __future__ import annotations

import json

import yaml
from telemetry_samples import EXAMPLES


def test_grafana_dashboard_is_importable_json() -> None:
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for panel in panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("usage", "waste", "preemptions by mode", "wait", "batch size", "step latency"):
        assert topic in titles


def test_collector_config_wires_otlp_to_prometheus_and_debug() -> None:
    config = yaml.safe_load((EXAMPLES / "otel-collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    pipelines = config["service"]["pipelines"]
    assert pipelines["metrics"]["receivers"] == ["otlp"]
    assert set(pipelines["metrics"]["exporters"]) == {"prometheus", "debug"}
    assert "otlp" in pipelines["traces"]["receivers"]
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(config.get(kind) or {}), (kind, pipeline)


def test_readme_names_every_example_file() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    for path in EXAMPLES.iterdir():
        if path.name != "README.md":
            assert path.name in readme, path.name
