"""Frozen configuration dataclasses, one per component.

Built once at start-up by :func:`tgi_paged_backend.envs.build_config` from the CLI arguments and the
environment, then passed down. Nothing below this module reads ``os.environ``.

Every field carries an attribute docstring (checked by ``tests/test_config.py``). ``__post_init__``
validates values for programmatic construction; ``envs.py`` validates the same values earlier with
messages that name the environment variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PreemptionMode = Literal["auto", "recompute", "swap"]
PREEMPTION_MODES: tuple[str, ...] = ("auto", "recompute", "swap")
BLOCK_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""Allowed ``TGI_PAGED_BLOCK_SIZE``. 1 is stock TGI's own paging with flashinfer (token pages); small
blocks cut the half-empty-last-block waste of short requests at a per-step bookkeeping cost (see
``examples/bench_bookkeeping.py``), 16 is the default."""
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3fn", "fp8_e5m2")
ROPE_SCALINGS: tuple[str, ...] = ("linear", "dynamic")
CPU_DECODE_KERNELS: tuple[str, ...] = ("native", "compiled", "sdpa")
"""Allowed ``TGI_PAGED_CPU_DECODE``: the CPU decode attention kernels (:attr:`ModelConfig.cpu_decode`)."""
"""Allowed ``ROPE_SCALING``: the values of the launcher's ``--rope-scaling``."""
LAUNCHER_CUDA_GRAPHS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""The launcher's default ``--cuda-graphs``, which it puts in the shard's ``CUDA_GRAPHS``; a shard started
without that variable captures no graphs, as stock's."""
DEFAULT_OVERCOMMIT = 6.0
"""Chosen in docs/performance.md ("Recommended TGI_PAGED_OVERCOMMIT"). End to end (CPU), 6 and up let the physical
pool, not the router's virtual budget, limit admission: KV waste falls from 11.3 % at 3 to 1.5 % at 6, with more
tokens/s. In the simulation (ShareGPT-like, A10G) 6 is the lowest waste (1.9 %) within 3 % of the best throughput;
higher buys nothing there and adds swap preemptions. Short answers under a large ``max_new_tokens``
(or none, which the router turns into the whole context) want more: ``tgi-paged-backend plan`` advises."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the knob, the value and what is allowed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """Sizing of the physical KV pool and of the virtual budget advertised to the router."""

    block_size: int = 16
    """Tokens per KV block (one of ``BLOCK_SIZES``); also reported to the router in ``InfoResponse.block_size``."""
    memory_fraction: float = 0.90
    """Share of device memory for weights + activations + KV (0 < f <= 1)."""
    cuda_memory_fraction: float = 1.0
    """The launcher's ``CUDA_MEMORY_FRACTION``: on CUDA, the per-process cap set with
    ``torch.cuda.set_per_process_memory_fraction`` as stock does (already folded into
    :attr:`memory_fraction`)."""
    num_blocks: int | None = None
    """Cap on physical blocks (tests, benchmarks, capacity drills); ``None`` sizes from memory."""
    overcommit: float = DEFAULT_OVERCOMMIT
    """Advertised virtual tokens divided by physical tokens (>= 1)."""
    swap_space_bytes: int = 4 * 1024**3
    """Bytes of CPU memory for swapped-out blocks (0 disables swapping)."""
    host_cache_bytes: int | None = None
    """``TGI_PAGED_HOST_CACHE_GB``: host RAM for the prefix blocks the pool evicts (``memory.host_tier``;
    needs prefix caching). ``None``: automatic, :func:`~tgi_paged_backend.offload.tier_sizing.host_tier_bytes`
    (on CUDA half the host RAM available at start less the swap space, at most 64 GiB; on CPU 0, since the
    pool itself lives in host RAM there). A separate arena from the swap space, never counted twice."""
    disk_cache_dir: str | None = None
    """``TGI_PAGED_DISK_CACHE_DIR``: opt-in disk tier below the host tier (kept across restarts)."""
    disk_cache_bytes: int = 16 * 1024**3
    """``TGI_PAGED_DISK_CACHE_GB``: size cap of the disk tier's files."""
    watermark: float = 0.01
    """Share of physical blocks kept free for running requests before admission is braked."""
    kv_cache_dtype: str = "auto"
    """KV storage dtype: ``auto`` (model dtype), ``fp8_e4m3fn`` or ``fp8_e5m2``."""
    prefix_caching: bool = False
    """``PREFIX_CACHING``: advertise ``use_prefix_caching`` to the router and retain the full prompt
    blocks of finished (and recompute-preempted) requests for reuse; off, nothing is retained."""
    layer_groups: bool = True
    """``TGI_PAGED_LAYER_GROUPS``: models that mix full and sliding-window layers (Gemma 2/3, gpt-oss,
    Cohere 2) get one page map per layer group (``memory.layer_groups``), so the sliding layers keep
    only their window; ``0`` keeps one page map for all layers."""

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size={self.block_size} is invalid: allowed {BLOCK_SIZES}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction={self.memory_fraction} is invalid: allowed (0, 1]")
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            raise ConfigError(f"cuda_memory_fraction={self.cuda_memory_fraction} is invalid: allowed (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks={self.num_blocks} is invalid: allowed >= 2")
        if self.overcommit < 1.0:
            raise ConfigError(f"overcommit={self.overcommit} is invalid: allowed >= 1.0")
        if self.swap_space_bytes < 0:
            raise ConfigError(f"swap_space_bytes={self.swap_space_bytes} is invalid: allowed >= 0")
        if self.host_cache_bytes is not None and self.host_cache_bytes < 0:
            raise ConfigError(f"host_cache_bytes={self.host_cache_bytes} is invalid: allowed >= 0 or None")
        if self.disk_cache_dir and self.host_cache_bytes == 0:
            raise ConfigError(
                "TGI_PAGED_DISK_CACHE_DIR needs a host tier (blocks reach disk through it): "
                "unset TGI_PAGED_HOST_CACHE_GB or give it a size > 0"
            )
        if self.disk_cache_bytes <= 0:
            raise ConfigError(f"disk_cache_bytes={self.disk_cache_bytes} is invalid: allowed > 0")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark={self.watermark} is invalid: allowed [0, 1)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is invalid: allowed {KV_CACHE_DTYPES}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PreemptionConfig:
    """How requests are preempted when the physical pool runs dry."""

    mode: PreemptionMode = "auto"
    """``recompute`` drops a victim's blocks, ``swap`` copies them to CPU, ``auto`` picks the cheaper."""
    max_preemptions_per_request: int = 8
    """A request preempted this many times is protected from further preemption."""
    cost_aware_victims: bool = False
    """Choose victims by estimated preemption cost instead of latest-admitted-first."""

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ConfigError(f"mode={self.mode!r} is invalid: allowed {PREEMPTION_MODES}")
        if self.max_preemptions_per_request < 1:
            raise ConfigError("max_preemptions_per_request must be >= 1")


