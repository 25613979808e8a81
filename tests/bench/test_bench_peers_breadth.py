"""Issue 39's breadth report in the peer harness (``integration/peers``; report-only, no engine runs here).

- ``hostbound_forms``: each layer form builds the family it names at the host-bound shape, with SmolLM2's
  vocabulary, and the form shows in the layer (q/k norms, sandwich norms and windows, experts);
- ``plan``: ``--hostbound-forms`` and ``--models`` become sections (the Llama form keeps the ``hostbound`` key the
  issue-21 goals read);
- ``report``: the breadth table has one row per model and dtype with this shard's ratio to vLLM;
- ``prefill``: one request at a time per prompt length (vLLM's worker never holds two), the table splits this
  shard's TTFT into its prefill steps and the rest; issue 39's goals judge forms, bf16 and TTFT.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from integration.peers import vllm_worker
from integration.peers.breadth_goals import issue39_goals
from integration.peers.host import HostInfo
from integration.peers.hostbound import HostBoundSpec, config_dict
from integration.peers.hostbound_forms import FORMS, GEMMA3_WINDOW, MIXTRAL_EXPERTS, build_model
from integration.peers.jobs import PREFILL_LENGTHS, EngineResult, RunFigures, prefill_trace
from integration.peers.plan import sections
from integration.peers.report import breadth_table, prefill_table
from tgi_paged_backend.planning.report import table

SOURCE = {"vocab_size": 512, "eos_token_id": 2, "bos_token_id": 1, "rope_theta": 1e5, "tie_word_embeddings": True}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_builds_its_family_at_the_hostbound_shape(form: str) -> None:
    spec = HostBoundSpec(num_hidden_layers=6, form=form)
    config = config_dict(SOURCE, spec)
    assert config["vocab_size"] == 512 and config["eos_token_id"] == 2
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(form, config)
    assert type(model).__name__ == config["architectures"][0]
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 6
    layer = model.model.layers[0]
    attn = layer.self_attn
    assert hasattr(attn, "q_norm") == (form in ("qwen3", "gemma3"))
    if form == "gemma3":
        assert hasattr(layer, "post_feedforward_layernorm")
        assert model.config.sliding_window == GEMMA3_WINDOW
        assert model.config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    if form == "mixtral":
        assert model.config.num_local_experts == MIXTRAL_EXPERTS and model.config.num_experts_per_tok == 2
    assert ("rope_theta" in config) == (form != "gemma3")  # Gemma 3 keeps its own two RoPE bases
    names = {HostBoundSpec(form=f).name for f in FORMS}
    assert len(names) == len(FORMS) and HostBoundSpec().name.startswith("hostbound-llama-")


def test_unknown_form_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown host-bound form"):
        config_dict(SOURCE, HostBoundSpec(form="bloom"))


def test_forms_and_models_become_sections() -> None:
    got = sections(["burst", "hostbound"], ("llama", "qwen3", "llama"), ["/m/a-model"])
    assert [s.key for s in got] == ["smollm2", "hostbound", "hostbound-qwen3", "model:a-model"]
    assert [s.form for s in got] == ["", "llama", "qwen3", ""]
    assert got[-1].model_dir == "/m/a-model" and got[-1].runs == ("burst",)
    assert [s.key for s in sections(["burst"], ("qwen3",))] == ["smollm2"]  # no hostbound scenario: no forms


def _fig(tokens_per_s: float, matched: int | None = None) -> RunFigures:
    return RunFigures(tokens_per_s, 0.1, 0.2, 0.05, 0.05, 1.0, 0.05, matched=matched, compared=4)


def _section(key: str, dtype: str, ours: float, theirs: float | None) -> dict:
    results = [EngineResult("this shard", key="shard", runs={"burst": _fig(ours, 4)})]
    if theirs is None:
        results.append(EngineResult("vLLM CPU build", key="vllm", skipped="no peer venv"))
    else:
        results.append(EngineResult("vLLM CPU build", key="vllm", runs={"burst": _fig(theirs)}))
    return {"key": key, "config": {"runs": ["burst"], "dtype": dtype, "model": key}, "results": results}


def test_breadth_table_has_a_row_per_model_and_dtype_with_the_ratio() -> None:
    reports = [
        {"dtype": dt, "sections": [_section("hostbound", dt, 300.0, 200.0), _section("hostbound-qwen3", dt, 150, None)]}
        for dt in ("float32", "bfloat16")
    ]
    text = breadth_table(reports)
    rows = [line for line in text.splitlines() if "host-bound" in line]
    assert len(rows) == 4
    llama_fp32 = next(r for r in rows if "qwen3" not in r and "float32" in r)
    assert "1.50x" in llama_fp32 and "4/4 identical" in llama_fp32
    qwen_bf16 = next(r for r in rows if "qwen3" in r and "bfloat16" in r)
    assert "n/a" in qwen_bf16 and "vLLM CPU build" in qwen_bf16  # vLLM skipped: no ratio, says which


def test_breadth_table_of_a_run_without_a_burst_says_so() -> None:
    prefill_only = {"key": "prefill", "config": {"runs": ["prefill"], "dtype": "float32"}, "results": []}
    assert "no burst run" in breadth_table([{"dtype": "float32", "sections": [prefill_only]}])
    assert table(["a", "b"], []).splitlines()[0].split() == ["a", "b"]  # headers only


def test_prefill_run_is_its_own_section_of_one_request_per_length() -> None:
    assert [s.key for s in sections(["prefill", "burst"])] == ["smollm2", "prefill"]
    trace = prefill_trace()
    assert [t.prompt_tokens for t in trace] == list(PREFILL_LENGTHS) and {t.output_tokens for t in trace} == {1}


class _FakeEngine:
    """vLLM's engine as ``vllm_worker.serve`` drives it: a request finishes two steps after it was added."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.most_live = 0

    def add_request(self, request_id: str, prompt: dict, params: object) -> None:
        self.live[request_id] = 0
        self.most_live = max(self.most_live, len(self.live))

    def step(self) -> list:
        out = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] == 2
            out.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=[7])]))
            if done:
                del self.live[rid]
        return out


