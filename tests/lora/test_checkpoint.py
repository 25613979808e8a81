"""PEFT LoRA checkpoints against a tiny llama: per-module rank and scaling exactly as PEFT's own model has
them, every refusal naming the ``LORA_ADAPTERS`` entry, and the offline hub-cache lookup."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.lora_adapters import LLAMA_TARGETS, write_adapter
from tests.helpers.tiny_models import load_reference, write_tiny_model
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.lora.checkpoint import LoraAdapter, adapter_directory, load_adapter, load_adapters
from tgi_paged_backend.lora.sources import AdapterSource

NUM_LAYERS = 3  # the tiny llama's
Q0 = "model.layers.0.self_attn.q_proj"
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("llama", tmp_path_factory.mktemp("lora_base") / "llama")


@pytest.fixture(scope="module")
def base_model(base_dir: Path) -> Any:
    return load_reference(base_dir)


@pytest.fixture(scope="module")
def make_adapter(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[str, Path] = {}

    def make(**kwargs: Any) -> Path:
        key = json.dumps(kwargs, sort_keys=True)
        if key not in made:
            made[key] = write_adapter(base_dir, tmp_path_factory.mktemp("adapter"), **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="module")
def plain_dir(make_adapter: Callable[..., Path]) -> Path:
    return make_adapter(r=4, alpha=8.0)


def load(directory: Path, model: Any, name: str = "tiny", dtype: torch.dtype = torch.float32) -> LoraAdapter:
    return load_adapter(AdapterSource(name, directory), 1, model, dtype)


def assert_like_peft(adapter: LoraAdapter, base_dir: Path) -> None:
    """Every module's rank, scaling and A/B are those of PEFT's own model of the same checkpoint."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(load_reference(base_dir), str(adapter.directory))
    inner = peft_model.base_model.model
    peft_paths = {name for name, module in inner.named_modules() if hasattr(module, "lora_A") and module.lora_A}
    assert set(adapter.modules) == peft_paths
    for path, weights in adapter.modules.items():
        layer = inner.get_submodule(path)
        assert weights.rank == layer.r["default"], path
        assert weights.scaling == pytest.approx(layer.scaling["default"], rel=1e-12), path
        torch.testing.assert_close(weights.a, layer.lora_A["default"].weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(weights.b, layer.lora_B["default"].weight.detach(), rtol=0, atol=0)


def edited_copy(src: Path, dst: Path, *, config: dict[str, Any] | None = None, weights=None) -> Path:
    """A copy of the checkpoint ``src`` with config keys replaced and/or the weight dict edited in place."""
    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((dst / CONFIG).read_text())
        data.update(config)
        (dst / CONFIG).write_text(json.dumps(data))
    if weights is not None:
        tensors = load_file(str(dst / WEIGHTS))
        weights(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / WEIGHTS))
    return dst


def key(module: str, part: str) -> str:
    return f"base_model.model.{module}.lora_{part}.weight"


# ------------------------------------------------------------------------------------------------ scaling
def test_plain_adapter_scaling_is_alpha_over_r(plain_dir: Path, base_model: Any, base_dir: Path) -> None:
    adapter = load(plain_dir, base_model)
    assert len(adapter.modules) == NUM_LAYERS * len(LLAMA_TARGETS)
    assert {w.rank for w in adapter.modules.values()} == {4} and adapter.max_rank == 4
    assert {w.scaling for w in adapter.modules.values()} == {2.0}
    q = adapter.modules[Q0]
    assert q.a.shape == (4, 64) and q.b.shape == (64, 4)
    assert adapter.modules["model.layers.2.mlp.down_proj"].a.shape == (4, 128)
    assert (adapter.name, adapter.index, adapter.directory) == ("tiny", 1, plain_dir)
    assert_like_peft(adapter, base_dir)