DEFAULT_MAX_LORA_RANK = 256
"""``TGI_PAGED_MAX_LORA_RANK`` when unset: above the ranks adapters are trained with in practice (8 to 128),
low enough that one adapter cannot make every slot's stacks hundreds of MiB."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What to load and how."""

    model_id: str
    """Local directory (or hub id, resolved by ``download-weights``) of a transformers model."""
    revision: str | None = None
    """Hub revision, passed through to transformers."""
    dtype: str | None = None
    """``float16``, ``bfloat16`` or ``float32``; ``None`` picks float32 on CPU, float16 on CUDA."""
    trust_remote_code: bool = False
    """Allow custom modeling code shipped with the model."""
    quantize: str | None = None
    """Quantization method from the launcher; only ``None`` is implemented."""
    speculate: int | None = None
    """``--speculate``: speculative tokens proposed per request and step (``engine.speculation``); ``None``
    when not given: 0, or a Medusa checkpoint's head count (``model_files.with_local_model``)."""
    speculate_max_batch: int | None = None
    """``TGI_PAGED_SPECULATE_MAX_BATCH``: requests draft only in steps where at most this many requests
    decode (a step that prefills anyway always may); ``None``: 1 on CPU, where a step with drafts leaves
    the one-call native decode path and batched drafting costs more than it saves, no limit on CUDA."""
    medusa_dir: str | None = None
    """The Medusa checkpoint whose heads propose the drafts, when ``--model-id`` named one
    (``model_files.with_local_model`` then points :attr:`model_id` at its base model); else n-gram drafts."""
    max_input_tokens: int | None = None
    """The launcher's ``--max-input-tokens``; echoed at Warmup."""
    weights_cache_override: str | None = None
    """``WEIGHTS_CACHE_OVERRIDE``: directory holding a hub model's files (``model_files.local_model_dir``)."""
    rope_scaling: str | None = None
    """``ROPE_SCALING`` (one of ``ROPE_SCALINGS``): replaces the model config's RoPE scaling, as stock."""
    rope_factor: float = 1.0
    """``ROPE_FACTOR``: the scaling factor that goes with :attr:`rope_scaling`."""
    lora_adapters: str | None = None
    """``LORA_ADAPTERS`` (or ``--lora-adapters``) as given (:func:`..lora.sources.parse_lora_adapters`)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """``TGI_PAGED_MAX_LORA_RANK``: adapters with a higher rank are refused at start (every slot's stacks are
    padded to the highest rank loaded; vLLM's ``--max-lora-rank``)."""
    max_loras: int | None = None
    """``TGI_PAGED_MAX_LORAS``: adapters that may run in one step; requests of further adapters wait in
    the batch (holding what they hold) until one of the running adapters has no request left.
    ``None``: every loaded adapter."""
    cuda_graphs: tuple[int, ...] = ()
    """``CUDA_GRAPHS``: decode batch sizes (ascending, distinct, >= 1) captured as one CUDA graph each at
    Warmup; a decode batch is padded up to the smallest that holds it, larger ones and prefills run
    eagerly. ``()`` (the variable unset or ``0``): no graphs. Not used on CPU."""
    compile_decode: bool = False
    """``TGI_PAGED_COMPILE``: on CPU, decode batches of up to 256 requests run through one
    ``torch.compile`` (inductor) graph of the static decode step, compiled at Warmup (minutes cold,
    inductor's disk cache makes restarts faster); the packed linears of the fast-layer swap enter the
    graph as an opaque op (``tgi_paged::packed_linear``). Off by default: not faster than the eager
    step yet (docs/performance.md, "Compiled decode"). Not used on CUDA."""
    cpu_decode: str = "native"
    """``TGI_PAGED_CPU_DECODE`` (one of ``CPU_DECODE_KERNELS``): ``native`` runs CPU decode attention
    through the C++ kernel built at first use (``tgi_paged_kernels.cpu_native``; reads the blocks in
    place); ``compiled`` through the no-gather kernel compiled by inductor at Warmup
    (``tgi_paged_kernels.cpu_decode``); ``sdpa`` gathers each request's blocks and calls SDPA. Each falls
    back to the next when it cannot build here. Not used on CUDA (Triton kernels)."""
    native_layers: bool = True
    """``TGI_PAGED_NATIVE_LAYERS``: on CPU, fp32 decode steps of Llama-form decoder layers with small
    projections run as one native call per layer (``runner.native.layers``); ``0`` keeps the per-op path."""
    max_images_per_request: int = 8
    """``TGI_PAGED_MAX_IMAGES_PER_REQUEST``: a vision-language model's request carrying more images is refused
    (INVALID_ARGUMENT); Warmup measures the vision tower's peak at this many of its largest images (bounded by
    ``max_input_tokens``). Text models ignore it."""

    def __post_init__(self) -> None:
        if self.max_images_per_request < 1:
            raise ConfigError(f"max_images_per_request={self.max_images_per_request} is invalid: allowed >= 1")
        if self.cpu_decode not in CPU_DECODE_KERNELS:
            raise ConfigError(f"cpu_decode={self.cpu_decode!r} is invalid: allowed {CPU_DECODE_KERNELS}")
        if any(b < 1 for b in self.cuda_graphs) or list(self.cuda_graphs) != sorted(set(self.cuda_graphs)):
            raise ConfigError(f"cuda_graphs={self.cuda_graphs} is invalid: allowed distinct sizes >= 1, ascending")
        if self.rope_scaling is not None and self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError(f"rope_scaling={self.rope_scaling!r} is invalid: allowed {ROPE_SCALINGS}")
        if not 0.0 < self.rope_factor < float("inf"):
            raise ConfigError(f"rope_factor={self.rope_factor} is invalid: allowed a finite number > 0")
        if self.speculate is not None and self.speculate < 0:
            raise ConfigError(f"--speculate={self.speculate} is invalid: allowed 0 or more")

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per request and step (0: no speculation)."""
        return self.speculate or 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """The gRPC shard process: sockets, ranks, logging."""

    uds_path: str = "/tmp/text-generation-server"
    """Base socket path; the shard listens on ``{uds_path}-{rank}``."""
    rank: int = 0
    """This shard's rank (``RANK``)."""
    world_size: int = 1
    """Number of shards (``WORLD_SIZE``)."""
    master_addr: str = "localhost"
    """torch.distributed rendezvous address (``MASTER_ADDR``)."""
    master_port: int = 29500
    """torch.distributed rendezvous port (``MASTER_PORT``)."""
    sharded: bool = False
    """The launcher passed ``--sharded``."""
    logger_level: str = "INFO"
    """Loguru level name after mapping the launcher's ``WARN``/``OFF``."""
    json_output: bool = False
    """One JSON object per log line on stdout, as the launcher parses them."""
    request_logprobs: bool = False
    """Honour ``prefill_logprobs`` (``REQUEST_LOGPROBS``)."""
    max_batch_size: int | None = None
    """Launcher ``MAX_BATCH_SIZE`` (``--max-batch-size``). Not used by the shard, as stock's CUDA
    server: the router caps its batches."""
    max_total_tokens: int | None = None
    """Launcher ``MAX_TOTAL_TOKENS`` (``--max-total-tokens``). Not used by the shard, as stock's CUDA
    server: Warmup carries the value the router enforces."""
    dist_timeout_s: float = 30.0
    """Seconds a tensor-parallel collective may wait for the other ranks before the shard gives up and
    exits (``TGI_PAGED_DIST_TIMEOUT_S``); only used when ``world_size > 1``."""

    def __post_init__(self) -> None:
        if not 0.0 < self.dist_timeout_s <= 86400.0:
            raise ConfigError(f"dist_timeout_s={self.dist_timeout_s} is invalid: allowed (0, 86400]")

    @property
    def socket_path(self) -> str:
        return f"{self.uds_path}-{self.rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TelemetryConfig:
    """Where metrics and traces go."""

    otlp_endpoint: str | None = None
    """OTLP/gRPC endpoint for traces and metrics; ``None`` disables OTLP export."""
    otlp_service_name: str = "text-generation-inference.server"
    """``service.name`` resource attribute."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on 127.0.0.1:PORT; ``None`` disables it."""
    kv_events_endpoint: str | None = None
    """``TGI_PAGED_KV_EVENTS_ENDPOINT``: publish KV-cache events on this ZMQ endpoint (rank 0;
    :mod:`..telemetry.kv_events`); ``None``: off."""
    kv_events_replay_endpoint: str | None = None
    """``TGI_PAGED_KV_EVENTS_REPLAY_ENDPOINT``: the ROUTER endpoint serving missed event batches."""
    kv_events_topic: str = ""
    """``TGI_PAGED_KV_EVENTS_TOPIC``: the topic frame (default ``kv@<POD_IP or host name>@<model id>``)."""
    metrics_host: str = "127.0.0.1"
    """``TGI_PAGED_METRICS_HOST``: the address ``/metrics`` binds (``0.0.0.0`` for a Kubernetes endpoint picker
    or a Prometheus outside the pod)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendConfig:
    """Everything the shard needs, built once from CLI + environment."""

    backend: Literal["paged", "stock"] = "paged"
    """``paged`` (this package) or ``stock`` (delegate to TGI's own server)."""
    model: ModelConfig
    """Model to serve."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """KV pool sizing."""
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    """Preemption policy."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Process, sockets and logging."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Metrics and traces."""
