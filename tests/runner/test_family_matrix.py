"""The family matrix in the suite: every family of issue 15 that this transformers has is either
served token-exact against HF ``generate`` or refused at start with a message naming its
architecture (``tests/helpers/family_matrix.py`` has the scenarios; ``docs/models.md`` is its
table, checked against the matrix here). A few families also run with the Triton kernels
(interpreted) in place of the CPU attention paths. Sliding-window block reclaim is on exactly for the
families whose every layer's attention call carries the window (checked against the modeling code).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers.family_matrix import NATIVE_DECODE, REFUSED, SCENARIOS, cpu_decode_mark, run_scenario, start_error
from tests.helpers.family_models import FAMILIES, FAMILY_BY_NAME, family_config, is_available, write_family_model
from tests.helpers.triton_serving import LAUNCHERS, route_to_triton
from tests.helpers.vlm_families import VLM_FAMILIES
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.memory.window_reclaim import reclaim_window
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_kernels.cpu_native import native_kernels

ROOT = Path(__file__).resolve().parents[2]
AVAILABLE = [f.name for f in FAMILIES if is_available(f)]
SERVED = [name for name in AVAILABLE if name not in REFUSED]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is faster than two contending."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_family_model(FAMILY_BY_NAME[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get


def test_every_issue_family_is_in_the_matrix():
    names = {f.name for f in FAMILIES}
    issue = {
        "Llama",
        "Llama-3.1",
        "Mistral",
        "Mixtral",
        "Qwen2",
        "Qwen2-MoE",
        "Qwen3",
        "Qwen3-MoE",
        "Gemma",
        "Gemma2",
        "Gemma3",
        "Phi",
        "Phi3",
        "Granite",
        "Cohere",
        "StarCoder2",
        "GPT-BigCode",
        "GPT-NeoX",
        "GPT-J",
        "Falcon",
        "OPT",
        "GPT-2",
        "OLMo2",
        "gpt-oss",
    }
    assert issue <= names
    assert set(REFUSED) <= names


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", SERVED)
def test_served_family_is_token_exact(name, scenario, family_dir):
    outcome = run_scenario(family_dir(name), scenario)
    assert outcome.premise, f"{scenario} did not happen as meant (no chunking / no preemption)"
    assert outcome.got == outcome.want
    assert outcome.reclaim_window == _spec(name).reclaim_window
    if outcome.reclaim_window is not None and scenario.startswith("preempt"):
        assert outcome.num_reclaimed_blocks > 0  # ~20-token histories under a window of 8
    if scenario == "mixed_batch":  # the reference is not degenerate: distinct, varied generations
        assert len({tuple(t) for t in outcome.want.values()}) == len(outcome.want)
        assert len({t for tokens in outcome.want.values() for t in tokens}) >= 3


@pytest.mark.parametrize("name", [n for n in AVAILABLE if n in REFUSED])
def test_refused_family_stops_at_start_naming_the_architecture(name, family_dir):
    error = start_error(family_dir(name))
    architecture = type(transformers.AutoModelForCausalLM.from_config(family_config(FAMILY_BY_NAME[name]))).__name__
    assert error is not None and architecture in error and REFUSED[name] in error, error
    assert "TGI_BACKEND=stock" in error


def test_models_doc_agrees_with_the_matrix(family_dir):
    rows = {}
    text = (ROOT / "docs" / "models.md").read_text()
    for line in text.split("## ")[0].splitlines():  # the family table, before the figures' sections
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 9 and cells[0] not in ("family", "---"):
            rows[cells[0]] = cells
    vlm_phrases = {v.name: v.phrase for v in VLM_FAMILIES if not v.served}
    served_vlms = {v.name for v in VLM_FAMILIES if v.served}
    assert set(rows) == {f.name for f in FAMILIES} | set(vlm_phrases) | served_vlms
    native = native_kernels() is not None  # the doc is written where the C++ kernels build
    for name, cells in rows.items():
        if name in vlm_phrases:  # every VLM stock TGI serves: refused at start with its own reason (issue 40)
            assert cells[2] == "refused" and re.search(r"Refused at start:.*" + re.escape(vlm_phrases[name]), cells[8])
        elif name in served_vlms:  # its image scenarios (tests/engine/test_shard_engine_llava_next.py)
            assert cells[2:6] == ["yes", "yes", "yes", "yes"], cells  # TP=2: tests/helpers/vlm_tp.py
        elif name in REFUSED:
            assert cells[2] == "refused" and re.search(r"Refused at start:.*" + re.escape(REFUSED[name]), cells[8])
            assert cells[7] == "n/a", cells
        elif name in AVAILABLE:
            # the CPU decode step, as a runner of the same tiny model reports it now (well under a second each)
            runner = ModelRunner(ModelConfig(model_id=str(family_dir(name))), CacheConfig(block_size=4), "cpu")
            if native and runner.dtype == torch.float32:
                assert cells[7] == cpu_decode_mark(runner), (name, cells)
            else:
                assert cells[7] == NATIVE_DECODE or cells[7].startswith("per-op: "), cells
            assert cells[2:5] == ["yes", "yes", "yes"], cells  # single shard, preemption, speculation
            if _spec(name).reclaim_window is not None:
                assert cells[6].startswith("yes: "), cells
            elif _spec(name).kv_groups.is_hybrid:  # sliding beside full layers: one page map per group
                assert cells[6].startswith("yes: ") and "KV layer groups" in cells[6], cells
            elif _spec(name).sliding_window is not None:
                assert cells[6].startswith("0 ("), cells
            else:
                assert cells[6] == "n/a (no window)", cells
    assert (ROOT / "README.md").read_text().count("docs/models.md") >= 1


@pytest.mark.parametrize("name", ["Gemma2", "GPT-BigCode", "gpt-oss", "Bloom", "MPT", "DeepSeek-V3"])
def test_triton_kernels_inside_the_model(name, family_dir, monkeypatch):
    # The code path that serves on CUDA, run end to end in the model under TRITON_INTERPRET=1 (set
    # by the root conftest): store, prefill and decode through the Triton launchers instead of the
    # CPU paths. Soft-capping + alternating windows; MQA; sinks + alternating windows (and GQA); ALiBi; the MLA
    # latent (key-only store, a value view narrower than the key).
    calls = route_to_triton(monkeypatch)
    outcome = run_scenario(family_dir(name), "mixed_batch")
    assert set(LAUNCHERS) <= set(calls)
    assert outcome.premise and outcome.got == outcome.want


def _spec(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(family_config(FAMILY_BY_NAME[name]), torch.float32)


def _layer_windows(config) -> list[int | None]:
    """The ``sliding_window`` each layer's attention call passes, from a one-token forward through a
    recording attention function (the modeling code's own word, not the config's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    seen: dict[int, int | None] = {}

    def record(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
        seen[int(module.layer_idx)] = int(sliding_window) if sliding_window else None
        return query.new_zeros((query.shape[0], query.shape[2], query.shape[1], value.shape[-1])), None

    AttentionInterface.register("record_window", record)
    AttentionMaskInterface.register("record_window", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="record_window")
    token = torch.zeros((1, 1), dtype=torch.int64)
    with torch.no_grad():
        model(input_ids=token, position_ids=token, use_cache=False)
    return [seen[i] for i in sorted(seen)]


@pytest.mark.parametrize("name", [n for n in SERVED if FAMILY_BY_NAME[n].overrides.get("sliding_window")])
def test_reclaim_window_agrees_with_what_every_layer_passes(name):
    # Reclaim gives blocks back behind the window: it must be on only if every layer really uses that
    # window (else a full layer would read holes), and on wherever it can be (else memory is lost).
    config = family_config(FAMILY_BY_NAME[name])
    windows = _layer_windows(config)
    assert len(windows) == config.num_hidden_layers
    spec = _spec(name)
    assert spec.reclaim_window == reclaim_window(spec.sliding_window, windows), windows
    # the layer groups (memory.layer_groups) read each layer's window from the config: the modeling
    # code must agree, or a group would keep too little (a full layer grouped as sliding)
    assert spec.layer_windows == tuple(windows), windows