def test_weights_are_cast_to_the_model_dtype(plain_dir: Path, base_model: Any) -> None:
    fp32 = load(plain_dir, base_model)
    bf16 = load(plain_dir, base_model, dtype=torch.bfloat16)
    assert all(w.a.dtype == w.b.dtype == torch.bfloat16 for w in bf16.modules.values())
    assert bf16.num_bytes * 2 == fp32.num_bytes
    torch.testing.assert_close(bf16.modules[Q0].a, fp32.modules[Q0].a.to(torch.bfloat16), rtol=0, atol=0)


def test_rslora_scaling_is_alpha_over_sqrt_r(
    make_adapter: Callable[..., Path], base_model: Any, base_dir: Path
) -> None:
    adapter = load(make_adapter(r=4, alpha=6.0, use_rslora=True), base_model)
    assert {w.scaling for w in adapter.modules.values()} == {3.0}
    assert_like_peft(adapter, base_dir)


@pytest.mark.parametrize(
    ("rank_pattern", "alpha_pattern", "expected"),
    [
        (
            {"q_proj": 2},
            {"v_proj": 3.0},
            {Q0: (2, 4.0), "model.layers.1.self_attn.v_proj": (4, 0.75), "model.layers.0.mlp.up_proj": (4, 2.0)},
        ),
        (
            {"layers.1.self_attn.q_proj": 6, "down_proj": 2},
            {"layers.2.mlp.down_proj": 1.0},
            {
                Q0: (4, 2.0),
                "model.layers.1.self_attn.q_proj": (6, 8 / 6),
                "model.layers.0.mlp.down_proj": (2, 4.0),
                "model.layers.2.mlp.down_proj": (2, 0.5),
            },
        ),
        (  # regex keys, as PEFT matches them: `(.*\.)?(<key>)$`
            {"(q|k)_proj": 2},
            {"layers\\.[01]\\..*v_proj": 2.0},
            {
                Q0: (2, 4.0),
                "model.layers.2.self_attn.k_proj": (2, 4.0),
                "model.layers.0.self_attn.v_proj": (4, 0.5),
                "model.layers.2.self_attn.v_proj": (4, 2.0),
            },
        ),
        (  # an alternation: PEFT groups the key, so it applies to every module the alternation names
            {"q_proj|k_proj": 2},
            {},
            {Q0: (2, 4.0), "model.layers.1.self_attn.k_proj": (2, 4.0), "model.layers.1.self_attn.v_proj": (4, 2.0)},
        ),
    ],
    ids=["names", "layer-paths", "regex", "alternation"],
)
def test_rank_and_alpha_patterns_match_like_peft(
    make_adapter: Callable[..., Path],
    base_model: Any,
    base_dir: Path,
    rank_pattern: dict[str, int],
    alpha_pattern: dict[str, float],
    expected: dict[str, tuple[int, float]],
) -> None:
    directory = make_adapter(r=4, alpha=8.0, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    adapter = load(directory, base_model)
    got = {path: (adapter.modules[path].rank, adapter.modules[path].scaling) for path in expected}
    for path, (rank, scaling) in expected.items():
        assert got[path][0] == rank and got[path][1] == pytest.approx(scaling), path
    assert_like_peft(adapter, base_dir)


def test_partial_targets_and_bin_weights(make_adapter: Callable[..., Path], base_model: Any, tmp_path: Path) -> None:
    directory = make_adapter(r=3, alpha=3.0, targets=("q_proj", "v_proj"), seed=5)
    adapter = load(directory, base_model)
    assert sorted(adapter.modules) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in range(NUM_LAYERS) for p in ("q_proj", "v_proj")
    )
    # The same checkpoint as adapter_model.bin reads the same.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(directory / CONFIG, bin_dir / CONFIG)
    torch.save(load_file(str(directory / WEIGHTS)), bin_dir / "adapter_model.bin")
    from_bin = load(bin_dir, base_model)
    assert from_bin.modules.keys() == adapter.modules.keys()
    for path, w in adapter.modules.items():
        assert torch.equal(from_bin.modules[path].a, w.a) and torch.equal(from_bin.modules[path].b, w.b)
        assert from_bin.modules[path].scaling == w.scaling == 1.0