def test_vllm_worker_serves_a_sequential_run_one_request_at_a_time() -> None:
    requests = [{"prompt_ids": [1, 2], "output_tokens": 1, "arrival": 0.0} for _ in range(3)]
    engine = _FakeEngine()
    results = vllm_worker.serve(engine, lambda **kw: kw, requests, sequential=True)
    assert engine.most_live == 1 and all(r["tokens"] == [7] for r in results)
    arrivals = [r["arrival"] for r in results]
    assert arrivals == sorted(arrivals) and all(r["token_times"][0] >= r["arrival"] for r in results)
    engine = _FakeEngine()
    vllm_worker.serve(engine, lambda **kw: kw, requests)
    assert engine.most_live == 3  # arrivals honoured: all at once


def _prefill_section(ours: list[float], server: list[float], theirs: list[float]) -> dict:
    shard = EngineResult("this shard", key="shard", runs={"prefill": _fig(1.0)})
    shard.runs["prefill"].ttft_each_s, shard.runs["prefill"].server_each_s = ours, server
    vllm = EngineResult("vLLM CPU build", key="vllm", runs={"prefill": _fig(1.0)})
    vllm.runs["prefill"].ttft_each_s = theirs
    config = {"runs": ["prefill"], "dtype": "float32", "prefill_prompts": [130, 2050]}
    return {"key": "prefill", "config": config, "results": [shard, vllm]}


def test_prefill_table_splits_the_shards_ttft_into_its_steps_and_the_rest() -> None:
    section = _prefill_section([0.2, 2.0], [0.15, 1.9], [0.1, 2.5])
    text = prefill_table(section["results"], section["config"])
    short = next(line for line in text.splitlines() if line.strip().startswith("130"))
    assert "200" in short and "100" in short and "2.00x" in short and "150" in short and " 50" in short
    long = next(line for line in text.splitlines() if line.strip().startswith("2050"))
    assert "0.80x" in long


def test_issue39_goals_judge_forms_bf16_and_ttft() -> None:
    fp32 = {
        "dtype": "float32",
        "host": HostInfo("Test CPU", 2, {"avx512_bf16": True}),
        "sections": [_section("hostbound", "float32", 300.0, 200.0), _section("hostbound-qwen3", "float32", 110, 100)],
    }
    fp32["sections"].append(_prefill_section([0.2, 2.0], [0.15, 1.9], [0.25, 2.5]))
    bf16 = {"dtype": "bfloat16", "sections": [_section("smollm2", "bfloat16", 130.0, 100.0)]}
    goals = {g.figure: g for g in issue39_goals([fp32, bf16])}
    llama = goals["host-bound llama burst, float32, vs vLLM"]
    assert llama.measured == pytest.approx(1.5) and llama.met and llama.floor_held
    qwen = goals["host-bound qwen3 burst, float32, vs vLLM"]
    assert not qwen.met and not qwen.floor_held  # 1.1x: under the 1.2x floor
    assert goals["host-bound gemma3 burst, float32, vs vLLM"].measured is None
    assert "not run" in goals["host-bound gemma3 burst, float32, vs vLLM"].note
    assert goals["SmolLM2 burst, bfloat16, vs vLLM"].met  # 1.3x on a host with AVX512-BF16
    ttft = goals["TTFT, 128-token prompt, vs vLLM (lower = faster)"]
    assert ttft.measured == pytest.approx(0.8) and ttft.met
