"""``text-generation-server``: the CLI the stock TGI launcher runs (``serve``, ``download-weights``).

Option spellings follow what the launcher passes (``launcher/src/main.rs``); flags it passes bare
(``--json-output``, ``--sharded``, ``--trust-remote-code``, ``--merge-lora``) take no value. Unknown
options are warned about, not fatal, because newer launchers may add some. Configuration errors
print one clear line (a JSON log line with ``--json-output``) and exit 1, without a traceback.

``TGI_BACKEND=stock`` hands the whole command line to TGI's own server when it is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import NoReturn

import typer
from loguru import logger as _logger

from tgi_paged_backend import __version__, envs, model_files
from tgi_paged_backend.config import BackendConfig, ConfigError
from tgi_paged_backend.logging_setup import setup_logging
from tgi_paged_backend.lora.sources import parse_lora_adapters
from tgi_paged_backend.runner.quant.methods import SUPPORTED_QUANTIZE
from tgi_paged_backend.runner.quant.methods import refusal as quantize_refusal

# Bound as ours: under `python -m tgi_paged_backend.cli` the module is named `__main__`.
logger = _logger.bind(own=True)

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
DOWNLOAD_PATTERNS = ["*.safetensors", "*.json", "tokenizer*"]
_LENIENT = {"allow_extra_args": True, "ignore_unknown_options": True}

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="TGI model server (generate.v3 over unix sockets), paged-KV backend.",
)
tools_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help="tgi-paged-backend tools.")


@app.callback()
def _select_backend() -> None:
    """TGI model server: `serve` and `download-weights`, as the TGI launcher calls them."""
    json_output = "--json-output" in sys.argv[1:]
    try:
        backend = envs.read_env().backend
    except ConfigError as err:
        _fail(str(err), json_output)
    if backend == "stock":
        _exec_stock_server(sys.argv[1:], json_output)


@app.command(context_settings=_LENIENT)
def serve(
    ctx: typer.Context,
    model_id: str = typer.Argument(..., help="Local model directory or hub id."),
    uds_path: str = typer.Option("/tmp/text-generation-server", help="Base socket path; `-{rank}` is appended."),
    logger_level: str = typer.Option("INFO", help="TRACE, DEBUG, INFO, WARN, ERROR or OFF."),
    json_output: bool = typer.Option(False, help="One JSON object per log line on stdout."),
    trust_remote_code: bool = typer.Option(False),
    sharded: bool = typer.Option(False),
    quantize: str | None = typer.Option(None, help="fp8, compressed-tensors, gptq or awq (others are refused)."),
    speculate: int | None = typer.Option(
        None,
        help="Speculative tokens per step (n-gram drafts from the request's history, or a Medusa checkpoint's heads).",
    ),
    dtype: str | None = typer.Option(None, help="float16, bfloat16 or float32."),
    kv_cache_dtype: str | None = typer.Option(None, help="fp8_e4m3fn or fp8_e5m2."),
    revision: str | None = typer.Option(None),
    otlp_endpoint: str | None = typer.Option(None),
    otlp_service_name: str = typer.Option("text-generation-inference.server"),
    max_input_tokens: int | None = typer.Option(None),
    merge_lora: bool = typer.Option(False, hidden=True, help="Accepted and ignored."),
    lora_adapters: str | None = typer.Option(
        None, hidden=True, help="As LORA_ADAPTERS: repo/id[@rev] or name=/path, comma-separated."
    ),
) -> None:
    """Load the model, then serve generate.v3 on unix://{uds_path}-{rank} until SIGTERM."""
    try:
        config = envs.build_config(
            {
                "model_id": model_id,
                "uds_path": os.path.abspath(uds_path),
                "logger_level": logger_level,
                "json_output": json_output,
                "trust_remote_code": trust_remote_code,
                "sharded": sharded,
                "quantize": quantize,
                "speculate": speculate,
                "dtype": dtype,
                "kv_cache_dtype": kv_cache_dtype,
                "revision": revision,
                "otlp_endpoint": otlp_endpoint,
                "otlp_service_name": otlp_service_name,
                "max_input_tokens": max_input_tokens,
                "lora_adapters": lora_adapters,
            }
        )
        _check_supported(config)
        served = model_files.with_local_model(config)
    except ConfigError as err:
        _fail(str(err), json_output)

    setup_logging(config.server.logger_level, json_output, redirect_stdout=json_output)
    if ctx.args:
        logger.warning(f"Ignoring unknown arguments: {' '.join(ctx.args)}")
    if served is not config:
        logger.info(f"Loading {config.model.model_id} from {served.model.model_id}")
        config = served

    try:
        engine_factory = _engine_factory()
    except Exception as err:  # noqa: BLE001 - one clear line instead of a traceback
        _fail(f"Cannot load the engine: {type(err).__name__}: {err}", json_output)

    from tgi_paged_backend.server import grpc_server
    from tgi_paged_backend.server.tracing import TracingInterceptor, setup_tracing

    tracer_provider = setup_tracing(config.telemetry, config.server.rank)
    try:
        code = grpc_server.run(config, engine_factory, interceptors=[TracingInterceptor(tracer_provider)])
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()
    raise typer.Exit(code)


