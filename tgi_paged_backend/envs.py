"""The only module that reads the process environment.

Each knob has one parser entry below (name, default, meaning). :func:`read_env` turns a mapping
(``os.environ`` by default) into a typed :class:`EnvSettings`, failing with a :class:`ConfigError`
that names the variable, its value and what is allowed. :func:`build_config` merges those settings
with the CLI arguments into the frozen :class:`~tgi_paged_backend.config.BackendConfig`.
Nothing is read at import time.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tgi_paged_backend.config import (
    BLOCK_SIZES,
    CPU_DECODE_KERNELS,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_OVERCOMMIT,
    PREEMPTION_MODES,
    ROPE_SCALINGS,
    BackendConfig,
    CacheConfig,
    ConfigError,
    ModelConfig,
    PreemptionConfig,
    ServerConfig,
    TelemetryConfig,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvSettings:
    """Typed values of every environment variable the backend honours."""

    backend: str
    block_size: int
    memory_fraction: float
    cuda_memory_fraction: float
    num_blocks: int | None
    overcommit: float
    preemption: str
    swap_space_gb: float
    host_cache_gb: float | None
    disk_cache_dir: str | None
    disk_cache_gb: float
    watermark: float
    metrics_port: int | None
    metrics_host: str
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    kv_events_topic: str | None
    prefix_caching: bool
    layer_groups: bool
    max_batch_size: int | None
    max_total_tokens: int | None
    request_logprobs: bool
    weights_cache_override: str | None
    rope_scaling: str | None
    rope_factor: float
    cuda_graphs: tuple[int, ...]
    compile_decode: bool
    cpu_decode: str
    native_layers: bool
    max_images_per_request: int
    speculate_max_batch: int | None
    lora_adapters: str | None
    max_lora_rank: int
    max_loras: int | None
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    dist_timeout_s: float


def _fail(name: str, raw: str, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={raw!r} is invalid: allowed {allowed}")


def _parse(
    env: Mapping[str, str],
    name: str,
    default: T,
    convert: Callable[[str], T],
    allowed: str,
    ok: Callable[[T], bool] = lambda _: True,
) -> T:
    value = _parse_optional(env, name, convert, allowed, ok)
    return default if value is None else value


def _parse_optional(
    env: Mapping[str, str],
    name: str,
    convert: Callable[[str], T],
    allowed: str,
    ok: Callable[[T], bool] = lambda _: True,
) -> T | None:
    """``name`` converted and checked, or ``None`` when it is unset or blank."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = convert(raw.strip())
    except (TypeError, ValueError):
        raise _fail(name, raw, allowed) from None
    if not ok(value):
        raise _fail(name, raw, allowed)
    return value


def _stock_flag(env: Mapping[str, str], name: str) -> bool:
    """A flag parsed as the stock server parses ``PREFIX_CACHING`` and ``REQUEST_LOGPROBS``
    (``models/globals.py``): ``1`` or ``true`` in any case, nothing else (no stripping), enables it;
    any other value, or none, disables it. Never an error."""
    return env.get(name, "0").lower() in ("1", "true")


BACKENDS: tuple[str, ...] = ("paged", "stock")
"""``TGI_BACKEND`` / the launcher wrapper's ``--backend``: this package or TGI's own server."""


def parse_backend(raw: str, name: str = "TGI_BACKEND") -> str:
    """``paged`` or ``stock`` (any case, surrounding blanks ignored); ``name`` is what the error names."""
    value = raw.strip().lower()
    if value not in BACKENDS:
        raise _fail(name, raw, " or ".join(BACKENDS))
    return value


def read_backend(env: Mapping[str, str] | None = None) -> str:
    """``TGI_BACKEND`` alone (the launcher wrapper needs nothing else); unset or empty is ``paged``."""
    e = os.environ if env is None else env
    raw = e.get("TGI_BACKEND")
    return "paged" if raw is None or raw.strip() == "" else parse_backend(raw)


