"""Issue 39's breadth report in the peer harness (``integration/peers``; report-only, no engine runs here).

- ``hostbound_forms``: each layer form builds the family it names at the host-bound shape, with SmolLM2's
  vocabulary, and the form shows in the layer (q/k norms, sandwich norms and windows, experts);
- ``plan``: ``--hostbound-forms`` and ``--models`` become sections (the Llama form keeps the ``hostbound`` key the
  issue-21 goals read);
- ``report``: the breadth table has one row per model and dtype with this shard's ratio to vLLM.
"""

from __future__ import annotations

import pytest
import torch

from integration.peers.hostbound import HostBoundSpec, config_dict
from integration.peers.hostbound_forms import FORMS, GEMMA3_WINDOW, MIXTRAL_EXPERTS, build_model
from integration.peers.jobs import EngineResult, RunFigures
from integration.peers.plan import sections
from integration.peers.report import breadth_table

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