@app.command("download-weights", context_settings=_LENIENT)
def download_weights(
    ctx: typer.Context,
    model_id: str = typer.Argument(..., help="Local model directory or hub id."),
    extension: str = typer.Option(".safetensors"),
    logger_level: str = typer.Option("INFO"),
    json_output: bool = typer.Option(False),
    merge_lora: bool = typer.Option(False, help="Accepted and ignored."),
    revision: str | None = typer.Option(None),
    trust_remote_code: bool = typer.Option(False, help="Accepted and ignored."),
    auto_convert: bool = typer.Option(True, help="Accepted and ignored (safetensors only)."),
) -> None:
    """Make the model's safetensors, config and tokenizer files available locally."""
    try:
        setup_logging(logger_level, json_output, redirect_stdout=json_output)
    except ValueError as err:
        _fail(str(err), json_output)
    if ctx.args:
        logger.warning(f"Ignoring unknown arguments: {' '.join(ctx.args)}")
    if extension != ".safetensors":
        logger.warning(f"--extension {extension} ignored: this backend loads .safetensors only")

    if Path(model_id).is_dir():
        if not any(Path(model_id).glob("*.safetensors")):
            logger.warning(f"{model_id} has no *.safetensors files; loading it will fail")
        logger.info(f"{model_id} is a local directory: nothing to download")
        return
    try:
        override = envs.read_env().weights_cache_override
        if override is not None:  # as stock: the files are expected there, nothing is downloaded
            path = model_files.override_dir(override, model_id)
            logger.info(f"WEIGHTS_CACHE_OVERRIDE: {model_id} is served from {path}; nothing to download")
            return
    except ConfigError as err:
        _fail(str(err), json_output)
    try:
        snapshot = _snapshot_download(model_id, revision)
    except Exception as err:  # noqa: BLE001 - any hub/network failure: one clear line, exit 1
        _fail(
            f"Could not download {model_id} (revision {revision or 'main'}) from the Hugging Face hub: "
            f"{type(err).__name__}: {err}",
            json_output,
        )
    if not any(Path(snapshot).glob("*.safetensors")):
        _fail(f"{model_id} has no *.safetensors weights on the hub; this backend loads safetensors only", json_output)
    logger.info(f"Successfully downloaded weights for {model_id} to {snapshot}")


@tools_app.callback()
def _tools() -> None:
    """tgi-paged-backend tools."""


@tools_app.command()
def version() -> None:
    """Print the package version."""
    typer.echo(__version__)


@tools_app.command()
def plan(
    model: str = typer.Option(
        ...,
        help="Local model directory (config.json) or a preset: llama-3-8b, llama-3-70b, mistral-7b, "
        "mixtral-8x7b, qwen3-30b-a3b, gpt-oss-120b, gemma-2-9b, smollm2-135m. Models mixing sliding and full "
        "layers are planned by KV layer group as the shard pages them (TGI_PAGED_LAYER_GROUPS=0: one page map).",
    ),
    gpu: str = typer.Option("A10G", help="A10G, L4, A100-40, A100-80, H100, H200 or cpu."),
    memory_gb: float | None = typer.Option(None, help="Device memory in GiB (overrides the GPU's)."),
    memory_fraction: float = typer.Option(0.90, help="TGI_PAGED_MEMORY_FRACTION x CUDA_MEMORY_FRACTION."),
    block_size: int = typer.Option(16, help="TGI_PAGED_BLOCK_SIZE: 1, 2, 4, 8, 16 or 32."),
    dtype: str | None = typer.Option(None, help="float16, bfloat16 or float32 (default as the shard)."),
    kv_dtype: str = typer.Option("auto", help="auto, fp8_e4m3fn or fp8_e5m2."),
    quantize: str | None = typer.Option(
        None, help="fp8, compressed-tensors (FP8: 1 byte per linear weight), gptq or awq (--bits/--group-size)."
    ),
    bits: int | None = typer.Option(
        None,
        help="Int checkpoints: code bits, 4 or 8 (default 4); with "
        "--quantize compressed-tensors, means pack-quantized.",
    ),
    group_size: int | None = typer.Option(None, help="Int checkpoints: group size, -1 per channel (default 128)."),
    num_shard: int = typer.Option(1, help="--num-shard: plan one rank of N (its weights, KV heads and pool)."),
    trace: str | None = typer.Option(None, help="JSONL trace (prompt_tokens, output_tokens, arrival)."),
    workload: str = typer.Option("sharegpt", help="Generator when no --trace: sharegpt, alpaca or tiny."),
    requests: int = typer.Option(300, help="Generated requests."),
    arrival: str = typer.Option("burst", help="burst or poisson."),
    rate: float | None = typer.Option(None, help="Requests/s for poisson arrivals."),
    max_new_tokens: int | None = typer.Option(None, help="Client cap (default: the workload's)."),
    seed: int = typer.Option(0),
    max_prefill_tokens: int = typer.Option(4096, help="The router's max_batch_prefill_tokens."),
    num_blocks: int | None = typer.Option(None, help="TGI_PAGED_NUM_BLOCKS cap."),
    kv_budget_bytes: int | None = typer.Option(None, help="Use this KV budget instead of the memory arithmetic."),
    overcommits: str = typer.Option("1.5,2,3,4,6,8,12,16", help="Overcommits to simulate (comma separated)."),
    host_cache_gb: float | None = typer.Option(
        None, help="TGI_PAGED_HOST_CACHE_GB: estimate the prefix tokens and hit rate a host KV tier this size adds."
    ),
    json_out: str | None = typer.Option(None, "--json", help="Also write the plan as JSON to this file."),
) -> None:
    """Capacity plan: bytes per token, pool size, expected concurrency and waste, advised overcommit."""
    from tgi_paged_backend.planning.plan_report import format_plan  # lazy: torch, the simulator
    from tgi_paged_backend.planning.planner import plan_from_args

    try:
        ocs = [float(x) for x in overcommits.split(",") if x.strip()]
        result = plan_from_args(
            model=model,
            gpu=gpu,
            memory_gb=memory_gb,
            memory_fraction=memory_fraction,
            block_size=block_size,
            dtype=dtype,
            kv_dtype=kv_dtype,
            trace_path=trace,
            workload=workload,
            requests=requests,
            arrival=arrival,
            rate=rate,
            max_new_tokens=max_new_tokens,
            seed=seed,
            max_prefill_tokens=max_prefill_tokens,
            num_blocks=num_blocks,
            kv_budget_bytes=kv_budget_bytes,
            overcommits=ocs,
            quantize=quantize,
            bits=bits,
            group_size=group_size,
            num_shard=num_shard,
            host_cache_gb=host_cache_gb,
        )
    except (ValueError, KeyError, OSError) as err:  # ConfigError is a ValueError
        typer.echo(f"plan: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(format_plan(result))
    if json_out:
        import json

        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result.to_dict(), indent=2, default=str))
        typer.echo(f"wrote {json_out}")


