"""The launcher-facing log format: JSON lines with `text` and `record.level.name`, filtered to our records."""

from __future__ import annotations

import io
import json
import logging
import warnings

import pytest
from loguru import logger

from tgi_paged_backend import logging_setup
from tgi_paged_backend.logging_setup import normalize_level, setup_logging


def parse(stream: io.StringIO) -> list[dict]:
    lines = stream.getvalue().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    "given, expected",
    [
        ("WARN", "WARNING"),
        ("warn", "WARNING"),
        ("OFF", "OFF"),
        ("INFO", "INFO"),
        ("TRACE", "TRACE"),
        ("ERROR", "ERROR"),
    ],
)
def test_launcher_level_names_map_to_loguru(given: str, expected: str) -> None:
    assert normalize_level(given) == expected


def test_unknown_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="--logger-level"):
        normalize_level("LOUD")


def test_json_lines_filter_and_truncation(restore_logging) -> None:
    out = io.StringIO()
    setup_logging("DEBUG", json_output=True, stream=out)
    ours = logger.patch(lambda r: r.update(name="tgi_paged_backend.engine.scheduler"))
    foreign = logger.patch(lambda r: r.update(name="some_library.module"))

    ours.debug("step done")
    foreign.warning("not ours: dropped")
    logger.bind(own=True).success("explicitly ours")
    ours.info("x" * 200_000)
    try:
        raise RuntimeError("kaboom")
    except RuntimeError:
        ours.exception("step failed")
    logging.getLogger("tgi_paged_backend.runner").debug("stdlib, ours")
    logging.getLogger("urllib3").info("third-party chatter: dropped")
    logging.getLogger("urllib3").warning("third-party warning: kept")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)

    records = parse(out)
    texts = [r["text"] for r in records]
    levels = [r["record"]["level"]["name"] for r in records]
    assert texts[0] == "step done" and levels[0] == "DEBUG"
    assert not any("dropped" in t for t in texts)
    assert texts[1] == "explicitly ours" and levels[1] == "SUCCESS"
    assert "characters truncated" in texts[2] and texts[2].startswith("xxx") and texts[2].endswith("xxx")
    assert texts[3].startswith("step failed") and "Traceback" in texts[3] and "RuntimeError: kaboom" in texts[3]
    assert levels[3] == "ERROR"
    assert texts[4] == "[tgi_paged_backend.runner] stdlib, ours"
    assert texts[5] == "[urllib3] third-party warning: kept" and levels[5] == "WARNING"
    assert "deprecated thing" in texts[6] and levels[6] == "WARNING"
    assert len(records) == 7
    for line in out.getvalue().splitlines():
        assert len(line.encode()) <= logging_setup.MAX_LINE_BYTES


def test_level_filter_and_off(restore_logging) -> None:
    out = io.StringIO()
    setup_logging("WARN", json_output=True, stream=out)
    logger.bind(own=True).info("hidden")
    logger.bind(own=True).warning("shown")
    assert [r["record"]["level"]["name"] for r in parse(out)] == ["WARNING"]

    out = io.StringIO()
    setup_logging("OFF", json_output=True, stream=out)
    logger.bind(own=True).critical("nothing at all")
    logging.getLogger("urllib3").error("nor this")
    assert out.getvalue() == ""


def test_multibyte_text_stays_under_the_line_limit(restore_logging) -> None:
    out = io.StringIO()
    setup_logging("INFO", json_output=True, stream=out)
    logger.bind(own=True).info("\U0001f600" * 50_000 + '"\\\n' * 10_000)
    (line,) = out.getvalue().splitlines()
    assert len(line.encode()) <= logging_setup.MAX_LINE_BYTES
    assert json.loads(line)["record"]["level"]["name"] == "INFO"
