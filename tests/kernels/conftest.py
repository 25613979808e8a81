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
def _seed_and_one_thread():
    """Same random state for every test, and one intra-op thread while it runs.

    These tests do thousands of tiny tensor ops (references loop per head, the interpreter per
    program). On a shared 2-core machine, waking a second OpenMP thread for each costs more than
    the op: measured 130 ms vs 5 ms per reference call.
    """
    torch.manual_seed(20)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def native():
    """The native C++ CPU kernels (``tgi_paged_kernels.cpu_native``); the test is skipped without a compiler."""
    import tgi_paged_kernels.cpu_native as cpu_native

    kernels = cpu_native.native_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the native kernels cannot build")
    return kernels