def _rope(env: Mapping[str, str]) -> tuple[str | None, float]:
    """``ROPE_SCALING`` / ``ROPE_FACTOR``, as the launcher sets them from ``--rope-scaling`` /
    ``--rope-factor``: both or neither (a lone ``--rope-factor`` becomes ``linear``, a lone
    ``--rope-scaling`` gets factor 1). The stock server reads ``ROPE_FACTOR`` only when
    ``ROPE_SCALING`` is set; so does this one."""
    scaling = _parse(env, "ROPE_SCALING", None, str, "one of " + ", ".join(ROPE_SCALINGS), lambda v: v in ROPE_SCALINGS)
    if scaling is None:
        return None, 1.0
    factor = _parse(env, "ROPE_FACTOR", 1.0, float, "a finite number > 0", lambda v: 0.0 < v < float("inf"))
    return scaling, factor


CUDA_GRAPHS_ALLOWED = "comma-separated decode batch sizes >= 1 (e.g. 1,2,4,8,16,32), or 0 to disable"


def parse_cuda_graphs(raw: str | None) -> tuple[int, ...]:
    """``CUDA_GRAPHS`` as the launcher writes it (``--cuda-graphs``, default ``1,2,4,8,16,32``): batch
    sizes, ascending and distinct. Unset, blank or ``0``: none (stock's shard captures none without the
    variable). Zeros in a list are dropped, as the launcher drops them; blanks around a size are
    ignored (Python's ``int``, as stock parses each item); anything else is a :class:`ConfigError`."""
    if raw is None or raw.strip() == "":
        return ()
    try:
        sizes = [int(item) for item in raw.split(",")]
    except ValueError:
        raise _fail("CUDA_GRAPHS", raw, CUDA_GRAPHS_ALLOWED) from None
    if any(size < 0 for size in sizes):
        raise _fail("CUDA_GRAPHS", raw, CUDA_GRAPHS_ALLOWED)
    return tuple(sorted({size for size in sizes if size > 0}))


def _on_off(raw: str) -> bool:
    value = {"1": True, "true": True, "0": False, "false": False}.get(raw.lower())
    if value is None:
        raise ValueError(raw)
    return value


