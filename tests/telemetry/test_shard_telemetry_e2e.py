"""Telemetry of the real shard: spawned like the launcher, driven by the router replay.

Checks the whole path a user relies on: the shard's Prometheus endpoint shows pool usage and
preemptions, and the OTLP/gRPC collector (a receiver built on opentelemetry-proto) gets one span per
RPC parented to the router's ``traceparent`` plus the metrics, flushed on SIGTERM.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from integration.launcher_spawn import LaunchedShards, LauncherOptions
from integration.net import free_port
from integration.prometheus_text import scrape
from integration.router_replay import GenerateParameters, Router
from tests.helpers.tiny_models import write_tiny_model
from tests.telemetry.otlp_sink import OtlpSink, attributes

PROMPTS = ["hello world this is a test", "the quick brown fox jumps", "one two three four", "paged blocks"]


def test_real_shard_exports_metrics_and_parented_spans(tmp_path: Path) -> None:
    model = write_tiny_model("llama", tmp_path / "model", seed=5)
    sink = OtlpSink()
    port = free_port()
    opts = LauncherOptions(
        uds_path=str(tmp_path / "shard"),
        otlp_endpoint=sink.endpoint,
        otlp_service_name="tgi-test",
        env={
            "TGI_PAGED_NUM_BLOCKS": "10",
            "TGI_PAGED_BLOCK_SIZE": "8",
            "TGI_PAGED_OVERCOMMIT": "4",
            "TGI_PAGED_PREEMPTION": "recompute",
            "TGI_PAGED_METRICS_PORT": str(port),
            "PREFIX_CACHING": "0",
        },
        max_input_tokens=32,
        max_total_tokens=72,
    )

    async def drive() -> None:
        router = await Router.connect(opts.uds_path, str(model), max_batch_prefill_tokens=64, send_traceparent=True)
        try:

            async def one(text: str) -> None:
                stream = await router.generate(text, GenerateParameters(max_new_tokens=24, ignore_eos_token=True))
                await stream.collect()

            await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await router.close()

    try:
        with LaunchedShards(str(model), opts, ready_timeout=120) as shards:
            asyncio.run(asyncio.wait_for(drive(), 240))
            samples = scrape(port, timeout=10)
            shards.terminate()
            assert shards.exit_codes == {0: 0}, shards.stderr
        # Prometheus endpoint: pool usage gauge, preemptions by mode, steps.
        assert 0.0 <= samples[("tgi_paged_kv_usage_ratio", ())] <= 1.0
        preempted = {labels: v for (name, labels), v in samples.items() if name == "tgi_paged_preemptions_total"}
        assert sum(preempted.values()) > 0, preempted
        assert any(("mode", "recompute") in labels for labels, v in preempted.items() if v > 0)
        assert samples[("tgi_paged_kv_blocks", (("state", "free"),))] >= 0
        # OTLP: spans parented to the router's traceparent, metrics flushed at shutdown.
        assert sink.wait_for(lambda: any(s.name.endswith("Decode") for _, s in sink.spans()), timeout=20)
        spans = sink.spans()
        decode_spans = [s for _, s in spans if s.name.endswith("Decode")]
        assert decode_spans and all(len(s.parent_span_id) == 8 for s in decode_spans)
        assert all(res.get("service.name") == "tgi-test" for res, _ in spans)
        assert any(attributes(s.attributes).get("tgi_paged.batch.size") for s in decode_spans) or any(
            "batch" in key for s in decode_spans for key in attributes(s.attributes)
        )
        assert sink.wait_for(lambda: "tgi_paged_preemptions_total" in sink.latest_metrics(), timeout=20)
    finally:
        sink.stop()