def test_load_adapters_indexes_in_order(plain_dir: Path, make_adapter: Callable[..., Path], base_model: Any) -> None:
    other = make_adapter(r=2, alpha=4.0, targets=("o_proj",), seed=1)
    adapters = load_adapters((AdapterSource("a", plain_dir), AdapterSource("b", other)), base_model, torch.float32)
    assert [(a.name, a.index, a.max_rank) for a in adapters] == [("a", 1, 4), ("b", 2, 2)]
    assert load_adapters((), base_model, torch.float32) == ()


# ---------------------------------------------------------------------------------------------- refusals
def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.pop(name)


def _rename(module: str, new: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        for part in "AB":
            t[key(new, part)] = t.pop(key(module, part))

    return edit


def _set(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = fn(t[name])

    return edit


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[1, 2] = float("nan")
    return t


def _inf(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0, 0] = float("-inf")
    return t


def _add(name: str, shape: tuple[int, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(shape)

    return edit


REFUSALS: dict[str, tuple[dict[str, Any] | None, Any, str]] = {
    # id: (config update, weights edit, what the message says)
    "dora": ({"use_dora": True}, None, "DoRA"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "bias_all": ({"bias": "all"}, None, "bias='all'"),
    "bias_lora_only": ({"bias": "lora_only"}, None, "bias='lora_only'"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
    "peft_type": ({"peft_type": "IA3"}, None, "IA3"),
    "rank_vs_config_r": ({"r": 8}, None, f"module '{'model.layers.0.mlp.down_proj'}'.*rank 4 in the weights, 8"),
    "rank_vs_rank_pattern": ({"rank_pattern": {"v_proj": 2}}, None, r"v_proj'.*rank 4 in the weights, 2"),
    "truncated_b": (None, _set(key(Q0, "B"), lambda t: t[:-1]), re.escape(f"module '{Q0}'") + ".*do not fit"),
    "truncated_a_in": (None, _set(key(Q0, "A"), lambda t: t[:, :-1]), "do not fit"),
    "rank_a_vs_b": (None, _set(key(Q0, "B"), lambda t: t[:, :2]), "do not fit"),
    "absent_target": (None, _rename(Q0, "model.layers.9.self_attn.q_proj"), r"layers\.9.*absent"),
    "norm_target": (None, _rename(Q0, "model.layers.0.input_layernorm"), "input_layernorm.*RMSNorm"),
    "missing_b": (None, _drop(key(Q0, "B")), re.escape(f"module '{Q0}'") + ": has lora_A without its pair"),
    "missing_a": (None, _drop(key(Q0, "A")), "has lora_B without its pair"),
    "nan": (None, _set(key("model.layers.1.mlp.up_proj", "A"), _nan), "up_proj'.*NaN"),
    "inf": (None, _set(key("model.layers.2.self_attn.o_proj", "B"), _inf), "o_proj'.*NaN or infinity"),
    "magnitude_vector": (None, _add(f"base_model.model.{Q0}.lora_magnitude_vector", (64,)), "lora_magnitude_vector"),
    "embedding": (
        None,
        _add("base_model.model.model.embed_tokens.lora_embedding_A", (4, 512)),
        "lora_embedding_A.*not a LoRA A/B",
    ),
    "bias_weight": (None, _add(f"base_model.model.{Q0}.bias", (64,)), "not a LoRA A/B"),
    "no_weights_in_file": (None, lambda t: t.clear(), "holds no LoRA weights"),
    "alpha_nan": ({"lora_alpha": float("nan")}, None, "lora_alpha nan is not finite"),
    "alpha_inf": ({"alpha_pattern": {"q_proj": float("inf")}}, None, r"q_proj'.*lora_alpha inf is not finite"),
    "rank_pattern_list": ({"rank_pattern": ["q_proj"]}, None, "rank_pattern in adapter_config.json is not an object"),
    "pattern_not_a_regex": ({"rank_pattern": {"(q_proj": 4}}, None, "not a regular expression"),
    "pattern_too_long": ({"alpha_pattern": {"q" * 600: 8}}, None, "at most 512 chars"),
    # Catastrophic backtracking on every module name: refused within the time limit instead of hanging.
    "pattern_too_slow": ({"rank_pattern": {r"(\S|\S)*\s": 4}}, None, "takes more than 0.1 s"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_entry(case: str, plain_dir: Path, base_model: Any, tmp_path: Path) -> None:
    config, weights, reason = REFUSALS[case]
    directory = edited_copy(plain_dir, tmp_path / case, config=config, weights=weights)
    source = AdapterSource("bad", directory)
    with pytest.raises(ConfigError, match=re.escape(f"LORA_ADAPTERS entry '{source}'")) as info:
        load_adapter(source, 1, base_model, torch.float32)
    assert re.search(reason, str(info.value)), str(info.value)


@pytest.mark.parametrize("missing", [CONFIG, WEIGHTS])
def test_missing_files_are_refused(missing: str, plain_dir: Path, base_model: Any, tmp_path: Path) -> None:
    directory = edited_copy(plain_dir, tmp_path / "adapter")
    (directory / missing).unlink()
    source = AdapterSource("bad", directory)
    with pytest.raises(ConfigError, match=re.escape(f"'{source}'") + ".*" + re.escape(missing)):
        load_adapter(source, 1, base_model, torch.float32)


def test_a_path_that_is_no_directory_is_refused(tmp_path: Path, base_model: Any) -> None:
    source = AdapterSource("gone", tmp_path / "nothing")
    with pytest.raises(ConfigError, match=re.escape(f"'{source}'") + ".*not a directory"):
        load_adapter(source, 1, base_model, torch.float32)


# ---------------------------------------------------------------------------------------------- hub cache
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, plain_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local hub cache holding ``org/tiny-lora`` at ``main`` and the tag ``v1`` (the same snapshot)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-lora"
    shutil.copytree(plain_dir, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    (repo / "refs" / "v1").write_text(SHA)
    # snapshot_download reads the module constant at call time (set from HF_HUB_CACHE at import).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no relative directory named like the repo
    return repo / "snapshots" / SHA


@pytest.mark.parametrize("revision", [None, "main", "v1", SHA])
def test_hub_adapter_is_found_in_the_local_cache(hub_cache: Path, revision: str | None) -> None:
    found = adapter_directory(AdapterSource("org/tiny-lora", None, revision))
    assert found.resolve() == hub_cache.resolve()


def test_hub_adapter_loads_from_the_cache(hub_cache: Path, base_model: Any) -> None:
    adapter = load_adapter(AdapterSource("org/tiny-lora"), 2, base_model, torch.float32)
    assert (adapter.name, adapter.index) == ("org/tiny-lora", 2)
    assert adapter.directory.resolve() == hub_cache.resolve()
    assert len(adapter.modules) == NUM_LAYERS * len(LLAMA_TARGETS)


@pytest.mark.parametrize(
    "source",
    [AdapterSource("org/not-cached"), AdapterSource("org/tiny-lora", None, "v2"), AdapterSource("other/x", None, SHA)],
    ids=str,
)
def test_hub_adapter_not_in_the_cache_is_refused(hub_cache: Path, source: AdapterSource) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"LORA_ADAPTERS entry '{source}'") + ".*local hub cache"):
        adapter_directory(source)


def test_a_bare_local_directory_name_is_used_as_is(plain_dir: Path) -> None:
    assert adapter_directory(AdapterSource(str(plain_dir))) == plain_dir


def test_lm_head_targets_are_refused(tmp_path) -> None:
    """The LM head sees only the rows whose logits are kept, not every packed token: refused, never wrong."""
    from tests.helpers.lora_adapters import write_adapter
    from tests.helpers.tiny_models import load_reference, write_tiny_model
    from tgi_paged_backend.config import ConfigError
    from tgi_paged_backend.lora.checkpoint import load_adapter
    from tgi_paged_backend.lora.sources import AdapterSource

    base = write_tiny_model("llama", tmp_path / "base")
    adapter = write_adapter(base, tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(ConfigError, match="LM head|lm_head"):  # PEFT may also save the tied head itself
        load_adapter(AdapterSource("head", adapter), 1, load_reference(base), torch.float32)


def test_moe_expert_targets_and_rank_zero_are_refused(tmp_path) -> None:
    """Experts see only the tokens routed to them (deltas would land on the wrong rows): refused at load."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.helpers.lora_adapters import write_adapter
    from tests.helpers.tiny_models import load_reference, write_tiny_model
    from tgi_paged_backend.config import ConfigError
    from tgi_paged_backend.lora.checkpoint import load_adapter
    from tgi_paged_backend.lora.sources import AdapterSource

    base = write_tiny_model("llama", tmp_path / "base")
    model = load_reference(base)
    model.model.layers[0].mlp.experts = torch.nn.ModuleList([torch.nn.Linear(64, 64)])  # an expert-like path
    adapter = write_adapter(base, tmp_path / "a", targets=("q_proj",))
    weights = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.0"
    weights[f"{key}.lora_A.weight"] = torch.zeros(4, 64)
    weights[f"{key}.lora_B.weight"] = torch.zeros(64, 4)
    save_file(weights, adapter / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="MoE experts"):
        load_adapter(AdapterSource("a", adapter), 1, model, torch.float32)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["lora_alpha"] = None
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    del weights[f"{key}.lora_A.weight"], weights[f"{key}.lora_B.weight"]
    save_file(weights, adapter / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="lora_alpha"):
        load_adapter(AdapterSource("a", adapter), 1, model, torch.float32)


def test_a_rank_above_the_limit_is_refused(plain_dir: Path, base_model: Any) -> None:
    source = AdapterSource("big", plain_dir)
    assert load_adapter(source, 1, base_model, torch.float32, max_rank=4).max_rank == 4
    with pytest.raises(ConfigError, match=r"'big.*rank 4 is above TGI_PAGED_MAX_LORA_RANK=3"):
        load_adapter(source, 1, base_model, torch.float32, max_rank=3)


@pytest.mark.parametrize("text", ["[1, 2]", '"q_proj"', "{not json"])
def test_a_config_that_is_no_json_object_is_refused(
    text: str, plain_dir: Path, base_model: Any, tmp_path: Path
) -> None:
    directory = edited_copy(plain_dir, tmp_path / "adapter")
    (directory / CONFIG).write_text(text)
    with pytest.raises(ConfigError, match=r"LORA_ADAPTERS entry 'bad.*adapter_config.json (holds a|is not JSON)"):
        load_adapter(AdapterSource("bad", directory), 1, base_model, torch.float32)


@pytest.mark.parametrize("payload", [[torch.zeros(2)], {"w": [1, 2]}])
def test_bin_weights_that_are_no_tensor_mapping_are_refused(
    payload: Any, plain_dir: Path, base_model: Any, tmp_path: Path
) -> None:
    directory = edited_copy(plain_dir, tmp_path / "adapter")
    (directory / WEIGHTS).unlink()
    torch.save(payload, directory / "adapter_model.bin")
    with pytest.raises(ConfigError, match=r"LORA_ADAPTERS entry 'bad.*adapter_model.bin holds a"):
        load_adapter(AdapterSource("bad", directory), 1, base_model, torch.float32)
