"""Test-suite wide setup (environment for the whole run, shared fixtures).

Triton decides at decoration time whether kernels run in its interpreter, so the switch must be set
before anything imports ``tgi_paged_kernels``; this root conftest is loaded first. Library code never
reads it: on CPU the public kernel functions dispatch to plain torch, and tests launch the Triton
kernels explicitly.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

# The launcher finds `text-generation-server` through PATH; put this interpreter's scripts folder
# (the venv's bin/) first so `.venv/bin/python -m pytest` works without an activated venv.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

# Session fixtures shared by every test folder (tiny models, the converted SmolLM2).
pytest_plugins = ["tests.helpers.fixtures"]
