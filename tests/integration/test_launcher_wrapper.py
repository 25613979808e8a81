"""The ``text-generation-launcher`` wrapper (``tgi_paged_backend.launcher_wrapper``) in front of a stand-in launcher.

Two ``bin/`` folders on ``PATH``, in the TGI image's order: first the wrapper (written exactly like the
console script pip/uv install into ``/usr/src/.venv/bin``), then a stand-in for the real Rust launcher
that records its argv, its start-up environment (``/proc/self/environ``, untouched by Python's locale
coercion), its pid and the signals it gets, and exits with a chosen code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WRAPPER = f"""#!{sys.executable}
# -*- coding: utf-8 -*-
import re
import sys
from tgi_paged_backend.launcher_wrapper import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""

STAND_IN = f"""#!{sys.executable}
import json, os, signal, sys, time

def record(entry):
    with open(os.environ["STANDIN_RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\\n")

if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
    print("Text Generation Launcher\\n\\nUsage: text-generation-launcher [OPTIONS]\\n\\nOptions:\\n"
          "      --model-id <MODEL_ID>\\n          [env: MODEL_ID=]")
    record({{"help": sys.argv[1:]}})
    sys.exit(0)

def on_signal(sig, frame):
    record({{"signal": sig}})
    sys.exit(int(os.environ.get("STANDIN_EXIT_ON_SIGNAL", "0")))

signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
environ = dict(item.split("=", 1) for item in open("/proc/self/environ").read().split("\\0") if item)
record({{"argv": sys.argv, "env": environ, "pid": os.getpid()}})
if os.environ.get("STANDIN_WAIT"):
    while True:
        time.sleep(0.05)
sys.exit(int(os.environ.get("STANDIN_EXIT", "0")))
"""


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.wrapper_bin = tmp_path / "venv-bin"
        self.real_bin = tmp_path / "usr-local-bin"
        self.record = tmp_path / "record.jsonl"
        for folder, text in ((self.wrapper_bin, WRAPPER), (self.real_bin, STAND_IN)):
            folder.mkdir()
            script = folder / "text-generation-launcher"
            script.write_text(text)
            script.chmod(0o755)
        # A controlled environment (no locale variables: the C locale, where Python coerces LC_CTYPE).
        self.env = {
            "PATH": os.pathsep.join([str(self.wrapper_bin), str(self.real_bin), "/usr/bin", "/bin"]),
            "PYTHONPATH": str(ROOT),
            "STANDIN_RECORD": str(self.record),
            "HF_TOKEN": "hf_x y=z",
            "LOG_LEVEL": "info",
        }

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.wrapper_bin / "text-generation-launcher"), *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=30,
        )

    def records(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def launched(self) -> dict:
        (entry,) = [r for r in self.records() if "argv" in r]
        return entry


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


LAUNCH_ARGS = [
    "--model-id",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "--num-shard",
    "1",
    "--otlp-service-name",
    "a name with spaces",
    "--max-total-tokens=4096",
]


@pytest.mark.parametrize("flag", [["--backend", "paged"], ["--backend=paged"]], ids=["space", "equals"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flag_is_removed_exported_and_everything_else_passes_unchanged(setup: Setup, flag, where) -> None:
    position = {"first": 0, "middle": 2, "last": len(LAUNCH_ARGS)}[where]
    result = setup.run(*LAUNCH_ARGS[:position], *flag, *LAUNCH_ARGS[position:])
    assert result.returncode == 0, result.stderr
    launched = setup.launched()
    assert launched["argv"][1:] == LAUNCH_ARGS
    assert launched["env"] == {**setup.env, "TGI_BACKEND": "paged"}  # nothing added, nothing dropped


def test_flag_wins_over_tgi_backend(setup: Setup) -> None:
    assert setup.run("--backend", "stock", *LAUNCH_ARGS, TGI_BACKEND="paged").returncode == 0
    assert setup.launched()["env"]["TGI_BACKEND"] == "stock"


@pytest.mark.parametrize(
    ("env", "exported"),
    [
        ({}, "paged"),
        ({"TGI_BACKEND": "stock"}, "stock"),
        ({"TGI_BACKEND": " Stock "}, "stock"),
        ({"TGI_BACKEND": ""}, "paged"),
    ],
)
def test_without_the_flag_tgi_backend_decides(setup: Setup, env, exported) -> None:
    result = setup.run(*LAUNCH_ARGS, **env)
    assert result.returncode == 0, result.stderr
    assert setup.launched()["argv"][1:] == LAUNCH_ARGS
    assert setup.launched()["env"]["TGI_BACKEND"] == exported


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--backend", "vllm"], {}, "--backend='vllm' is invalid: allowed paged or stock"),
        (["--backend="], {}, "--backend='' is invalid: allowed paged or stock"),
        (["--backend"], {}, "--backend needs a value: allowed paged or stock"),
        (["--backend", "paged", "--backend=stock"], {}, "--backend was given more than once: allowed once"),
        ([], {"TGI_BACKEND": "fast"}, "TGI_BACKEND='fast' is invalid: allowed paged or stock"),
    ],
)
def test_bad_choice_exits_2_with_one_clear_line_and_never_launches(setup: Setup, args, env, named) -> None:
    result = setup.run(*LAUNCH_ARGS, *args, **env)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"text-generation-launcher: error: {named}"]
    assert setup.records() == []