# -------------------------------------------------------------------------------------------------


def _check_supported(config: BackendConfig) -> None:
    """Refuse launcher options the engine does not implement, naming the option and the way out."""
    model = config.model
    if model.quantize is not None and model.quantize not in SUPPORTED_QUANTIZE:
        raise ConfigError(quantize_refusal(model.quantize))
    if model.dtype is not None and model.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"--dtype={model.dtype!r} is invalid: allowed {', '.join(SUPPORTED_DTYPES)}")
    parse_lora_adapters(model.lora_adapters)  # a bad entry stops here, before any model is loaded


def _engine_factory():
    """``engine.build_engine``, or the test override named by ``TGI_PAGED_ENGINE_FACTORY``."""
    override = envs.engine_factory_override()
    if override is not None:
        module, _, attr = override.partition(":")
        logger.warning(f"Using engine factory {override} (TGI_PAGED_ENGINE_FACTORY, for tests)")
        return getattr(importlib.import_module(module), attr)
    from tgi_paged_backend.engine import build_engine  # lazy: pulls in torch and the model code

    return build_engine


_HF_TRANSFER_FLAG = "HF_HUB_ENABLE_HF_TRANSFER"
"""``huggingface_hub.constants`` flag of hub versions before 1.0 (absent from later ones)."""


def _snapshot_download(model_id: str, revision: str | None) -> str:
    from huggingface_hub import constants, snapshot_download

    # The launcher sets HF_HUB_ENABLE_HF_TRANSFER=1; hub versions that honour it fail without the
    # hf_transfer package, so fall back to plain downloads when it is missing. huggingface_hub >= 1.0
    # has no such constant (hf_xet replaced hf_transfer): read and write it only where it exists.
    if getattr(constants, _HF_TRANSFER_FLAG, False) and importlib.util.find_spec("hf_transfer") is None:
        logger.info("hf_transfer is not installed: using plain downloads")
        setattr(constants, _HF_TRANSFER_FLAG, False)
    logger.info(f"Downloading {model_id} ({', '.join(DOWNLOAD_PATTERNS)})")
    return snapshot_download(repo_id=model_id, revision=revision, allow_patterns=DOWNLOAD_PATTERNS)


def _exec_stock_server(argv: list[str], json_output: bool) -> NoReturn:
    """Replace this process by TGI's own ``text_generation_server.cli`` with the same arguments."""
    if importlib.util.find_spec("text_generation_server") is None:
        _fail("TGI_BACKEND=stock, but TGI's text_generation_server package is not installed", json_output)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(sys.executable, [sys.executable, "-m", "text_generation_server.cli", *argv])


def _fail(message: str, json_output: bool) -> NoReturn:
    """Report a fatal error as one log line (JSON when asked) and exit 1."""
    setup_logging("INFO", json_output)
    logger.error(message)
    raise typer.Exit(1)


if __name__ == "__main__":
    app()
