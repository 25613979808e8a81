"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before any test
module imports ``tgi_paged_kernels`` (the root conftest sets it too; this keeps the folder
self-sufficient when run alone). Library code never reads the environment.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, whatever ran before it."""
    torch.manual_seed(20)