def test_arguments_after_double_dash_are_not_touched(setup: Setup) -> None:
    assert setup.run("--backend", "stock", "--", "--backend", "x").returncode == 0
    assert setup.launched()["argv"][1:] == ["--", "--backend", "x"]


@pytest.mark.parametrize("code", [0, 1, 3])
def test_exit_code_is_the_launchers(setup: Setup, code: int) -> None:
    assert setup.run("--backend", "paged", STANDIN_EXIT=str(code)).returncode == code


def test_launcher_replaces_the_wrapper_and_gets_its_signals(setup: Setup) -> None:
    """exec, not a child: same pid, so SIGTERM from docker reaches the launcher, whose exit code is the result."""
    proc = subprocess.Popen(
        [str(setup.wrapper_bin / "text-generation-launcher"), "--backend", "stock", *LAUNCH_ARGS],
        env={**setup.env, "STANDIN_WAIT": "1", "STANDIN_EXIT_ON_SIGNAL": "7"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not any("argv" in r for r in setup.records()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        assert setup.launched()["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 7
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {"signal": signal.SIGTERM} in setup.records()


@pytest.mark.parametrize("help_flag", ["--help", "-h"])
def test_help_is_the_launchers_plus_one_backend_entry(setup: Setup, help_flag: str) -> None:
    result = setup.run("--backend", "stock", help_flag)
    assert result.returncode == 0, result.stderr
    own, _, added = result.stdout.partition("\n\n      --backend <BACKEND>\n")
    assert own.startswith("Text Generation Launcher") and "--model-id <MODEL_ID>" in own
    assert "paged (tgi-paged-backend) or stock" in added and "[env: TGI_BACKEND=]" in added
    assert result.stdout.count("--backend") == 1
    assert setup.records() == [{"help": [help_flag]}]  # --backend removed here too


def test_missing_real_launcher_is_reported_not_looped(setup: Setup, tmp_path: Path) -> None:
    """Only copies of the wrapper on PATH (two venvs): it must not exec itself."""
    other = tmp_path / "other-venv-bin"
    other.mkdir()
    (other / "text-generation-launcher").write_text(WRAPPER)
    (other / "text-generation-launcher").chmod(0o755)
    result = setup.run("--backend", "paged", PATH=os.pathsep.join([str(setup.wrapper_bin), str(other), "/bin"]))
    assert result.returncode == 127
    assert "TGI's own text-generation-launcher is not on PATH" in result.stderr
    assert setup.records() == []


@pytest.mark.parametrize(
    ("args", "env", "backend", "expected"),
    [
        (["--lora-adapters", "a=/x"], {}, "paged", b"1"),  # stock would turn it off: ours keys KV by adapter
        (["--lora-adapters=a=/x"], {}, "paged", b"1"),
        ([], {b"LORA_ADAPTERS": b"a=/x"}, "paged", b"1"),
        (["--lora-adapters", "a=/x"], {b"PREFIX_CACHING": b"0"}, "paged", b"0"),  # the user's choice wins
        (["--lora-adapters", "a=/x"], {}, "stock", None),  # TGI's own server: the launcher decides
        (["--model-id", "m"], {}, "paged", None),  # no adapters: untouched
        (["--", "--lora-adapters", "a=/x"], {}, "paged", None),  # after --: not the launcher's option
    ],
)
def test_prefix_caching_stays_on_with_lora_adapters(args, env, backend, expected) -> None:
    from tgi_paged_backend.launcher_wrapper import keep_prefix_caching_with_lora

    environ = dict(env)
    keep_prefix_caching_with_lora(args, environ, backend)
    assert environ.get(b"PREFIX_CACHING") == expected
