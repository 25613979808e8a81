"""Spawn ``text-generation-server`` exactly as the stock TGI launcher does (``launcher/src/main.rs``).

The Rust launcher cannot run here; this replays what it does to a shard process, from the behaviour
documented in ``tgi-server-contract.md`` §1 (no launcher code copied):

* argv in the launcher's order (``serve_argv`` / ``download_argv``), executable looked up on the
  child's ``PATH``;
* ``env_clear()`` then the launcher's own environment minus ``LOG_LEVEL`` (here: ``PATH``, ``HOME``,
  ``ATTENTION``/``PREFIX_CACHING`` as the launcher resolves them, and the caller's extras), then the
  launcher's additions (``RANK``, ``WORLD_SIZE``, ..., ``CUDA_GRAPHS``), later entries winning;
* a stale ``{uds}-{rank}`` socket deleted first; new process group; stdin a pipe kept open;
* stdout read in chunks of at most 32 KiB, each chunk split on ``\\n`` on its own, every piece parsed
  as ``{"text": str, "record": {"level": {"name": <accepted level>}}}``; anything else is dropped
  (and counted here); stderr collected line by line;
* readiness: poll every 100 ms, failing if the process exited, ready when ``{uds}-{rank}`` exists
  (no timeout unless asked); a failure shuts the other shards down;
* shutdown: SIGTERM to the pid, poll every 100 ms up to the graceful timeout, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EXECUTABLE = "text-generation-server"
DEFAULT_UDS_PATH = "/tmp/text-generation-server"
ACCEPTED_LEVELS = {"TRACE": "trace", "DEBUG": "debug", "INFO": "info", "SUCCESS": "info",
                   "WARNING": "warn", "ERROR": "error", "CRITICAL": "error"}  # fmt: skip
QUANTIZATIONS = ("awq", "compressed-tensors", "eetq", "exl2", "gptq", "marlin", "bitsandbytes",
                 "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8")  # fmt: skip
DEFAULT_CUDA_GRAPHS = (1, 2, 4, 8, 16, 32)
READ_CHUNK = 8 * 4096
POLL_S = 0.1


class ShardCannotStart(RuntimeError):
    """A shard exited before its socket appeared (launcher: ``ShardCannotStart``)."""

    def __init__(self, rank: int, exit_code: int | None, stderr: str) -> None:
        super().__init__(f"Shard {rank} failed to start (exit {exit_code}); stderr:\n{stderr}")
        self.rank, self.exit_code, self.stderr = rank, exit_code, stderr


class DownloadError(RuntimeError):
    """``download-weights`` exited non-zero (launcher: ``DownloadError``)."""


def rust_f32(value: float) -> str:
    """Rust's ``f32`` display: shortest round-trip digits, no exponent, ``1`` for ``1.0``."""
    return np.format_float_positional(np.float32(value), trim="-")