def read_env(env: Mapping[str, str] | None = None) -> EnvSettings:
    """Parse and validate every knob. ``env`` defaults to ``os.environ``."""
    e = os.environ if env is None else env
    rope_scaling, rope_factor = _rope(e)
    lora = e.get("LORA_ADAPTERS")
    return EnvSettings(
        # TGI_BACKEND: `paged` (this package) or `stock` (TGI's own server, if installed).
        backend=read_backend(e),
        # TGI_PAGED_BLOCK_SIZE: tokens per physical and virtual block.
        block_size=_parse(
            e, "TGI_PAGED_BLOCK_SIZE", 16, int, "one of " + ", ".join(map(str, BLOCK_SIZES)), lambda v: v in BLOCK_SIZES
        ),
        # TGI_PAGED_MEMORY_FRACTION: share of device memory for weights + activations + KV.
        memory_fraction=_parse(
            e, "TGI_PAGED_MEMORY_FRACTION", 0.90, float, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0
        ),
        # CUDA_MEMORY_FRACTION: the launcher's --cuda-memory-fraction (default 1): the share of the
        # device this process may use, as stock (torch's per-process cap; multiplies the above).
        cuda_memory_fraction=_parse(
            e, "CUDA_MEMORY_FRACTION", 1.0, float, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0
        ),
        # TGI_PAGED_NUM_BLOCKS: cap on physical blocks (tests, benchmarks, capacity drills).
        num_blocks=_parse_optional(e, "TGI_PAGED_NUM_BLOCKS", int, "an integer >= 2", lambda v: v >= 2),
        # TGI_PAGED_OVERCOMMIT: advertised virtual tokens / physical tokens.
        overcommit=_parse(e, "TGI_PAGED_OVERCOMMIT", DEFAULT_OVERCOMMIT, float, "a number >= 1.0", lambda v: v >= 1.0),
        # TGI_PAGED_PREEMPTION: auto, recompute or swap.
        preemption=_parse(
            e,
            "TGI_PAGED_PREEMPTION",
            "auto",
            str.lower,
            "one of " + ", ".join(PREEMPTION_MODES),
            lambda v: v in PREEMPTION_MODES,
        ),
        # TGI_PAGED_SWAP_SPACE_GB: CPU swap space in GiB (0 disables swap).
        swap_space_gb=_parse(e, "TGI_PAGED_SWAP_SPACE_GB", 4.0, float, "a number >= 0", lambda v: v >= 0.0),
        # TGI_PAGED_HOST_CACHE_GB: host-RAM tier for prefix blocks the pool evicts (unset: auto, see CacheConfig).
        host_cache_gb=_parse_optional(e, "TGI_PAGED_HOST_CACHE_GB", float, "a number >= 0", lambda v: v >= 0.0),
        # TGI_PAGED_DISK_CACHE_DIR / _GB: opt-in disk tier below the host tier, kept across restarts.
        disk_cache_dir=_parse_optional(e, "TGI_PAGED_DISK_CACHE_DIR", str, "a directory path"),
        disk_cache_gb=_parse(e, "TGI_PAGED_DISK_CACHE_GB", 16.0, float, "a number > 0", lambda v: v > 0.0),
        # TGI_PAGED_WATERMARK: free-block share kept before braking admission.
        watermark=_parse(e, "TGI_PAGED_WATERMARK", 0.01, float, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0),
        # TGI_PAGED_METRICS_PORT: Prometheus /metrics on 127.0.0.1:PORT.
        metrics_port=_parse_optional(e, "TGI_PAGED_METRICS_PORT", int, "a port in 1..65535", lambda v: 0 < v < 65536),
        # TGI_PAGED_METRICS_HOST: the address /metrics binds (0.0.0.0: reachable from outside the pod).
        metrics_host=_parse(e, "TGI_PAGED_METRICS_HOST", "127.0.0.1", str.strip, "an IP address", lambda v: bool(v)),
        # TGI_PAGED_KV_EVENTS_ENDPOINT / _REPLAY_ENDPOINT / _TOPIC: KV-cache events for llm-d's indexer (ZMQ).
        kv_events_endpoint=_parse_optional(
            e, "TGI_PAGED_KV_EVENTS_ENDPOINT", str, "a ZMQ endpoint such as tcp://*:5557", lambda v: "://" in v
        ),
        kv_events_replay_endpoint=_parse_optional(
            e, "TGI_PAGED_KV_EVENTS_REPLAY_ENDPOINT", str, "a ZMQ endpoint such as tcp://*:5558", lambda v: "://" in v
        ),
        kv_events_topic=_parse_optional(e, "TGI_PAGED_KV_EVENTS_TOPIC", str, "a topic string"),
        # PREFIX_CACHING: set by the launcher (user env wins): advertised in Info.use_prefix_caching
        # and, when off, no prefix blocks are retained either. Stock parsing.
        prefix_caching=_stock_flag(e, "PREFIX_CACHING"),
        # TGI_PAGED_LAYER_GROUPS: a page map per layer group for models mixing full and sliding layers.
        layer_groups=_parse(e, "TGI_PAGED_LAYER_GROUPS", True, _on_off, "0, 1, false or true"),
        # MAX_BATCH_SIZE, MAX_TOTAL_TOKENS: set by the launcher when the user gives them, as its
        # `usize` values. Not used by the shard, as stock's CUDA server: the router caps its batches
        # and Warmup carries max_total_tokens.
        max_batch_size=_parse_optional(e, "MAX_BATCH_SIZE", int, "an integer >= 0", lambda v: v >= 0),
        max_total_tokens=_parse_optional(e, "MAX_TOTAL_TOKENS", int, "an integer >= 0", lambda v: v >= 0),
        # REQUEST_LOGPROBS: launcher --enable-prefill-logprobs. Stock parsing.
        request_logprobs=_stock_flag(e, "REQUEST_LOGPROBS"),
        # WEIGHTS_CACHE_OVERRIDE: launcher --weights-cache-override: a hub model's files are read
        # from this directory instead of the hub cache (a local model directory wins, as stock).
        weights_cache_override=_parse_optional(e, "WEIGHTS_CACHE_OVERRIDE", str, "a directory"),
        # ROPE_SCALING / ROPE_FACTOR: launcher --rope-scaling / --rope-factor.
        rope_scaling=rope_scaling,
        rope_factor=rope_factor,
        # CUDA_GRAPHS: launcher --cuda-graphs: decode batch sizes captured as CUDA graphs at Warmup.
        cuda_graphs=parse_cuda_graphs(e.get("CUDA_GRAPHS")),
        # TGI_PAGED_COMPILE: CPU decode through one torch.compile graph of the static decode step.
        compile_decode=_parse(e, "TGI_PAGED_COMPILE", False, _on_off, "0, 1, false or true"),
        # TGI_PAGED_CPU_DECODE: the CPU decode attention kernel (native C++, compiled no-gather, gather + SDPA).
        cpu_decode=_parse(
            e,
            "TGI_PAGED_CPU_DECODE",
            "native",
            str,
            " or ".join(CPU_DECODE_KERNELS),
            lambda v: v in CPU_DECODE_KERNELS,
        ),
        # TGI_PAGED_NATIVE_LAYERS: CPU fp32 decode of small Llama-form layers as one native call per layer.
        native_layers=_parse(e, "TGI_PAGED_NATIVE_LAYERS", True, _on_off, "0, 1, false or true"),
        # TGI_PAGED_MAX_IMAGES_PER_REQUEST: a VLM request with more images is INVALID_ARGUMENT; Warmup sizes for it.
        max_images_per_request=_parse(
            e, "TGI_PAGED_MAX_IMAGES_PER_REQUEST", 8, int, "an integer >= 1", lambda v: v >= 1
        ),
        # TGI_PAGED_SPECULATE_MAX_BATCH: draft only in steps with at most this many decoding requests.
        speculate_max_batch=_parse_optional(
            e, "TGI_PAGED_SPECULATE_MAX_BATCH", int, "an integer >= 1", lambda v: v >= 1
        ),
        # LORA_ADAPTERS: launcher --lora-adapters; empty means none, as stock.
        lora_adapters=lora if lora else None,
        # TGI_PAGED_MAX_LORA_RANK: adapters of a higher rank are refused at start.
        max_lora_rank=_parse(
            e, "TGI_PAGED_MAX_LORA_RANK", DEFAULT_MAX_LORA_RANK, int, "an integer >= 1", lambda v: v >= 1
        ),
        # TGI_PAGED_MAX_LORAS: adapters that may run in one step (others wait); unset: all.
        max_loras=_parse_optional(e, "TGI_PAGED_MAX_LORAS", int, "an integer >= 1", lambda v: v >= 1),
        # RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT: set by the launcher for each shard.
        rank=_parse(e, "RANK", 0, int, "an integer >= 0", lambda v: v >= 0),
        world_size=_parse(e, "WORLD_SIZE", 1, int, "an integer >= 1", lambda v: v >= 1),
        master_addr=_parse(e, "MASTER_ADDR", "localhost", str, "a host name"),
        master_port=_parse(e, "MASTER_PORT", 29500, int, "a port in 1..65535", lambda v: 0 < v < 65536),
        # TGI_PAGED_DIST_TIMEOUT_S: how long a tensor-parallel collective waits for the other ranks.
        dist_timeout_s=_parse(
            e, "TGI_PAGED_DIST_TIMEOUT_S", 30.0, float, "seconds in (0, 86400]", lambda v: 0.0 < v <= 86400.0
        ),
    )


