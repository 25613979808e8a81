"""envs.py validation and config dataclass conventions."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields

import pytest

from tgi_paged_backend import config as config_module
from tgi_paged_backend.config import CacheConfig, ConfigError, PreemptionConfig
from tgi_paged_backend.envs import build_config, read_env


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("TGI_PAGED_BLOCK_SIZE", "12", "1, 2, 4, 8, 16, 32"),
        ("TGI_PAGED_OVERCOMMIT", "0.5", ">= 1.0"),
        ("TGI_PAGED_MEMORY_FRACTION", "1.7", "(0, 1]"),
        ("TGI_PAGED_PREEMPTION", "sometimes", "auto, recompute, swap"),
        ("TGI_PAGED_NUM_BLOCKS", "many", ">= 2"),
        ("TGI_PAGED_WATERMARK", "-0.1", "[0, 1)"),
        ("TGI_BACKEND", "vllm", "paged or stock"),
        ("CUDA_MEMORY_FRACTION", "0", "(0, 1]"),
        ("CUDA_MEMORY_FRACTION", "1.5", "(0, 1]"),
        ("MAX_BATCH_SIZE", "-1", "an integer >= 0"),
        ("MAX_TOTAL_TOKENS", "4k", "an integer >= 0"),
        ("ROPE_SCALING", "yarn", "linear, dynamic"),
    ],
)
def test_bad_env_value_names_variable_value_and_allowed(name: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        read_env({name: value})
    message = str(err.value)
    assert name in message and repr(value) in message and allowed in message


def test_defaults_and_launcher_variables() -> None:
    env = {
        "PREFIX_CACHING": "true",
        "CUDA_MEMORY_FRACTION": "0.5",
        "MAX_BATCH_SIZE": "8",
        "TGI_PAGED_BLOCK_SIZE": "32",
        "TGI_PAGED_PREEMPTION": "SWAP",
        "REQUEST_LOGPROBS": "1",
    }
    cfg = build_config({"model_id": "/m", "uds_path": "/tmp/s", "logger_level": "WARN"}, env)
    assert cfg.cache.block_size == 32
    assert cfg.cache.prefix_caching is True
    assert cfg.cache.memory_fraction == pytest.approx(0.45)
    assert cfg.preemption.mode == "swap"
    assert cfg.server.logger_level == "WARNING"
    assert cfg.server.max_batch_size == 8 and cfg.server.request_logprobs is True
    assert cfg.server.socket_path == "/tmp/s-0"


@pytest.mark.parametrize(
    ("value", "enabled"),
    [
        (None, False),
        ("1", True),
        ("true", True),
        ("True", True),
        ("TRUE", True),
        ("0", False),
        ("false", False),
        ("yes", False),
        ("on", False),
        (" 1", False),
        ("maybe", False),
        ("", False),
    ],
)
def test_prefix_caching_and_request_logprobs_parse_as_stock(value: str | None, enabled: bool) -> None:
    """Stock ``models/globals.py``: ``value.lower() in {"1", "true"}``; nothing else enables, nothing fails."""
    env = {} if value is None else {"PREFIX_CACHING": value, "REQUEST_LOGPROBS": value}
    cfg = build_config({"model_id": "/m"}, env)
    assert cfg.cache.prefix_caching is enabled and cfg.server.request_logprobs is enabled


def test_cuda_memory_fraction_as_the_launcher_prints_it() -> None:
    """The launcher writes its f32 with Rust's Display: 1.0 -> ``1``, 0.85 -> ``0.85``."""
    assert build_config({"model_id": "/m"}, {"CUDA_MEMORY_FRACTION": "1"}).cache.cuda_memory_fraction == 1.0
    cfg = build_config({"model_id": "/m"}, {"CUDA_MEMORY_FRACTION": "0.85", "TGI_PAGED_MEMORY_FRACTION": "0.9"})
    assert cfg.cache.cuda_memory_fraction == 0.85 and cfg.cache.memory_fraction == pytest.approx(0.765)


