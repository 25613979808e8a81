"""Serve through the Triton launchers on CPU tensors (``TRITON_INTERPRET=1``, set by the root conftest).

The model runner calls the public kernel functions of ``tgi_paged_kernels``; :func:`route_to_triton`
swaps them for the ``_launch_*`` Triton launchers (which CUDA serving reaches) and records each call,
so the code path that serves on CUDA runs inside the model end to end. Keyword arguments a launcher
does not take (the CPU decode's per-step ``gather`` plan) are dropped.
"""

from __future__ import annotations

import inspect

import pytest

LAUNCHERS = ("_launch_store_kv", "_launch_paged_decode", "_launch_paged_prefill")


def route_to_triton(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch store / decode / prefill to their Triton launchers; returns the list the calls go to."""
    import tgi_paged_kernels
    from tgi_paged_kernels.kv_store import _launch_store_kv
    from tgi_paged_kernels.paged_decode import _launch_paged_decode
    from tgi_paged_kernels.paged_prefill import _launch_paged_prefill

    calls: list[str] = []
    for public, launch in (
        ("store_kv", _launch_store_kv),
        ("paged_decode_attention", _launch_paged_decode),
        ("paged_prefill_attention", _launch_paged_prefill),
    ):
        accepted = set(inspect.signature(launch).parameters)

        def run(*args, _launch=launch, _accepted=accepted, **kwargs):
            calls.append(_launch.__name__)
            return _launch(*args, **{k: v for k, v in kwargs.items() if k in _accepted})

        monkeypatch.setattr(tgi_paged_kernels, public, run)
    return calls
