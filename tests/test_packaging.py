"""The wheel layout: every package folder is listed, and kernels ship as `tgi_paged_kernels`."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"tgi_paged_kernels"}
    for dirpath, _, files in os.walk(ROOT / "tgi_paged_backend"):
        if "__init__.py" in files:
            found.add(".".join(Path(dirpath).relative_to(ROOT).parts))
    assert found == listed


def test_kernels_import_under_unambiguous_name() -> None:
    module = importlib.import_module("tgi_paged_kernels")
    assert Path(module.__file__).parent == ROOT / "kernels"
