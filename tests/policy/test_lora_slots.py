"""At most ``max_loras`` distinct adapters per step; the base model never counts."""

from __future__ import annotations

import pytest

from tgi_paged_backend.policy.lora_slots import may_run_adapter


@pytest.mark.parametrize(
    ("adapter", "running", "max_loras", "allowed"),
    [
        (0, set(), 0, True),  # base model: always, even with no adapter slot
        (0, {1, 2}, 2, True),
        (3, {1, 2, 4, 5}, None, True),  # no bound
        (2, {1, 2}, 2, True),  # already running: no new slot needed
        (1, set(), 1, True),
        (3, {1}, 2, True),  # one slot left
        (3, {1, 2}, 2, False),  # bound reached
        (1, set(), 0, False),
        (2, {1}, 1, False),
    ],
)
def test_may_run_adapter(adapter: int, running: set[int], max_loras: int | None, allowed: bool) -> None:
    assert may_run_adapter(adapter, frozenset(running), max_loras) is allowed
