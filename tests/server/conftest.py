"""Fixtures for the gRPC server tests: a fake engine served in-process on a short unix socket path."""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from loguru import logger
from server_fakes import FakeEngine, InProcessShard, make_config

from tgi_paged_backend import logging_setup
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: unix socket paths are limited to ~107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="tgis-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def shard(short_dir: Path, engine: FakeEngine) -> Iterator[InProcessShard]:
    running = InProcessShard(make_config(str(short_dir / "shard")), engine).start()
    yield running
    running.stop()


@pytest.fixture
def stub(shard: InProcessShard) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(f"unix://{shard.socket_path}") as channel:
        yield pb_grpc.TextGenerationServiceStub(channel)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo ``setup_logging``: loguru sinks, stdlib root handlers, warnings capture, stdout redirection."""
    root = logging.getLogger()
    handlers, level, stdout = root.handlers[:], root.level, sys.stdout
    yield
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message))  # whatever stderr is at write time
    root.handlers, root.level = handlers, level
    logging.captureWarnings(False)
    sys.stdout = stdout
    logging_setup._real_stdout = None
