"""Errors raised by the router replay.

Two families matter to callers:

* what a client of the stock router would see (validation, overload, a failed generation, an
  incomplete generation) — these carry the stock router's messages so an HTTP stand-in can reuse
  them verbatim;
* ``RouterFatalError``: a shard mistake that would panic the stock router's batching task (after
  which it silently never schedules again), or a contract violation the stock router would let
  through to clients. The replay makes every one of them loud.
"""

from __future__ import annotations


class RouterReplayError(Exception):
    """Base class of every error raised by the replay."""


class RouterStartupError(RouterReplayError):
    """The stock router would have exited (or panicked) during startup."""


class RouterFatalError(RouterReplayError):
    """A shard mistake that kills (or would silently corrupt) the stock router's batching task.

    ``condition`` is a short stable tag (e.g. ``"unknown_request_id"``) so tests can assert which
    rule fired; the message says what the shard sent.
    """

    def __init__(self, condition: str, message: str) -> None:
        super().__init__(f"[{condition}] {message}")
        self.condition = condition


class ClientVisibleError(RouterReplayError):
    """An error a client of the stock router receives; ``error_type`` is the stock JSON tag."""

    error_type = "generation"
    http_status = 500


class ValidationError(ClientVisibleError):
    """HTTP 422, ``error_type: validation``; ``str()`` has the stock ``Input validation error:`` prefix."""

    error_type = "validation"
    http_status = 422

    def __init__(self, detail: str) -> None:
        super().__init__(f"Input validation error: {detail}")
        self.detail = detail


class OverloadedError(ClientVisibleError):
    """HTTP 429: the ``max_concurrent_requests`` semaphore had no permit left (no waiting)."""

    error_type = "overloaded"
    http_status = 429

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class GenerationError(ClientVisibleError):
    """HTTP 424: the shard answered Prefill/Decode with a gRPC error."""

    error_type = "generation"
    http_status = 424

    def __init__(self, client_error: str) -> None:
        super().__init__(f"Request failed during generation: {client_error}")
        self.client_error = client_error


class IncompleteGenerationError(ClientVisibleError):
    """The request's stream ended without a final generation (HTTP 500 / stream error event)."""

    error_type = "incomplete_generation"
    http_status = 500

    def __init__(self) -> None:
        super().__init__("Incomplete generation")


def client_error_message(details: str | None) -> str:
    """The stock ``ClientError::Generation`` display: every gRPC status becomes ``Server error: <msg>``."""
    return f"Server error: {details or ''}"