@dataclass(frozen=True)
class LogRecord:
    rank: int | None
    """Shard rank, or ``None`` for ``download-weights``."""
    level: str
    """The loguru level name as sent (``INFO``, ``WARNING``, ...)."""
    launcher_level: str
    """What the launcher logs it as: trace, debug, info, warn or error."""
    text: str
    """``text`` with trailing whitespace trimmed, as the launcher prints it."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_log_line(line: bytes, rank: int | None = None) -> LogRecord | None:
    """The launcher's ``PythonLogMessage`` parse of one piece of stdout; ``None`` if it would drop it."""
    try:
        message = json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
        text, name = message["text"], message["record"]["level"]["name"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    if not isinstance(text, str) or not isinstance(name, str) or name not in ACCEPTED_LEVELS:
        return None
    return LogRecord(rank, name, ACCEPTED_LEVELS[name], text.rstrip())


class _OutputCollector:
    """Background readers for one child: stdout JSON logs and stderr lines."""

    def __init__(self, process: subprocess.Popen, rank: int | None, sink: list[LogRecord], lock: threading.Lock):
        self.unparseable = 0
        self.stderr_lines: list[str] = []
        self._sink, self._lock, self._rank = sink, lock, rank
        self._threads = [
            threading.Thread(target=self._read_stdout, args=(process.stdout,), daemon=True),
            threading.Thread(target=self._read_stderr, args=(process.stderr,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read_stdout(self, stream: Any) -> None:
        fd = stream.fileno()
        while chunk := os.read(fd, READ_CHUNK):
            # Each read is split on its own: a line straddling two reads is lost, as in the launcher.
            for piece in chunk.split(b"\n"):
                record = parse_log_line(piece, self._rank)
                with self._lock:
                    if record is not None:
                        self._sink.append(record)
                    elif piece.strip():
                        self.unparseable += 1

    def _read_stderr(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                # Rust ``lines().map_while(Result::ok)`` stops at the first invalid line and drops
                # the pipe; later writes by the child then fail with EPIPE.
                stream.close()
                return
            line = line[:-1] if line.endswith("\n") else line
            self.stderr_lines.append(line[:-1] if line.endswith("\r") else line)

    def join(self, timeout: float = 2.0) -> None:
        for thread in self._threads:
            thread.join(timeout)

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)


def read_model_config(model_id: str) -> dict[str, Any] | None:
    """The launcher's ``get_config`` for a local directory (hub lookups are not replayed)."""
    path = os.path.join(model_id, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    if quant is not None and quant not in QUANTIZATIONS:
        return None  # serde would reject the whole config
    return raw


def _head_dim(config: Mapping[str, Any]) -> int | None:
    if config.get("head_dim") is not None:
        return config["head_dim"]
    hidden, heads = config.get("hidden_size") or config.get("n_embd"), config.get("num_attention_heads")
    if hidden and heads and hidden % heads == 0:
        return hidden // heads
    text_config = config.get("text_config")
    if not isinstance(text_config, dict):
        return None
    if text_config.get("head_dim") is not None:
        return text_config["head_dim"]
    return 256 if config.get("model_type") == "gemma3" else None


def resolve_attention(
    config: Mapping[str, Any] | None,
    environ: Mapping[str, str],
    lora_adapters: str | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> tuple[str, str]:
    """``(PREFIX_CACHING, ATTENTION)`` as the launcher sets them; values already in ``environ`` win."""
    prefix_caching, attention = environ.get("PREFIX_CACHING"), environ.get("ATTENTION")
    if config is not None:
        if prefix_caching is None and (config.get("vision_config") is not None or config.get("is_encoder_decoder")):
            prefix_caching = "0"
        fallback = "paged" if compute_capability is None or compute_capability[0] < 8 else "flashdecoding"
        if _head_dim(config) in (64, 128, 256):
            if lora_adapters is not None and prefix_caching is None:
                prefix_caching = "0"
            if config.get("model_type") in ("falcon", "deepseek_v2"):
                attention = attention or fallback
                if fallback == "paged" and prefix_caching is None:
                    prefix_caching = "0"
        else:
            attention = attention or fallback
            prefix_caching = prefix_caching or "0"
    if attention == "paged" and prefix_caching is None:
        prefix_caching = "0"
    return prefix_caching or "true", attention or "flashinfer"


@dataclass
class LauncherOptions:
    """The launcher flags that reach a shard (``None`` = flag not given)."""

    num_shard: int = 1
    uds_path: str = DEFAULT_UDS_PATH
    log_level: str = "INFO"
    """``LevelFilter`` upper-cased: TRACE, DEBUG, INFO, WARN, ERROR or OFF."""
    trust_remote_code: bool = False
    quantize: str | None = None
    speculate: int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    revision: str | None = None
    otlp_endpoint: str | None = None
    otlp_service_name: str = "text-generation-inference.router"
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_batch_size: int | None = None
    master_addr: str = "localhost"
    master_port: int = 29500
    cuda_memory_fraction: float = 1.0
    cuda_graphs: Sequence[int] | None = None
    rope_scaling: str | None = None
    rope_factor: float | None = None
    lora_adapters: str | None = None
    enable_prefill_logprobs: bool = False
    huggingface_hub_cache: str | None = None
    weights_cache_override: str | None = None
    disable_custom_kernels: bool = False
    watermark_gamma: float | None = None
    watermark_delta: float | None = None
    graceful_termination_timeout: float = 90.0
    compute_capability: tuple[int, int] | None = None
    """What the launcher's torch probe would report (``None``: no CUDA)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra variables in the launcher's own environment (``ATTENTION``/``PREFIX_CACHING`` here win)."""
    inherit: Sequence[str] = ("PATH", "HOME")
    """Variables copied from this process into the launcher's environment."""


def launcher_environ(model_id: str, opts: LauncherOptions) -> dict[str, str]:
    """The launcher process's environment: inherited names, extras, then the resolved attention."""
    environ = {k: os.environ[k] for k in opts.inherit if k in os.environ}
    environ.update(opts.env)
    prefix_caching, attention = resolve_attention(
        read_model_config(model_id), environ, opts.lora_adapters, opts.compute_capability
    )
    environ["PREFIX_CACHING"], environ["ATTENTION"] = prefix_caching, attention
    return environ


def effective_quantize(model_id: str, opts: LauncherOptions) -> str | None:
    if opts.quantize is not None:
        return opts.quantize
    config = read_model_config(model_id)
    return ((config or {}).get("quantization_config") or {}).get("quant_method")


def serve_argv(model_id: str, opts: LauncherOptions, quantize: str | None = None) -> list[str]:
    argv = ["serve", model_id, "--uds-path", opts.uds_path, "--logger-level", opts.log_level, "--json-output"]
    if opts.trust_remote_code:
        argv.append("--trust-remote-code")
    if opts.num_shard > 1:
        argv.append("--sharded")
    for flag, value in (("--quantize", quantize), ("--speculate", opts.speculate), ("--dtype", opts.dtype),
                        ("--kv-cache-dtype", opts.kv_cache_dtype), ("--revision", opts.revision),
                        ("--otlp-endpoint", opts.otlp_endpoint)):  # fmt: skip
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--otlp-service-name", opts.otlp_service_name]
    if opts.max_input_tokens is not None:
        argv += ["--max-input-tokens", str(opts.max_input_tokens)]
    return argv


def _common_env(base: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment minus ``LOG_LEVEL`` (the child starts from an empty one)."""
    return {k: v for k, v in base.items() if k != "LOG_LEVEL"}


def serve_env(base: Mapping[str, str], rank: int, opts: LauncherOptions, quantize: str | None) -> dict[str, str]:
    env = _common_env(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(opts.num_shard), MASTER_ADDR=opts.master_addr,
               MASTER_PORT=str(opts.master_port), TORCH_NCCL_AVOID_RECORD_STREAMS="1",
               CUDA_MEMORY_FRACTION=rust_f32(opts.cuda_memory_fraction), SAFETENSORS_FAST_GPU="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_ENABLE_HF_TRANSFER=base.get("HF_HUB_ENABLE_HF_TRANSFER", "1"))  # fmt: skip
    if "HF_API_TOKEN" in base:
        env["HF_TOKEN"] = base["HF_API_TOKEN"]
    if opts.rope_scaling is not None or opts.rope_factor is not None:
        env["ROPE_SCALING"] = opts.rope_scaling or "linear"
        env["ROPE_FACTOR"] = rust_f32(1.0 if opts.rope_factor is None else opts.rope_factor)
    optional = {"MAX_TOTAL_TOKENS": opts.max_total_tokens, "MAX_BATCH_SIZE": opts.max_batch_size,
                "LORA_ADAPTERS": opts.lora_adapters, "REQUEST_LOGPROBS": "1" if opts.enable_prefill_logprobs else None,
                "HUGGINGFACE_HUB_CACHE": opts.huggingface_hub_cache,
                "WEIGHTS_CACHE_OVERRIDE": opts.weights_cache_override}  # fmt: skip
    env.update({k: str(v) for k, v in optional.items() if v is not None})
    if opts.cuda_graphs is not None:
        graphs = [g for g in opts.cuda_graphs if g > 0]
    elif quantize in ("bitsandbytes", "exl2"):
        graphs = []
    else:
        graphs = list(DEFAULT_CUDA_GRAPHS)
    if graphs:
        env["CUDA_GRAPHS"] = ",".join(map(str, graphs))
    if opts.disable_custom_kernels:
        env["DISABLE_CUSTOM_KERNELS"] = "True"
    if opts.watermark_gamma is not None:
        env["WATERMARK_GAMMA"] = rust_f32(opts.watermark_gamma)
    if opts.watermark_delta is not None:
        env["WATERMARK_DELTA"] = rust_f32(opts.watermark_delta)
    return env


def download_argv(model_id: str, *, revision: str | None, trust_remote_code: bool, merge_lora: bool) -> list[str]:
    argv = ["download-weights", model_id, "--extension", ".safetensors", "--logger-level", "INFO", "--json-output"]
    if merge_lora:
        argv.append("--merge-lora")
    if revision is not None:
        argv += ["--revision", revision]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    return argv


def download_env(base: Mapping[str, str], opts: LauncherOptions) -> dict[str, str]:
    env = _common_env(base)
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if opts.huggingface_hub_cache is not None:
        env["HUGGINGFACE_HUB_CACHE"] = opts.huggingface_hub_cache
    env["HF_HUB_ENABLE_HF_TRANSFER"] = base.get("HF_HUB_ENABLE_HF_TRANSFER", "1")
    if "HF_API_TOKEN" in base:
        env["HF_TOKEN"] = base["HF_API_TOKEN"]
    if opts.weights_cache_override is not None:
        env["WEIGHTS_CACHE_OVERRIDE"] = opts.weights_cache_override
    return env


def terminate(process: subprocess.Popen, timeout: float) -> tuple[int, bool]:
    """SIGTERM the pid (not its group), poll every 100 ms, SIGKILL after ``timeout``; (exit, killed)."""
    if process.poll() is not None:
        return process.returncode, False
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return process.returncode, False
        time.sleep(POLL_S)
    process.kill()
    return process.wait(), True


def _close_pipes(process: subprocess.Popen) -> None:
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None and not stream.closed:
            stream.close()


@dataclass
class DownloadResult:
    argv: list[str]
    env: dict[str, str]
    exit_code: int
    logs: list[LogRecord]
    unparseable: int
    stderr: str


def download_weights(
    model_id: str,
    opts: LauncherOptions | None = None,
    *,
    merge_lora: bool = True,
    revision: str | None = None,
    check: bool = True,
    timeout: float | None = None,
) -> DownloadResult:
    """Run ``download-weights`` as the launcher does (stdin inherited); ``DownloadError`` if it fails."""
    opts = opts or LauncherOptions()
    argv = download_argv(model_id, revision=revision, trust_remote_code=opts.trust_remote_code, merge_lora=merge_lora)
    env = download_env(launcher_environ(model_id, opts), opts)
    process = subprocess.Popen([EXECUTABLE, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               process_group=0)  # fmt: skip
    logs: list[LogRecord] = []
    collector = _OutputCollector(process, None, logs, threading.Lock())
    try:
        exit_code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        exit_code, _ = terminate(process, 10.0)
    collector.join()
    _close_pipes(process)
    result = DownloadResult([EXECUTABLE, *argv], env, exit_code, logs, collector.unparseable, collector.stderr)
    if check and exit_code != 0:
        raise DownloadError(f"Download encountered an error (exit {exit_code}): {result.stderr}")
    return result


def lora_downloads(lora_adapters: str) -> list[tuple[str, str | None]]:
    """``(adapter_id, revision)`` for each adapter the launcher downloads (``id=path`` entries skipped)."""
    out = []
    for adapter in lora_adapters.split(","):
        if "=" in adapter:
            continue
        adapter = adapter.strip()
        if adapter.count("@") > 1:
            raise ValueError(f"Invalid LoRA adapter format: {adapter}")
        parts = adapter.split("@")
        out.append((parts[0], parts[1] if len(parts) > 1 else None))
    return out


@dataclass
class _Shard:
    rank: int
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen
    collector: _OutputCollector
    ready_after: float | None = None


class LaunchedShards:
    """``num_shard`` shard processes started like the launcher; a context manager that terminates them.

    ``logs``: parsed stdout records of every rank in arrival order; ``stderr``: rank -> collected
    stderr; ``unparseable``: rank -> dropped stdout lines; ``exit_codes``: rank -> exit status once
    terminated (negative: signal); ``killed``: ranks that needed SIGKILL.
    """

    def __init__(self, model_id: str, opts: LauncherOptions | None = None, *, ready_timeout: float | None = None):
        self.model_id = model_id
        self.opts = opts or LauncherOptions()
        self.ready_timeout = ready_timeout
        self.logs: list[LogRecord] = []
        self.launcher_log: list[str] = []
        self.exit_codes: dict[int, int] = {}
        self.killed: set[int] = set()
        self._shards: list[_Shard] = []
        self._lock = threading.Lock()

    @property
    def socket_paths(self) -> list[str]:
        return [f"{self.opts.uds_path}-{rank}" for rank in range(self.opts.num_shard)]

    @property
    def stderr(self) -> dict[int, str]:
        return {s.rank: s.collector.stderr for s in self._shards}

    @property
    def unparseable(self) -> dict[int, int]:
        return {s.rank: s.collector.unparseable for s in self._shards}

    def argv(self, rank: int = 0) -> list[str]:
        return self._shards[rank].argv

    def env(self, rank: int = 0) -> dict[str, str]:
        return self._shards[rank].env

    def pid(self, rank: int = 0) -> int:
        return self._shards[rank].process.pid

    def __enter__(self) -> LaunchedShards:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def start(self) -> None:
        quantize = effective_quantize(self.model_id, self.opts)
        base = launcher_environ(self.model_id, self.opts)
        for rank, socket_path in enumerate(self.socket_paths):
            if os.path.exists(socket_path):
                os.remove(socket_path)
            argv = [EXECUTABLE, *serve_argv(self.model_id, self.opts, quantize)]
            env = serve_env(base, rank, self.opts, quantize)
            self.launcher_log.append(f"rank {rank}: Starting shard")
            process = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, process_group=0)  # fmt: skip
            collector = _OutputCollector(process, rank, self.logs, self._lock)
            self._shards.append(_Shard(rank, argv, env, process, collector))
        try:
            self._wait_ready()
        except BaseException:
            self.terminate()
            raise

    def _wait_ready(self) -> None:
        start = last_wait_log = time.monotonic()
        while True:
            for shard in self._shards:
                if shard.ready_after is not None:
                    continue
                if shard.process.poll() is not None:
                    shard.collector.join()
                    stderr = shard.collector.stderr
                    self.launcher_log.append(f"rank {shard.rank}: Shard complete standard error output:\n{stderr}")
                    raise ShardCannotStart(shard.rank, shard.process.returncode, shard.collector.stderr)
                if os.path.exists(self.socket_paths[shard.rank]):
                    shard.ready_after = time.monotonic() - start
                    self.launcher_log.append(f"rank {shard.rank}: Shard ready in {shard.ready_after:.2f}s")
            if all(s.ready_after is not None for s in self._shards):
                return
            now = time.monotonic()
            if self.ready_timeout is not None and now - start > self.ready_timeout:
                raise TimeoutError(f"shards not ready after {self.ready_timeout} s (the launcher would wait forever)")
            if now - last_wait_log > 10:
                self.launcher_log.append("Waiting for shard to be ready...")
                last_wait_log = now
            time.sleep(POLL_S)

    def crashed(self) -> list[int]:
        """Ranks whose process exited; after startup the launcher treats any exit as a crash."""
        return [s.rank for s in self._shards if s.process.poll() is not None]

    def terminate(self) -> dict[int, int]:
        """Shut every shard down (concurrently, like the shard-manager threads); returns exit codes."""
        results: dict[int, tuple[int, bool]] = {}

        def stop(shard: _Shard) -> None:
            results[shard.rank] = terminate(shard.process, self.opts.graceful_termination_timeout)

        threads = [threading.Thread(target=stop, args=(s,)) for s in self._shards if s.rank not in self.exit_codes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for rank, (code, killed) in sorted(results.items()):
            self.exit_codes[rank] = code
            if killed:
                self.killed.add(rank)
                self.launcher_log.append(f"rank {rank}: shard killed")
        for shard in self._shards:
            shard.collector.join()
            _close_pipes(shard.process)
        return dict(self.exit_codes)
