"""The Kubernetes manifests (integration/k8s) against what the shard really exports (issue 25).

Every metric the endpoint picker is told to read is one the shard exports, with the type the picker
expects; the ports and path the picker and Prometheus use are the ones the shard's settings give; the
KV-events endpoint is a container port; the engine label matches the picker's engine config.
"""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "telemetry"))
from telemetry_samples import memory_stats  # noqa: E402  (tests/telemetry is not a package)

from tgi_paged_backend.config import TelemetryConfig  # noqa: E402
from tgi_paged_backend.envs import build_config  # noqa: E402
from tgi_paged_backend.telemetry.recorder import METRIC_NAMES, OtelRecorder  # noqa: E402

K8S = Path(__file__).resolve().parents[2] / "integration" / "k8s"


def _docs(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((K8S / name).read_text())}


def _engine_config() -> tuple[dict, dict]:
    config = _docs("endpoint-picker-config.yaml")["EndpointPickerConfig"]
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    (engine,) = plugins["core-metrics-extractor"]["engineConfigs"]
    return plugins, engine


def _container() -> tuple[dict, dict[str, str], dict[str, int]]:
    deployment = _docs("tgi-paged.yaml")["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return deployment, env, ports


def test_the_picker_reads_metrics_the_shard_exports_with_the_expected_types() -> None:
    _, engine = _engine_config()
    specs = {k: v for k, v in engine.items() if k.endswith("Spec")}
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec"}
    # One scrape of a live recorder: the names, types and labels as a picker sees them.
    recorder = OtelRecorder(TelemetryConfig(metrics_port=0))
    recorder.record_memory(memory_stats(), num_running=3, num_preempted=1, num_waiting=2)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{recorder.metrics_port}/metrics", timeout=10).read().decode()
    finally:
        recorder.shutdown()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    for key, selector in specs.items():
        name = selector.split("{")[0]
        assert name in METRIC_NAMES, f"{key}: {name} is not a metric the shard exports"
        assert types.get(name) == "gauge", f"{key}: {name} must be a gauge, is {types.get(name)}"
    labels = re.findall(r'(\w+)="', engine["runningRequestsSpec"])
    assert labels == ["state"]  # tgi_paged_requests is split by state; the picker reads the running series
    info = re.search(r"^tgi_paged_lora_requests_info\{([^}]*)\}", text, flags=re.M)
    assert info and {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= set(
        re.findall(r"(\w+)=", info.group(1))
    )
    assert engine["cacheBlockSizeLabelName"] == "block_size" and engine["cacheNumBlocksLabelName"] == "num_gpu_blocks"


def test_ports_path_labels_and_settings_agree() -> None:
    plugins, engine = _engine_config()
    deployment, env, ports = _container()
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    extractor = plugins["core-metrics-extractor"]
    assert template_labels[extractor["engineLabelKey"]] == engine["name"]
    assert plugins["metrics-data-source"]["path"] == "/metrics"
    # The settings the container gets parse, and give the endpoint the picker and Prometheus scrape.
    config = build_config({"model_id": "/models/m"}, {k: v for k, v in env.items() if v is not None})
    telemetry = config.telemetry
    assert telemetry.metrics_host == "0.0.0.0" and telemetry.metrics_port == ports["metrics"]
    assert telemetry.kv_events_endpoint == f"tcp://*:{ports['kv-events']}"
    assert telemetry.kv_events_replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    pool = _docs("tgi-paged.yaml")["InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    monitor = _docs("tgi-paged.yaml")["PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert "--model-server-metrics-port=9400" in (K8S / "endpoint-picker-config.yaml").read_text()
    assert ports["metrics"] == 9400


def test_only_the_indexer_reaches_the_kv_event_ports() -> None:
    """The events carry users' token ids: the policy selects the shard's pods, admits the event and replay
    ports only from the indexer's pods, and keeps every other container port open (serving goes on)."""
    deployment, env, ports = _container()
    policy = _docs("tgi-paged.yaml")["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    event_ports = {"kv-events", "kv-replay"}
    assert env["TGI_PAGED_KV_EVENTS_ENDPOINT"].endswith(f":{ports['kv-events']}")
    assert env["TGI_PAGED_KV_EVENTS_REPLAY_ENDPOINT"].endswith(f":{ports['kv-replay']}")
    admitted: dict[str, list] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).append(rule.get("from"))
    assert set(admitted) == set(ports), "every container port has a rule, and only those"
    for name in event_ports:
        for sources in admitted[name]:
            assert sources, f"{name} is open to every pod"
            for source in sources:
                assert source["podSelector"]["matchLabels"] == {"llm-d.ai/kv-cache-indexer": "true"}, source
    for name in set(ports) - event_ports:
        assert None in admitted[name], f"{name} should stay open to the cluster"
