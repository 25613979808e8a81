"""Test-suite wide setup.

Triton decides at decoration time whether kernels run in its interpreter, so the switch must be set
before anything imports ``tgi_paged_kernels``; this root conftest is loaded first. Library code never
reads it: on CPU the public kernel functions dispatch to plain torch, and tests launch the Triton
kernels explicitly.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# Session fixtures shared by every test folder (tiny models, the converted SmolLM2).
pytest_plugins = ["tests.helpers.fixtures"]
