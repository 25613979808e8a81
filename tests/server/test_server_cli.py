"""``text-generation-server`` as the launcher runs it: argv, JSON logs on stdout, readiness, SIGTERM, exit codes.

The CLI runs in a subprocess (``python -m tgi_paged_backend.cli``) on the fake engine, selected with the
test-only ``TGI_PAGED_ENGINE_FACTORY`` knob.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAUNCHER_LEVELS = {"TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"}


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TGI_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    env["TGI_PAGED_ENGINE_FACTORY"] = "server_fakes:build_fake_engine"
    env.update(extra)
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tgi_paged_backend.cli", *args]


def launcher_lines(stdout: str) -> list[tuple[str, str]]:
    """Parse stdout the way the launcher does: every line one JSON object with `text` and `record.level.name`."""
    parsed = []
    for line in stdout.splitlines():
        obj = json.loads(line)
        level = obj["record"]["level"]["name"]
        assert isinstance(obj["text"], str) and level in LAUNCHER_LEVELS, line
        assert len(line.encode()) < 32 * 1024
        parsed.append((level, obj["text"]))
    return parsed


def serve_argv(uds: Path, level: str, *extra: str) -> list[str]:
    # The launcher's order: serve MODEL --uds-path --logger-level --json-output [...] --otlp-service-name
    return cli(
        "serve",
        "fake/model",
        "--uds-path",
        str(uds),
        "--logger-level",
        level,
        "--json-output",
        "--trust-remote-code",
        *extra,
        "--otlp-service-name",
        "text-generation-inference.router",
    )


def wait_for_socket(proc: subprocess.Popen, path: Path, timeout: float = 90.0) -> None:
    # A liveness deadline, not a timing check: three shards importing torch at once on 2 busy cores took ~9 s
    # beside a pip install and over 20 s under a full suite's load on a slow host.
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"shard exited with {proc.returncode} before readiness:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"shard did not create its socket within {timeout:.0f} s")
        time.sleep(0.05)


def test_serve_until_sigterm_at_each_launcher_level(short_dir: Path) -> None:
    """Three shards at once (INFO, WARN, OFF): ready, serving, errors survive, SIGTERM -> exit 0, socket gone."""
    shards = {}
    for level in ("INFO", "WARN", "OFF"):
        uds = short_dir / f"tgs-{level}"
        argv = serve_argv(
            uds, level, "--merge-lora", "--from-the-future", "--max-input-tokens", "100", "--revision", "main"
        )
        proc = subprocess.Popen(argv, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        shards[level] = (proc, Path(f"{uds}-0"))
    try:
        for proc, socket in shards.values():
            wait_for_socket(proc, socket)
            with grpc.insecure_channel(f"unix://{socket}") as channel:
                stub = pb_grpc.TextGenerationServiceStub(channel)
                assert list(stub.ServiceDiscovery(pb.ServiceDiscoveryRequest()).urls) == [f"unix://{socket}"]
                assert stub.Info(pb.InfoRequest()).block_size == 16
                with pytest.raises(grpc.RpcError) as error:  # an engine error is logged, the shard stays up
                    stub.Prefill(
                        pb.PrefillRequest(batch=pb.Batch(id=1, requests=[pb.Request(id=1, inputs="raise:internal")]))
                    )
                assert error.value.code() == grpc.StatusCode.INTERNAL
                stub.Health(pb.HealthRequest())
            proc.send_signal(signal.SIGTERM)
        results = {level: proc.communicate(timeout=15) for level, (proc, _) in shards.items()}
    finally:
        for proc, _ in shards.values():
            if proc.poll() is None:
                proc.kill()

    for level, (out, err) in results.items():
        proc, socket = shards[level]
        assert proc.returncode == 0, (level, err)
        assert not socket.exists(), level
        lines = launcher_lines(out)
        levels = {lvl for lvl, _ in lines}
        texts = "\n".join(text for _, text in lines)
        if level == "OFF":
            assert lines == []
            continue
        if level == "WARN":
            assert levels == {"WARNING", "ERROR"}
        else:
            assert "Server started at unix://" in texts and "Received SIGTERM" in texts
        assert "--from-the-future" in texts  # unknown option: warned, not fatal
        assert "boom: the device caught fire" in texts and "Traceback" in texts  # INTERNAL, logged with traceback


BAD_CONFIGS = [
    ((), {"TGI_PAGED_BLOCK_SIZE": "7"}, "TGI_PAGED_BLOCK_SIZE"),
    ((), {"TGI_PAGED_PREEMPTION": "sometimes"}, "TGI_PAGED_PREEMPTION"),
    ((), {"CUDA_MEMORY_FRACTION": "2"}, "CUDA_MEMORY_FRACTION"),
    ((), {"TGI_BACKEND": "fast"}, "TGI_BACKEND"),
    (
        ("--quantize", "eetq"),
        {},
        "--quantize eetq is not supported by tgi-paged-backend: supported fp8, compressed-tensors, gptq, awq",
    ),
    (("--quantize", "exl2"), {}, "--quantize exl2 is not supported"),
    (("--speculate", "-1"), {}, "--speculate=-1 is invalid"),
    (("--dtype", "int8"), {}, "--dtype"),
    (("--kv-cache-dtype", "fp4"), {}, "kv_cache_dtype"),
    (("--logger-level", "LOUD"), {}, "--logger-level"),
    (("--sharded",), {}, "--sharded"),
    # A malformed LORA_ADAPTERS entry stops the shard before any model is loaded, naming the entry.
    ((), {"LORA_ADAPTERS": "org/a,x=y=z"}, "LORA_ADAPTERS entry 'x=y=z' is invalid"),
    (("--lora-adapters", "a,,b"), {}, "LORA_ADAPTERS entry '' is invalid"),
    ((), {"WEIGHTS_CACHE_OVERRIDE": "/nonexistent/repository"}, "WEIGHTS_CACHE_OVERRIDE='/nonexistent/repository'"),
    ((), {"ROPE_SCALING": "yarn"}, "ROPE_SCALING='yarn' is invalid: allowed one of linear, dynamic"),
]


@pytest.mark.parametrize("extra_args, extra_env, named", BAD_CONFIGS)
def test_bad_config_exits_1_with_one_clear_line(
    short_dir: Path, monkeypatch, restore_logging, extra_args, extra_env, named
) -> None:
    """In-process through Typer's runner (fast); the subprocess variant below checks the real process."""
    from typer.testing import CliRunner

    from tgi_paged_backend.cli import app

    argv = [*serve_argv(short_dir / "s", "INFO")[3:], *extra_args]
    monkeypatch.setattr(sys, "argv", ["text-generation-server", *argv])
    env = {k: None for k in os.environ if k.startswith(("TGI_", "RANK", "WORLD_SIZE", "CUDA_MEMORY"))}
    result = CliRunner().invoke(app, argv, env={**env, **extra_env})
    assert result.exit_code == 1, result.output
    lines = launcher_lines(result.stdout)
    assert len(lines) == 1 and lines[0][0] == "ERROR" and named in lines[0][1], lines
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_bad_config_in_a_real_process(short_dir: Path) -> None:
    result = subprocess.run(
        [*serve_argv(short_dir / "s", "INFO"), "--dtype", "int8"],
        env=cli_env(TGI_PAGED_WATERMARK="1.5"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    ((level, text),) = launcher_lines(result.stdout)
    assert level == "ERROR" and "TGI_PAGED_WATERMARK" in text
    assert "Traceback" not in result.stderr


def test_engine_build_failure_exits_1_without_socket(short_dir: Path) -> None:
    result = subprocess.run(
        serve_argv(short_dir / "s", "INFO"),
        env=cli_env(FAKE_ENGINE_FAIL_BUILD="1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    errors = [text for level, text in launcher_lines(result.stdout) if level == "ERROR"]
    assert errors and "model weights are corrupt" in errors[0]
    assert not Path(f"{short_dir / 's'}-0").exists()


def test_download_weights_local_dir_passes_through(short_dir: Path) -> None:
    (short_dir / "model.safetensors").write_bytes(b"")
    result = subprocess.run(
        cli(
            "download-weights",
            str(short_dir),
            "--extension",
            ".safetensors",
            "--logger-level",
            "INFO",
            "--json-output",
            "--merge-lora",
            "--trust-remote-code",
        ),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert any("local directory" in text for _, text in launcher_lines(result.stdout))


def test_download_weights_unreachable_hub_fails_clearly(short_dir: Path) -> None:
    result = subprocess.run(
        cli(
            "download-weights",
            "no-such-org/no-such-model",
            "--extension",
            ".safetensors",
            "--logger-level",
            "INFO",
            "--json-output",
            "--revision",
            "v1",
        ),
        env=cli_env(HF_HUB_OFFLINE="1", HF_HOME=str(short_dir / "hf")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    errors = [text for level, text in launcher_lines(result.stdout) if level == "ERROR"]
    assert len(errors) == 1 and "Could not download no-such-org/no-such-model (revision v1)" in errors[0]


def test_download_weights_with_weights_cache_override_downloads_nothing(short_dir: Path) -> None:
    repository = short_dir / "repository"
    repository.mkdir()
    (repository / "model.safetensors").write_bytes(b"")
    (repository / "config.json").write_text("{}")
    argv = cli(
        "download-weights",
        "org/model",
        "--extension",
        ".safetensors",
        "--logger-level",
        "INFO",
        "--json-output",
        "--merge-lora",
    )
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(short_dir / "hf")}
    result = subprocess.run(
        argv, env=cli_env(WEIGHTS_CACHE_OVERRIDE=str(repository), **offline), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert any("nothing to download" in text for _, text in launcher_lines(result.stdout))
    missing = subprocess.run(
        argv,
        env=cli_env(WEIGHTS_CACHE_OVERRIDE=str(short_dir / "nope"), **offline),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 1
    ((level, text),) = launcher_lines(missing.stdout)
    assert level == "ERROR" and "WEIGHTS_CACHE_OVERRIDE=" in text and "not a directory" in text


def test_stock_backend_execs_tgi_server_with_same_argv(short_dir: Path) -> None:
    package = short_dir / "text_generation_server"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    argv = [
        "serve",
        "org/model",
        "--uds-path",
        "/tmp/x",
        "--logger-level",
        "INFO",
        "--json-output",
        "--quantize",
        "awq",
    ]
    env = cli_env(TGI_BACKEND="stock")
    env["PYTHONPATH"] = os.pathsep.join([str(short_dir), env["PYTHONPATH"]])
    result = subprocess.run(cli(*argv), env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == argv


def test_stock_backend_without_tgi_installed_fails_clearly() -> None:
    result = subprocess.run(
        cli("serve", "org/model", "--json-output"),
        env=cli_env(TGI_BACKEND="stock"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    ((level, text),) = launcher_lines(result.stdout)
    assert level == "ERROR" and "text_generation_server" in text
