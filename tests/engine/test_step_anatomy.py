"""Step anatomy: the timer's laps partition a step, and a real engine step reports every part.

- ``StepTimer``: consecutive laps charge disjoint intervals, ``add`` does not move the boundary,
  ``device_lap`` waits on the device first (a CUDA stand-in is called), on CPU there is nothing to wait on;
- a real engine (tiny Llama) reports ``part_s`` in its step record for every part of ``STEP_PARTS``: the
  forward and schedule parts are positive, the parts cover the step's wall time (``step_s`` is inside their
  sum), and the telemetry part of a step is the previous step's report, measured.
"""

from __future__ import annotations

import time

from tests.engine.conftest import RouterDriver, make_engine, make_text, spec
from tgi_paged_backend.engine.step_anatomy import STEP_PARTS, StepTimer, device_sync
from tgi_paged_backend.engine.types import BatchSpec


def test_laps_partition_the_interval_and_add_keeps_the_boundary() -> None:
    synced = []
    timer = StepTimer(sync=lambda: synced.append(1))
    t0 = time.perf_counter_ns()
    time.sleep(0.002)
    timer.lap("schedule")
    timer.add("telemetry", 5_000_000)
    time.sleep(0.003)
    timer.device_lap("forward")
    elapsed = time.perf_counter_ns() - t0
    assert synced == [1]
    ns = timer.ns
    assert ns["schedule"] >= 2_000_000 and ns["forward"] >= 3_000_000 and ns["telemetry"] == 5_000_000
    assert ns["schedule"] + ns["forward"] <= elapsed + 1_000_000
    assert [p for p, _ in timer.seconds()] == list(STEP_PARTS)
    assert device_sync("cpu") is None


def test_engine_steps_report_every_part(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=64, block_size=8)
    driver = RouterDriver(engine)
    batch = BatchSpec(id=1, requests=tuple(spec(i, make_text(i, 6 + i), 5) for i in range(3)))
    cached = driver.prefill(batch)
    record = engine.last_step
    parts = dict(record.part_s)
    assert list(parts) == list(STEP_PARTS)
    assert parts["forward"] > 0 and parts["schedule"] > 0 and parts["prepare"] > 0
    assert parts["sample"] > 0 and parts["detokenize"] > 0 and parts["copy"] == 0
    assert sum(parts.values()) >= record.step_s  # bookkeeping after the forward is counted too
    first_report = engine._telemetry_ns
    assert first_report > 0
    driver.decode([cached])
    decode = engine.last_step
    assert decode.phase == "decode"
    assert dict(decode.part_s)["telemetry"] == first_report / 1e9  # the previous step's report
