"""The GPU check's plumbing without a GPU: scripts parse, the bundle installer picks wheels for this
Python, and ``integration.gpu_check --cpu`` serves the tiny model through the launcher spawn and
router replay token-identical to HF (about 30 s on a busy 2-core machine), then runs phase d's decode
timing with the static step eagerly (no graphs on CPU). The CUDA phases run only on a device
(``docs/performance.md``, "GPU check")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from integration.gpu_bundle_install import runs_here
from tests.helpers.project_files import ROOT


@pytest.mark.parametrize("script", ["scripts/gpu_check.sh", "scripts/build_gpu_bundle.sh"])
def test_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def test_installer_matches_wheel_tags_to_this_python() -> None:
    minor = sys.version_info.minor
    assert runs_here("py3", "none") and runs_here(f"cp3{minor}", f"cp3{minor}")
    assert runs_here("cp310", "abi3") and not runs_here(f"cp3{minor + 1}", f"cp3{minor + 1}")
    assert not runs_here(f"cp3{minor + 1}", "abi3") and not runs_here("pp310", "pypy310_pp73")


def test_cpu_mode_serves_token_identical_to_hf() -> None:
    bin_dir = os.path.dirname(sys.executable)  # text-generation-server, as the launcher finds it
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "integration.gpu_check",
            "--cpu",
            "--requests",
            "4",
            "--max-new-tokens",
            "8",
            "--budget-s",
            "150",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "wave 1: 4/4 sequences identical to HF" in out and "wave 2: 4/4 sequences identical to HF" in out, out
    assert "d. decode ITL at batch 3, context 24" in out and "6/6 steps through the static step" in out, out
    assert "identical tokens" in out and "GPU check: serve PASS, graphs PASS" in out, out
