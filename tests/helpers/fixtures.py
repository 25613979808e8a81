"""Pytest plugin with session-scoped model fixtures.

Wire it from the root ``tests/conftest.py`` with ``pytest_plugins = ["tests.helpers.fixtures"]``
(or run ``pytest -p tests.helpers.fixtures``).

- ``tiny_model_factory(kind, seed=0, **config_overrides) -> Path``: a tiny random model directory
  (written once per argument set and session).
- ``tiny_llama_dir``, ``tiny_qwen2_dir``, ``tiny_mistral_dir``: the default tiny models.
- ``smollm2_dir``: SmolLM2-135M-Instruct converted to safetensors (downloaded and converted once,
  then cached in ``~/.cache/tgi-paged-backend``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tiny_models import write_tiny_model
from tgi_paged_backend.runner.cpu import fast_layers

SERVING_PACK_MIN_ELEMENTS = fast_layers.PACK_MIN_ELEMENTS
"""The packing threshold spawned shards serve with (read at import, before the suite lowers it to 0 for its
in-process runners: tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory of tiny model directories, cached per ``(kind, seed, overrides)``."""
    made: dict[tuple, Path] = {}

    def make(kind: str, seed: int = 0, **config_overrides: Any) -> Path:
        key = (kind, seed, tuple(sorted(config_overrides.items())))
        if key not in made:
            made[key] = write_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), seed=seed, **config_overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from integration.smollm2 import ensure_smollm2

    return ensure_smollm2()