@pytest.mark.parametrize("value", ["0", "1", "18446744073709551615"])
def test_max_batch_size_and_max_total_tokens_take_the_launchers_usize_range(value: str) -> None:
    cfg = build_config({"model_id": "/m"}, {"MAX_BATCH_SIZE": value, "MAX_TOTAL_TOKENS": value})
    assert cfg.server.max_batch_size == cfg.server.max_total_tokens == int(value)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (None, 1.0)),
        ({"ROPE_SCALING": "linear", "ROPE_FACTOR": "2"}, ("linear", 2.0)),
        ({"ROPE_SCALING": "dynamic", "ROPE_FACTOR": "1.5"}, ("dynamic", 1.5)),
        ({"ROPE_SCALING": "dynamic"}, ("dynamic", 1.0)),  # the launcher's rule for --rope-scaling alone
        ({"ROPE_FACTOR": "8"}, (None, 1.0)),  # stock reads ROPE_FACTOR only with ROPE_SCALING
    ],
)
def test_rope_scaling_and_factor(env: dict[str, str], expected: tuple) -> None:
    model = build_config({"model_id": "/m"}, env).model
    assert (model.rope_scaling, model.rope_factor) == expected


@pytest.mark.parametrize("factor", ["0", "-2", "inf", "two"])
def test_bad_rope_factor_names_the_variable(factor: str) -> None:
    with pytest.raises(ConfigError, match=f"ROPE_FACTOR={factor!r} is invalid: allowed a finite number > 0"):
        read_env({"ROPE_SCALING": "linear", "ROPE_FACTOR": factor})


def test_lora_adapters_and_weights_cache_override_reach_the_model_config() -> None:
    assert build_config({"model_id": "/m"}, {"LORA_ADAPTERS": ""}).model.lora_adapters is None  # stock: none
    model = build_config(
        {"model_id": "org/m"}, {"LORA_ADAPTERS": "org/a,b=/p@v2", "WEIGHTS_CACHE_OVERRIDE": "/repository"}
    ).model
    assert model.lora_adapters == "org/a,b=/p@v2" and model.weights_cache_override == "/repository"
    assert build_config({"model_id": "/m", "lora_adapters": "x"}, {}).model.lora_adapters == "x"


@pytest.mark.parametrize("value", ["0", "3", "7", "64"])
def test_block_sizes_outside_the_allowed_set_are_rejected(value: str) -> None:
    # Powers of two from 1 (stock TGI's flashinfer pages) to 32 only; 3 and 7 are not powers of two.
    with pytest.raises(ConfigError, match="TGI_PAGED_BLOCK_SIZE"):
        read_env({"TGI_PAGED_BLOCK_SIZE": value})
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=int(value))


@pytest.mark.parametrize("value", [1, 2, 4, 8, 16, 32])
def test_every_allowed_block_size_is_accepted(value: int) -> None:
    cfg = build_config({"model_id": "/m"}, {"TGI_PAGED_BLOCK_SIZE": str(value)})
    assert cfg.cache.block_size == value
    assert CacheConfig(block_size=value).block_size == value


def test_sharded_requires_world_size() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        build_config({"model_id": "/m", "sharded": True}, {})


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=12)
    with pytest.raises(ConfigError, match="mode"):
        PreemptionConfig(mode="later")  # type: ignore[arg-type]


def test_every_config_field_has_an_attribute_docstring() -> None:
    tree = ast.parse(inspect.getsource(config_module))
    documented: dict[str, set[str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        names: set[str] = set()
        body = node.body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                names.add(stmt.target.id)  # type: ignore[union-attr]
        documented[node.name] = names
    for cls_name in (
        "CacheConfig",
        "PreemptionConfig",
        "ModelConfig",
        "ServerConfig",
        "TelemetryConfig",
        "BackendConfig",
    ):
        cls = getattr(config_module, cls_name)
        missing = {f.name for f in fields(cls)} - documented[cls_name]
        assert not missing, f"{cls_name} fields without docstring: {missing}"


@pytest.mark.parametrize(
    ("raw", "expected"), [(None, "native"), ("native", "native"), ("compiled", "compiled"), ("sdpa", "sdpa")]
)
def test_cpu_decode_kernel_is_read_from_the_environment(raw, expected) -> None:
    env = {} if raw is None else {"TGI_PAGED_CPU_DECODE": raw}
    assert build_config({"model_id": "m"}, env).model.cpu_decode == expected


def test_a_bad_cpu_decode_kernel_names_the_variable_and_the_choices() -> None:
    with pytest.raises(
        ConfigError, match=r"TGI_PAGED_CPU_DECODE='flash' is invalid: allowed native or compiled or sdpa"
    ):
        read_env({"TGI_PAGED_CPU_DECODE": "flash"})
