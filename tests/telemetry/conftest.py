"""Fixtures for the telemetry tests: a real OTLP receiver, a short temporary directory."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_sink import OtlpSink


@pytest.fixture
def otlp_sink() -> Iterator[OtlpSink]:
    sink = OtlpSink()
    yield sink
    sink.stop()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: unix socket paths are limited to ~107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="tgit-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
