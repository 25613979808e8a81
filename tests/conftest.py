"""Test-suite wide setup (environment for the whole run, shared fixtures).

Triton decides at decoration time whether kernels run in its interpreter, so the switch must be set
before anything imports ``tgi_paged_kernels``; this root conftest is loaded first. Library code never
reads it: on CPU the public kernel functions dispatch to plain torch, and tests launch the Triton
kernels explicitly.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

# The launcher finds `text-generation-server` through PATH; put this interpreter's scripts folder
# (the venv's bin/) first so `.venv/bin/python -m pytest` works without an activated venv.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

# Session fixtures shared by every test folder (tiny models, the converted SmolLM2).
pytest_plugins = ["tests.helpers.fixtures"]


@pytest.fixture(autouse=True, scope="session")
def _pack_every_linear():
    """Tiny test models' linears are all below the packing threshold that serves real models
    (``fast_layers.PACK_MIN_ELEMENTS``); pack them all here so every family's token-exactness test runs
    through the packed oneDNN path too (in-process runners; spawned shards keep the real threshold)."""
    from tgi_paged_backend.runner.cpu import fast_layers

    saved = fast_layers.PACK_MIN_ELEMENTS
    fast_layers.PACK_MIN_ELEMENTS = 0
    yield
    fast_layers.PACK_MIN_ELEMENTS = saved
