"""Log output the TGI launcher can read.

With ``--json-output`` the launcher parses every stdout line as JSON and needs two keys: a
top-level ``text`` and ``record.level.name`` (one of TRACE, DEBUG, INFO, SUCCESS, WARNING,
ERROR, CRITICAL). Lines that do not parse are dropped, and it reads stdout in chunks of at most
32 KiB, so each record is written as one flushed line well below that size. stderr is only
shown after the process exits.

Records pass the filter when they come from our own packages (``OWN_PREFIXES``) or carry the
``own`` extra (``logger.bind(own=True)``). Standard-library ``logging`` and ``warnings`` are
routed through loguru: our own stdlib loggers at their level, third-party ones from WARNING up.
In JSON mode ``sys.stdout`` is pointed at stderr, so stray ``print`` output cannot corrupt the
stream.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TYPE_CHECKING, Any, TextIO

from loguru import logger

if TYPE_CHECKING:
    from loguru import Record

from tgi_paged_backend.envs import LOGGER_LEVELS

OWN_PREFIXES: tuple[str, ...] = ("tgi_paged_backend", "tgi_paged_kernels")
"""Module-name prefixes whose records are always ours."""

MAX_LINE_BYTES = 16 * 1024
"""Upper bound for one JSON line (the launcher reads 32 KiB chunks)."""

THIRD_PARTY_MIN_LEVEL = logging.WARNING
"""Third-party stdlib records below this level are dropped."""

_real_stdout: TextIO | None = None
"""The process's stdout once ``sys.stdout`` has been pointed at stderr (later setups keep logging there)."""

_TRUNCATION_MARK = "\n...[{} characters truncated]...\n"


def normalize_level(level: str) -> str:
    """Map a launcher level (``WARN``, ``OFF``, any case) to a loguru level name or ``OFF``."""
    upper = str(level).strip().upper()
    if upper == "SUCCESS":
        return upper
    if upper not in LOGGER_LEVELS:
        raise ValueError(f"--logger-level={level!r} is invalid: allowed {sorted(LOGGER_LEVELS)}")
    return LOGGER_LEVELS[upper]


def setup_logging(
    level: str = "INFO", json_output: bool = False, *, stream: TextIO | None = None, redirect_stdout: bool = False
) -> None:
    """Replace every loguru sink by one that writes to ``stream`` (default: stdout).

    ``level`` may be a launcher name (``WARN``, ``OFF``). ``redirect_stdout`` (the CLI sets it in
    JSON mode) points ``sys.stdout`` at stderr after capturing the real stdout for the sink.
    """
    global _real_stdout
    level = normalize_level(level)
    out = stream if stream is not None else (_real_stdout or sys.stdout)
    logger.remove()
    if level != "OFF":
        if json_output:
            logger.add(
                _JsonSink(out),
                level=level,
                filter=_is_ours,
                format="{message}",
                backtrace=True,
                diagnose=False,
                catch=True,
            )
        else:
            logger.add(
                out,
                level=level,
                filter=_is_ours,
                backtrace=True,
                diagnose=False,
                catch=True,
                format="{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | {name}:{line} - {message}",
            )
    _route_stdlib_logging()
    if json_output and redirect_stdout and _real_stdout is None:
        _real_stdout = sys.stdout
        sys.stdout = sys.stderr


def _is_ours(record: Record) -> bool:
    if record["extra"].get("own"):
        return True
    name = record["name"] or ""
    return any(name == p or name.startswith(p + ".") for p in OWN_PREFIXES)


def truncate_text(text: str, max_chars: int) -> str:
    """Keep the head and the (more informative) tail of a long text, with a marker in between."""
    if len(text) <= max_chars:
        return text
    mark = _TRUNCATION_MARK.format(len(text) - max_chars)
    head = max_chars // 4
    tail = max_chars - head
    return text[:head] + mark + text[-tail:]


class _JsonSink:
    """One JSON object per record, one line, flushed; never longer than ``MAX_LINE_BYTES``."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def __call__(self, message: Any) -> None:
        record = message.record
        text = str(message).rstrip()
        max_chars = MAX_LINE_BYTES // 2
        while True:
            line = self._line(record, truncate_text(text, max_chars))
            if len(line.encode("utf-8")) <= MAX_LINE_BYTES or max_chars < 64:
                break
            max_chars //= 2
        self._stream.write(line + "\n")
        self._stream.flush()

    @staticmethod
    def _line(record: dict[str, Any], text: str) -> str:
        payload = {
            "text": text,
            "record": {
                "level": {"name": record["level"].name, "no": record["level"].no},
                "name": record["name"],
                "function": record["function"],
                "line": record["line"],
                "time": {"repr": str(record["time"]), "timestamp": record["time"].timestamp()},
                "process": {"id": record["process"].id},
                "thread": {"name": record["thread"].name},
            },
        }
        return json.dumps(payload, ensure_ascii=False, default=str)


class _InterceptHandler(logging.Handler):
    """Forward standard-library records (including ``warnings``) to loguru."""

    def emit(self, record: logging.LogRecord) -> None:
        ours = any(record.name == p or record.name.startswith(p + ".") for p in OWN_PREFIXES)
        if not ours and record.levelno < THIRD_PARTY_MIN_LEVEL:
            return
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        text = record.getMessage()
        if record.name != "py.warnings":
            text = f"[{record.name}] {text}"
        logger.bind(own=True).opt(exception=record.exc_info).log(level, text)


def _route_stdlib_logging() -> None:
    handler = _InterceptHandler()
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(THIRD_PARTY_MIN_LEVEL)
    for prefix in OWN_PREFIXES:
        logging.getLogger(prefix).setLevel(logging.DEBUG)
    logging.captureWarnings(True)