def engine_factory_override(env: Mapping[str, str] | None = None) -> str | None:
    """``TGI_PAGED_ENGINE_FACTORY`` (tests only): ``module:callable`` that ``serve`` uses instead of
    ``engine.build_engine``, so CLI tests can run the real server on a fake engine. Unset in production."""
    e = os.environ if env is None else env
    raw = (e.get("TGI_PAGED_ENGINE_FACTORY") or "").strip()
    if not raw:
        return None
    module, sep, attr = raw.partition(":")
    if not (module and sep and attr):
        raise _fail("TGI_PAGED_ENGINE_FACTORY", raw, "module:callable")
    return raw


LOGGER_LEVELS = {
    "TRACE": "TRACE",
    "DEBUG": "DEBUG",
    "INFO": "INFO",
    "WARN": "WARNING",
    "WARNING": "WARNING",
    "ERROR": "ERROR",
    "CRITICAL": "CRITICAL",
    "OFF": "OFF",
}


def build_config(cli: Mapping[str, Any], env: Mapping[str, str] | None = None) -> BackendConfig:
    """Merge CLI arguments (the ``serve`` options, snake_case keys) with the environment."""
    s = read_env(env)
    e = os.environ if env is None else env
    level = str(cli.get("logger_level") or "INFO").upper()
    if level not in LOGGER_LEVELS:
        raise ConfigError(f"--logger-level={level!r} is invalid: allowed {sorted(LOGGER_LEVELS)}")
    if cli.get("sharded") and s.world_size < 2:
        raise ConfigError("--sharded needs WORLD_SIZE >= 2 (and RANK, MASTER_ADDR, MASTER_PORT)")
    if s.rank >= s.world_size:
        raise ConfigError(f"RANK={s.rank} is invalid: allowed 0..WORLD_SIZE-1 ({s.world_size - 1})")
    return BackendConfig(
        backend=s.backend,  # type: ignore[arg-type]
        model=ModelConfig(
            model_id=str(cli["model_id"]),
            revision=cli.get("revision"),
            dtype=cli.get("dtype"),
            trust_remote_code=bool(cli.get("trust_remote_code", False)),
            quantize=cli.get("quantize"),
            speculate=None if cli.get("speculate") is None else int(cli["speculate"]),
            max_input_tokens=cli.get("max_input_tokens"),
            weights_cache_override=s.weights_cache_override,
            rope_scaling=s.rope_scaling,
            rope_factor=s.rope_factor,
            lora_adapters=cli.get("lora_adapters") or s.lora_adapters,
            max_lora_rank=s.max_lora_rank,
            max_loras=s.max_loras,
            cuda_graphs=s.cuda_graphs,
            compile_decode=s.compile_decode,
            cpu_decode=s.cpu_decode,
            native_layers=s.native_layers,
            max_images_per_request=s.max_images_per_request,
            speculate_max_batch=s.speculate_max_batch,
        ),
        cache=CacheConfig(
            block_size=s.block_size,
            memory_fraction=s.memory_fraction * s.cuda_memory_fraction,
            cuda_memory_fraction=s.cuda_memory_fraction,
            num_blocks=s.num_blocks,
            overcommit=s.overcommit,
            swap_space_bytes=int(s.swap_space_gb * 1024**3),
            host_cache_bytes=None if s.host_cache_gb is None else int(s.host_cache_gb * 1024**3),
            disk_cache_dir=s.disk_cache_dir,
            disk_cache_bytes=int(s.disk_cache_gb * 1024**3),
            watermark=s.watermark,
            kv_cache_dtype=cli.get("kv_cache_dtype") or "auto",
            prefix_caching=s.prefix_caching,
            layer_groups=s.layer_groups,
        ),
        preemption=PreemptionConfig(mode=s.preemption),  # type: ignore[arg-type]
        server=ServerConfig(
            uds_path=str(cli.get("uds_path") or "/tmp/text-generation-server"),
            rank=s.rank,
            world_size=s.world_size,
            master_addr=s.master_addr,
            master_port=s.master_port,
            sharded=bool(cli.get("sharded", False)),
            logger_level=LOGGER_LEVELS[level],
            json_output=bool(cli.get("json_output", False)),
            request_logprobs=s.request_logprobs,
            max_batch_size=s.max_batch_size,
            max_total_tokens=s.max_total_tokens,
            dist_timeout_s=s.dist_timeout_s,
        ),
        telemetry=TelemetryConfig(
            otlp_endpoint=cli.get("otlp_endpoint"),
            otlp_service_name=str(cli.get("otlp_service_name") or "text-generation-inference.server"),
            metrics_port=s.metrics_port,
            metrics_host=s.metrics_host,
            kv_events_endpoint=s.kv_events_endpoint,
            kv_events_replay_endpoint=s.kv_events_replay_endpoint,
            kv_events_topic=s.kv_events_topic
            if s.kv_events_topic is not None
            else f"kv@{e.get('POD_IP') or socket.gethostname()}@{cli['model_id']}",
        ),
    )
