"""The wheel layout: every package folder is listed, and no import name of the package is shadowed
by, or shadows, a PyPI package when the repository root is on ``sys.path``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.project_files import ROOT, pyproject

PACKAGES = ("tgi_paged_backend", "tgi_paged_kernels")
# PyPI projects whose import names collide with a folder name a repository like this one might
# use at its root: transformers probes `kernels` (huggingface's kernel hub), and `examples` is a
# PyPI project too. The package's own import names must be none of these.
KNOWN_PYPI_IMPORT_NAMES = {"kernels", "examples", "tests", "integration", "benchmarks", "docs", "scripts"}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for top in PACKAGES:
        for dirpath, _, files in os.walk(ROOT / top):
            if "__init__.py" in files:
                found.add(".".join(Path(dirpath).relative_to(ROOT).parts))
    assert found == listed
    assert "package-dir" not in pyproject()["tool"]["setuptools"], "import names must equal folder names"


def test_kernels_import_under_unambiguous_name() -> None:
    module = importlib.import_module("tgi_paged_kernels")
    assert Path(module.__file__).parent == ROOT / "tgi_paged_kernels"


def test_no_root_folder_is_a_regular_package_named_like_a_pypi_project() -> None:
    """A root folder with ``__init__.py`` wins over site-packages when the root is on sys.path."""
    clashes = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} & KNOWN_PYPI_IMPORT_NAMES
    # `integration` is the test harness (never shipped); it is a regular package on purpose.
    assert clashes <= {"integration"}, clashes


def test_package_names_are_not_provided_by_another_distribution() -> None:
    from importlib.metadata import packages_distributions

    providers = packages_distributions()
    for name in PACKAGES:
        assert set(providers.get(name, [])) <= {"tgi-paged-backend", "tgi_paged_backend"}, (name, providers[name])
        assert name not in KNOWN_PYPI_IMPORT_NAMES


def test_transformers_imports_with_the_repository_root_first_on_sys_path(tmp_path: Path) -> None:
    """What bit once: a root `kernels/` folder shadowed the PyPI `kernels` that transformers probes."""
    code = "import transformers; from transformers import LlamaConfig; LlamaConfig(); print('ok')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
