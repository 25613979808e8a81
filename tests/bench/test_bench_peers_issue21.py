"""Issue 21's additions to the peer harness, without any engine (``integration/peers``; the run is report-only).

- ``host``: the CPU model and the ISA flags that pick the kernels are read from cpuinfo text; native bf16 is
  AMX (both ``amx_*`` flags) or AVX512-BF16, and the report says when a bf16 run is not on such a host;
- ``plan``: ``--scenarios`` map to sections, this shard and vLLM alternate round by round (Poisson and
  transformers once), and rounds merge into the best one with every round kept;
- ``goals``: the issue-21 table judges goals and floors, says why a figure is missing, and refuses an
  overhead share that a load change made negative;
- ``hostbound``: the host-bound config keeps SmolLM2's vocabulary, special tokens and RoPE;
- ``report``: the single-request and ratio-to-vLLM rows appear side by side.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import pytest

from integration.peers.goals import Goal, issue21_goals, judge
from integration.peers.host import HostInfo, describe, parse_cpuinfo
from integration.peers.hostbound import HostBoundSpec, config_dict, is_current
from integration.peers.jobs import EngineResult, RunFigures
from integration.peers.plan import merge_rounds, schedule, sections
from integration.peers.report import format_report
from tgi_paged_backend.telemetry.step_record import STEP_PARTS

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def test_cpuinfo_parsing_reads_the_first_processor() -> None:
    model, flags = parse_cpuinfo(CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert flags == {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True}
    model, flags = parse_cpuinfo("processor : 0\nFeatures : fp asimd bf16\n")  # aarch64: no model name
    assert model == "unknown" and not any(flags.values())
    assert parse_cpuinfo("") == ("unknown", dict.fromkeys(flags, False))
    epyc = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n"
    assert parse_cpuinfo(epyc)[0] == "AMD EPYC (family 26, model 2)"  # a VM's bare vendor line, told apart


@pytest.mark.parametrize(
    ("present", "native"),
    [({"amx_bf16", "amx_tile", "avx512_bf16"}, "AMX"), ({"amx_bf16", "avx512_bf16"}, "AVX512-BF16"), ({"avx2"}, "")],
)
def test_native_bf16_needs_amx_tiles_or_avx512_bf16(present: set[str], native: str) -> None:
    flags = {f: f in present for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}
    host = HostInfo("cpu", 2, flags, (0.5, 0.4, 0.3))
    assert host.native_bf16 == native
    text = describe(host, "bfloat16")
    assert "load average at start 0.50 / 0.40 / 0.30" in text
    assert ("not the goal's native bf16" in text) == (not native)


def test_scenarios_make_sections_and_alternated_rounds() -> None:
    assert [(s.key, s.runs) for s in sections(("hostbound", "single", "burst"))] == [
        ("smollm2", ("burst", "single")),
        ("hostbound", ("burst",)),
    ]
    with pytest.raises(ValueError, match="unknown scenarios"):
        sections(("burst", "nope"))
    order = [(s.round, s.engine, s.runs) for s in schedule(("burst", "poisson", "single"), ("vllm", "shard"), 3)]
    assert order == [
        (0, "shard", ("burst", "poisson", "single")),
        (0, "vllm", ("burst", "poisson", "single")),
        (1, "shard", ("burst", "single")),
        (1, "vllm", ("burst", "single")),
        (2, "shard", ("burst", "single")),
        (2, "vllm", ("burst", "single")),
    ]
    assert [(s.round, s.engine) for s in schedule(("poisson",), ("shard",), 2)] == [(0, "shard")]  # once only


def _fig(tokens_per_s: float = 100.0, itl: float = 0.05) -> RunFigures:
    return RunFigures(tokens_per_s, 0.1, 0.2, itl, itl, 1.0, itl)


def test_merged_rounds_keep_the_best_and_every_round() -> None:
    one = EngineResult("e", key="shard", runs={"burst": _fig(80), "single": _fig(itl=0.04)}, notes=["a"])
    one.anatomy = {"forward": 1.0}
    two = EngineResult("e", key="shard", runs={"burst": _fig(90), "single": _fig(itl=0.06)}, notes=["b"])
    two.anatomy = {"forward": 2.0}
    merged = merge_rounds([one, two])
    assert merged.runs["burst"].tokens_per_s == 90 and merged.runs["single"].itl_mean_s == 0.04
    assert [f.tokens_per_s for f in merged.rounds["burst"]] == [80, 90]
    assert merged.anatomy == {"forward": 2.0}  # the best burst round's
    assert merged.notes == ["round 1: a", "round 2: b"]
    skipped = EngineResult("e", key="shard", skipped="crashed")
    assert merge_rounds([skipped, one]).notes == ["round 1: skipped: crashed", "round 2: a"]


def test_judge_reads_the_bounds() -> None:
    assert judge(1.0, ">= 1.0x") and not judge(0.84, ">= 0.85x")
    assert judge(0.09, "< 10 %") and not judge(0.10, "< 10 %")
    assert judge(None, ">= 1.0x") is None and judge(float("nan"), "<= 1.0x") is None
    assert Goal("g", 0.123, "< 10 %", percent=True).shown() == "12.3 %"


def _section(key: str, runs: tuple[str, ...], shard: dict, vllm: dict, **extra) -> dict:
    return {
        "key": key,
        "config": {"runs": list(runs)},
        "results": [
            EngineResult("this shard", key="shard", runs=shard, anatomy=extra.pop("anatomy", {})),
            EngineResult("vllm", key="vllm", runs=vllm),
        ],
        **extra,
    }


def _goals(report: dict) -> dict[str, Goal]:
    return {g.figure.split(":")[0].split(",")[0]: g for g in issue21_goals(report)}


def test_issue21_goals_judge_ratios_floors_and_the_anatomy() -> None:
    anatomy = {**dict.fromkeys(STEP_PARTS, 0.001), "forward": 0.094, "step": 0.1}
    smol = _section(
        "smollm2",
        ("burst", "single"),
        {"burst": _fig(90), "single": _fig(itl=0.048)},
        {"burst": _fig(100), "single": _fig(itl=0.05)},
        anatomy=anatomy,
        bare={"batch": 20, "forward_s": 0.095},
    )
    hostbound = _section("hostbound", ("burst",), {"burst": _fig(120)}, {"burst": _fig(100)})
    goals = _goals({"dtype": "float32", "sections": [smol, hostbound]})
    burst = goals["float32 burst tokens/s vs vLLM (SmolLM2)"]
    assert burst.measured == pytest.approx(0.9) and burst.met is False and burst.floor_held is True
    assert goals["single request"].measured == pytest.approx(0.96) and goals["single request"].met
    host = goals["host-bound burst"]
    assert host.measured == pytest.approx(1.2) and not host.met and host.floor_held
    assert goals["bfloat16 burst tokens/s vs vLLM (reported)"].measured is None
    share = goals["engine overhead share of the decode step"]
    total = sum(anatomy[p] for p in STEP_PARTS)
    assert share.measured == pytest.approx((total - 0.094) / total) and share.met  # everything but the forward
    assert goals["engine forward / bare HF forward"].measured == pytest.approx(0.094 / 0.095)

    # bfloat16: the burst ratio moves to the bf16 row; a host without native bf16 is named
    host_info = HostInfo("cpu", 2, {"avx2": True})
    goals = _goals({"dtype": "bfloat16", "host": host_info, "sections": [smol]})
    assert goals["float32 burst tokens/s vs vLLM (SmolLM2)"].measured is None
    bf16 = goals["bfloat16 burst tokens/s vs vLLM (reported)"]
    assert bf16.measured == pytest.approx(0.9) and "no native bf16" in bf16.note
    assert goals["host-bound burst"].note == "not run (--scenarios hostbound)"

    # a forward faster than HF's own (our kernels): the overhead share is still the step's non-forward part
    smol["bare"] = {"batch": 20, "forward_s": 1.0}
    goals = _goals({"dtype": "float32", "sections": [smol]})
    assert goals["engine overhead share of the decode step"].measured == pytest.approx((total - 0.094) / total)
    assert (
        goals["engine forward / bare HF forward"].measured == pytest.approx(0.094)
        and goals["engine forward / bare HF forward"].met
    )


def test_hostbound_config_keeps_smollm2s_tokens_and_rope(tmp_path) -> None:
    source = {
        "vocab_size": 49152,
        "eos_token_id": 2,
        "rope_theta": 1e5,
        "tie_word_embeddings": True,
        "hidden_size": 576,
    }
    config = config_dict(source, HostBoundSpec())
    assert config["vocab_size"] == 49152 and config["eos_token_id"] == 2 and config["rope_theta"] == 1e5
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (30, 128, 64)
    assert config["num_attention_heads"] * config["head_dim"] == config["hidden_size"]
    with pytest.raises(ValueError, match="head_dim"):
        config_dict(source, HostBoundSpec(num_attention_heads=3))
    spec = HostBoundSpec()
    assert not is_current(tmp_path, spec)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "hostbound_spec.json").write_text(json.dumps(asdict(HostBoundSpec(seed=1))))
    assert not is_current(tmp_path, spec)  # another seed: rewritten
    (tmp_path / "hostbound_spec.json").write_text(json.dumps(asdict(spec)))
    assert is_current(tmp_path, spec)


def test_report_puts_ratios_and_the_single_request_side_by_side() -> None:
    shard = EngineResult("this shard (test)", key="shard", runs={"burst": _fig(90), "single": _fig(itl=0.055)})
    shard.rounds = {"burst": [_fig(85), _fig(90)], "single": [_fig(itl=0.055), _fig(itl=0.06)]}
    vllm = EngineResult("vllm (test)", key="vllm", runs={"burst": _fig(100), "single": _fig(itl=0.05)})
    vllm.rounds = {"burst": [_fig(100), _fig(95)], "single": [_fig(itl=0.05), _fig(itl=0.05)]}
    config = {"section": "smollm2", "runs": ["burst", "single"], "model": "m", "dtype": "float32", "requests": 2}
    config.update(rate=1.0, threads=2, kv_tokens=64, single_prompt=64, single_new=128)
    report = {
        "host": HostInfo("Test CPU", 2, {"avx2": True}),
        "dtype": "float32",
        "repeats": 2,
        "sections": [{"key": "smollm2", "config": config, "results": [shard, vllm], "timings": [("x", 3.0)]}],
        "machine": "test box",
        "elapsed_s": 5.0,
    }
    text = format_report(report)
    assert text.startswith("host: Test CPU, 2 CPUs; ISA: avx2 yes, avx512f no")
    assert re.search(r"burst: tokens/s \(best round\)\s+90\.0\s+100\.0", text)
    assert re.search(
        r"single \(1 request, 64-token prompt, 128 new\): ms/token \(mean ITL\) \(best round\)\s+55\.0", text
    )
    assert re.search(r"  vs vLLM\s+0\.90x\s+1\.00x", text) and re.search(r"  vs vLLM\s+1\.10x\s+1\.00x", text)
    assert "85.0, 90.0" in text and "55.0, 60.0" in text
    assert re.search(r"single request, float32: mean ITL vs vLLM \(lower = faster\)\s+1\.10x\s+<= 1\.0x\s+MISSED", text)
    assert "time: " in text and "(total 5 s)" in text
