"""Launcher-exact spawn against a stub ``text-generation-server`` placed first on PATH."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from integration.launcher_spawn import (
    DownloadError,
    LaunchedShards,
    LauncherOptions,
    ShardCannotStart,
    download_weights,
    lora_downloads,
    parse_log_line,
    resolve_attention,
    rust_f32,
)

STUB = r"""#!{python}
import json, os, signal, socket, stat, sys, time

env = dict(os.environ)
record = {"argv": sys.argv[1:], "env": env, "pid": os.getpid(), "pgid": os.getpgid(0),
          "stdin_fifo": stat.S_ISFIFO(os.fstat(0).st_mode)}
with open(os.path.join(env["STUB_DIR"], "record-" + env.get("RANK", "dl") + ".json"), "w") as fh:
    json.dump(record, fh)

def log(text, level="INFO"):
    sys.stdout.write(json.dumps({"text": text, "record": {"level": {"name": level}}}) + "\n")
    sys.stdout.flush()

if sys.argv[1] == "download-weights":
    log("downloading  ")
    sys.stderr.write("download stderr\n")
    sys.exit(int(env.get("STUB_DOWNLOAD_EXIT", "0")))

if env.get("STUB_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(int(env.get("STUB_TERM_EXIT", "0"))))

log("starting rank " + env["RANK"] + "   \n")
log("careful", "WARNING")
log("not a loguru level", "WARN")
print("plain print output", flush=True)
sys.stdout.write(json.dumps({"text": "no record"}) + "\n")
sys.stdout.write(json.dumps({"text": "x" * 40000, "record": {"level": {"name": "INFO"}}}) + "\n")
sys.stdout.flush()
sys.stderr.write("stderr line 1\nstderr line 2\n")
sys.stderr.flush()
if env.get("STUB_EXIT_EARLY"):
    sys.exit(int(env["STUB_EXIT_EARLY"]))
time.sleep(float(env.get("STUB_READY_DELAY", "0")))
uds = sys.argv[sys.argv.index("--uds-path") + 1] + "-" + env["RANK"]
server = socket.socket(socket.AF_UNIX)
server.bind(uds)
server.listen(1)
log("ready", "SUCCESS")
while True:
    time.sleep(0.05)
"""


@pytest.fixture()
def stub_dir(monkeypatch):
    directory = tempfile.mkdtemp(prefix="ls", dir="/tmp")
    script = Path(directory) / "text-generation-server"
    script.write_text(STUB.replace("{python}", sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("SECRET_NOT_INHERITED", "1")
    return directory


def _opts(stub_dir, **kw) -> LauncherOptions:
    env = {"STUB_DIR": stub_dir, "LOG_LEVEL": "debug", **kw.pop("env", {})}
    return LauncherOptions(uds_path=os.path.join(stub_dir, "tgs"), env=env, **kw)


def _record(stub_dir, rank) -> dict:
    return json.loads(Path(stub_dir, f"record-{rank}.json").read_text())


def test_argv_env_logs_readiness_and_sigterm(stub_dir):
    Path(stub_dir, "tgs-0").write_text("stale")  # a stale socket file is deleted before the spawn
    opts = _opts(stub_dir, env={"STUB_READY_DELAY": "0.3", "STUB_TERM_EXIT": "3"}, max_input_tokens=100,
                 max_total_tokens=200, speculate=2, dtype="bfloat16", revision="main", trust_remote_code=True,
                 cuda_memory_fraction=0.9)  # fmt: skip
    started = time.monotonic()
    with LaunchedShards("/models/none", opts, ready_timeout=20) as shards:
        assert time.monotonic() - started >= 0.3
        assert shards.socket_paths == [os.path.join(stub_dir, "tgs-0")]
        rec = _record(stub_dir, 0)
        assert rec["argv"] == [
            "serve", "/models/none", "--uds-path", opts.uds_path, "--logger-level", "INFO", "--json-output",
            "--trust-remote-code", "--speculate", "2", "--dtype", "bfloat16", "--revision", "main",
            "--otlp-service-name", "text-generation-inference.router", "--max-input-tokens", "100",
        ]  # fmt: skip
        env = rec["env"]
        expected = {
            "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
            "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "CUDA_MEMORY_FRACTION": "0.9", "SAFETENSORS_FAST_GPU": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_ENABLE_HF_TRANSFER": "1", "MAX_TOTAL_TOKENS": "200",
            "CUDA_GRAPHS": "1,2,4,8,16,32", "ATTENTION": "flashinfer", "PREFIX_CACHING": "true",
            "STUB_DIR": stub_dir, "STUB_READY_DELAY": "0.3", "STUB_TERM_EXIT": "3",
        }  # fmt: skip
        # env_clear(): nothing else but what the launcher itself had (PATH, HOME), minus LOG_LEVEL.
        extra = set(env) - set(expected) - {"PATH", "HOME"}
        assert extra <= {"PWD", "SHLVL", "_", "LC_CTYPE"}, extra  # a shell may add these; python does not
        assert {k: env[k] for k in expected} == expected
        assert "LOG_LEVEL" not in env and "SECRET_NOT_INHERITED" not in env
        assert env["PATH"].startswith(stub_dir)
        assert rec["pgid"] == rec["pid"] == shards.pid(0)  # its own process group
        assert rec["stdin_fifo"]  # stdin is a pipe
        deadline = time.monotonic() + 5
        while not any(r.level == "SUCCESS" for r in shards.logs) and time.monotonic() < deadline:
            time.sleep(0.02)
        texts = [(r.level, r.launcher_level, r.text) for r in shards.logs]
        assert texts == [("INFO", "info", "starting rank 0"), ("WARNING", "warn", "careful"),
                         ("SUCCESS", "info", "ready")]  # fmt: skip
        assert all(r.rank == 0 for r in shards.logs)
        # WARN level, a print(), a record-less object and the 40 KiB line split across 32 KiB reads.
        assert shards.unparseable[0] >= 5
    assert shards.exit_codes == {0: 3} and not shards.killed
    assert shards.stderr[0] == "stderr line 1\nstderr line 2"


def test_two_ranks_and_sigkill_escalation(stub_dir):
    opts = _opts(stub_dir, env={"STUB_IGNORE_TERM": "1"}, num_shard=2, graceful_termination_timeout=0.4)
    shards = LaunchedShards("/models/none", opts, ready_timeout=20)
    shards.start()
    try:
        assert all(os.path.exists(p) for p in shards.socket_paths)
        for rank in (0, 1):
            rec = _record(stub_dir, rank)
            assert "--sharded" in rec["argv"] and rec["env"]["WORLD_SIZE"] == "2" and rec["env"]["RANK"] == str(rank)
        assert shards.crashed() == []
    finally:
        started = time.monotonic()
        codes = shards.terminate()
    assert codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL} and shards.killed == {0, 1}
    assert 0.4 <= time.monotonic() - started < 5  # both ranks shut down concurrently


def test_shard_exiting_before_ready_fails_with_stderr(stub_dir):
    opts = _opts(stub_dir, env={"STUB_EXIT_EARLY": "7"})
    with pytest.raises(ShardCannotStart) as caught:
        LaunchedShards("/models/none", opts, ready_timeout=20).start()
    assert caught.value.exit_code == 7 and "stderr line 2" in caught.value.stderr


def test_download_weights_argv_env_and_failure(stub_dir):
    opts = _opts(stub_dir, env={"HF_API_TOKEN": "tok"}, huggingface_hub_cache="/cache")
    result = download_weights("org/model", opts, revision="r1")
    rec = _record(stub_dir, "dl")
    assert rec["argv"] == ["download-weights", "org/model", "--extension", ".safetensors", "--logger-level", "INFO",
                           "--json-output", "--merge-lora", "--revision", "r1"]  # fmt: skip
    assert rec["env"]["HF_TOKEN"] == "tok" and rec["env"]["HUGGINGFACE_HUB_CACHE"] == "/cache"
    assert "RANK" not in rec["env"] and "LOG_LEVEL" not in rec["env"]
    assert result.exit_code == 0 and [r.text for r in result.logs] == ["downloading"]
    bad = _opts(stub_dir, env={"STUB_DOWNLOAD_EXIT": "2"})
    with pytest.raises(DownloadError, match="download stderr"):
        download_weights("org/model", bad, merge_lora=False)


def test_pure_helpers(tmp_path):
    assert [rust_f32(v) for v in (1.0, 0.9, 0.85, 2.5)] == ["1", "0.9", "0.85", "2.5"]
    ok = b'{"text": "hi \\n", "record": {"level": {"name": "CRITICAL"}, "extra": 1}, "more": 2}'
    assert parse_log_line(ok, 1).text == "hi" and parse_log_line(ok).launcher_level == "error"
    for bad in (b"", b"{}", b'{"text": 1, "record": {"level": {"name": "INFO"}}}',
                b'{"text": "a", "record": {"level": {"name": "info"}}}', b'{"text": NaN}'):  # fmt: skip
        assert parse_log_line(bad) is None
    cfg = {"hidden_size": 576, "num_attention_heads": 9}
    assert resolve_attention(cfg, {}) == ("true", "flashinfer")
    assert resolve_attention({"hidden_size": 100, "num_attention_heads": 10}, {}) == ("0", "paged")
    assert resolve_attention({"hidden_size": 100, "num_attention_heads": 10}, {}, compute_capability=(9, 0)) == (
        "0", "flashdecoding")  # fmt: skip
    assert resolve_attention({**cfg, "vision_config": {}}, {}) == ("0", "flashinfer")
    assert resolve_attention(cfg, {"ATTENTION": "paged"}) == ("0", "paged")
    assert resolve_attention(cfg, {"PREFIX_CACHING": "1", "ATTENTION": "paged"}) == ("1", "paged")
    assert resolve_attention(None, {}) == ("true", "flashinfer")
    assert lora_downloads("a/b, c/d@rev ,e=/local") == [("a/b", None), ("c/d", "rev")]
    with pytest.raises(ValueError):
        lora_downloads("x@1@2")
