"""The package stands alone: the wheel built from this checkout, installed (not editable) into a
fresh venv and run from outside the checkout, starts its console scripts, imports every module it
ships, plans from a preset, and never imports the repository's harness (``integration``, ``tests``,
``examples``).

The fresh venv takes its third-party dependencies from this interpreter's site-packages through a
plain path entry (no ``.pth`` of this environment runs there, so the editable install of the
checkout is invisible): only the package itself comes from the wheel.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers.project_files import ROOT

HARNESS = {"integration", "tests", "examples"}
IMPORT_ALL = """
import importlib, pkgutil, sys
import tgi_paged_backend, tgi_paged_kernels
names = []
for pkg in (tgi_paged_backend, tgi_paged_kernels):
    assert pkg.__file__.startswith(sys.prefix), pkg.__file__
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
leaked = sorted({m.split(".")[0] for m in sys.modules} & {"integration", "tests", "examples"})
assert not leaked, leaked
print(len(names))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(wheel, venv, env) with the wheel installed into a fresh venv."""
    work = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(work / "dist"),
            str(ROOT),
        ],
        cwd=work,
        env=env,
    )
    wheel = next((work / "dist").glob("tgi_paged_backend-*.whl"))
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, env=env)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        cwd=work,
        env=env,
    )
    site = Path(
        _run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            cwd=work,
            env=env,
        ).stdout.strip()
    )
    (site / "_dependencies_from_test_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return wheel, venv, env


def test_wheel_ships_only_the_package(installed) -> None:
    wheel, _, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert tops == {"tgi_paged_backend", "tgi_paged_kernels"}
        assert "tgi_paged_backend/server/pb/generate.proto" in names
        for name in names:
            if name.endswith(".py"):
                tree = ast.parse(archive.read(name))
                for node in ast.walk(tree):
                    mods = (
                        [a.name for a in node.names]
                        if isinstance(node, ast.Import)
                        else [node.module]
                        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        else []
                    )
                    bad = {m.split(".")[0] for m in mods} & HARNESS
                    assert not bad, f"{name} imports {bad}"


def test_installed_wheel_runs_from_outside_the_checkout(installed, tmp_path: Path) -> None:
    _, venv, env = installed
    python = str(venv / "bin" / "python")
    count = int(_run([python, "-c", IMPORT_ALL], cwd=tmp_path, env=env).stdout.strip())
    assert count > 40  # every module of both packages, not an empty walk
    assert "serve" in _run([str(venv / "bin" / "text-generation-server"), "--help"], cwd=tmp_path, env=env).stdout
    assert "--gpu" in _run([str(venv / "bin" / "tgi-paged-backend"), "plan", "--help"], cwd=tmp_path, env=env).stdout
    plan = _run(
        [
            str(venv / "bin" / "tgi-paged-backend"),
            "plan",
            "--model",
            "smollm2-135m",
            "--gpu",
            "cpu",
            "--memory-gb",
            "1",
            "--requests",
            "20",
            "--overcommits",
            "2,6",
        ],
        cwd=tmp_path,
        env=env,
    ).stdout
    assert "TGI_PAGED_OVERCOMMIT=" in plan
    # The --backend wrapper: validates before it looks for the real launcher (none here).
    wrapper = subprocess.run(
        [str(venv / "bin" / "text-generation-launcher"), "--backend", "bogus"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrapper.returncode == 2 and "--backend" in wrapper.stderr, wrapper.stderr
