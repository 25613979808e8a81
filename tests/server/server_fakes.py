"""A scriptable fake ShardEngine and an in-process server runner for the server tests.

The fake is also the engine of CLI subprocess tests: ``TGI_PAGED_ENGINE_FACTORY=server_fakes:build_fake_engine``
with this folder on ``PYTHONPATH``.

Prompt texts steer the fake: ``raise:internal``, ``raise:invalid``, ``sleep:<seconds>``,
``bad:is_special``. Requests with ``max_new_tokens == 1`` finish in their first step.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tgi_paged_backend.config import BackendConfig, ModelConfig, ServerConfig
from tgi_paged_backend.engine.types import (
    BatchNotFoundError,
    BatchSpec,
    CachedBatchInfo,
    FinishReason,
    GeneratedText,
    Generation,
    InfoResult,
    InvalidRequestError,
    RequestSpec,
    StepResult,
    Tokens,
    WarmupResult,
)


@dataclass
class _Live:
    spec: RequestSpec
    generated: int = 0


@dataclass
class FakeEngine:
    block_size: int = 16
    window_size: int | None = None
    broken: bool = False
    max_tokens_override: int | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    batches: dict[int, list[_Live]] = field(default_factory=dict)
    active: int = 0
    max_active: int = 0
    closed: bool = False
    _guard: threading.Lock = field(default_factory=threading.Lock)

    # -- ShardEngine --------------------------------------------------------------------------

    def info(self) -> InfoResult:
        self._record("info", None)
        return InfoResult(
            requires_padding=False,
            dtype="torch.float32",
            device_type="cpu",
            window_size=self.window_size,
            speculate=0,
            support_chunking=True,
            use_prefix_caching=True,
            attention_impl="paged",
            block_size=self.block_size,
        )

    def warmup(
        self, batch: BatchSpec, *, max_input_tokens: int | None, max_prefill_tokens: int, max_total_tokens: int | None
    ) -> WarmupResult:
        self._record(
            "warmup",
            dict(
                batch=batch,
                max_input_tokens=max_input_tokens,
                max_prefill_tokens=max_prefill_tokens,
                max_total_tokens=max_total_tokens,
            ),
        )
        return WarmupResult(
            max_supported_total_tokens=100_000,
            max_input_tokens=max_input_tokens if max_input_tokens is not None else 4095,
            max_total_tokens=max_total_tokens if max_total_tokens is not None else 4096,
        )

    def prefill(self, batch: BatchSpec, cached_batch_id: int | None) -> StepResult:
        with self._busy():
            self._record("prefill", dict(batch=batch, cached_batch_id=cached_batch_id))
            for request in batch.requests:
                self._steer(request.text)
            live = [_Live(r) for r in batch.requests]
            batch_id = batch.id
            if cached_batch_id is not None:
                if cached_batch_id not in self.batches:
                    raise BatchNotFoundError(f"Batch ID {cached_batch_id} not found in cache.")
                live = self.batches.pop(cached_batch_id) + live
                batch_id = cached_batch_id
            result = self._step(batch_id, live, prefill=True)
            if cached_batch_id is not None:
                result = StepResult(
                    generations=result.generations,
                    batch=result.batch,
                    forward_ns=result.forward_ns,
                    decode_ns=result.decode_ns,
                    concat_ns=1234,
                )
            return result

    def decode(self, batch_ids: list[int]) -> StepResult:
        with self._busy():
            self._record("decode", list(batch_ids))
            missing = [i for i in batch_ids if i not in self.batches]
            if missing:
                raise BatchNotFoundError(f"Batch ID {missing[0]} not found in cache.")
            live = [r for i in batch_ids for r in self.batches.pop(i)]
            return self._step(batch_ids[0], live, prefill=False)

    def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatchInfo:
        self._record("filter_batch", (batch_id, list(request_ids)))
        if batch_id not in self.batches:
            raise BatchNotFoundError(f"Batch ID {batch_id} not found in cache.")
        keep = set(request_ids)
        self.batches[batch_id] = [r for r in self.batches[batch_id] if r.spec.id in keep]
        return self._cached(batch_id, self.batches[batch_id])

    def release_batches(self, batch_ids: list[int]) -> None:
        self._record("release_batches", list(batch_ids))
        for batch_id in batch_ids:
            self.batches.pop(batch_id, None)

    def clear_cache(self, batch_id: int | None) -> None:
        self._record("clear_cache", batch_id)
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    def health(self) -> None:
        self._record("health", None)
        if self.broken:
            raise RuntimeError("device is broken")

    def close(self) -> None:
        self.closed = True

    # -- helpers ------------------------------------------------------------------------------

    def calls_named(self, name: str) -> list[Any]:
        return [args for n, args in self.calls if n == name]

    def _record(self, name: str, args: Any) -> None:
        self.calls.append((name, args))

    def _busy(self):
        engine = self

        class _Busy:
            def __enter__(self) -> None:
                with engine._guard:
                    engine.active += 1
                    engine.max_active = max(engine.max_active, engine.active)

            def __exit__(self, *exc: object) -> None:
                with engine._guard:
                    engine.active -= 1

        return _Busy()

    @staticmethod
    def _steer(text: str) -> None:
        if text == "raise:internal":
            raise RuntimeError("boom: the device caught fire")
        if text == "raise:invalid":
            raise InvalidRequestError("prompt is longer than the reserved slots")
        if text.startswith("sleep:"):
            time.sleep(float(text.split(":", 1)[1]))

    def _step(self, batch_id: int, live: list[_Live], *, prefill: bool) -> StepResult:
        generations = []
        for r in live:
            r.generated += 1
            spec = r.spec
            token = Tokens(ids=[100 + r.generated], logprobs=[-0.5], texts=[f"t{r.generated}"], is_special=[False])
            if spec.text == "bad:is_special":
                token = Tokens(ids=[1], logprobs=[-0.5], texts=["x"], is_special=[])
            done = None
            if r.generated >= spec.stopping.max_new_tokens:
                sampled = spec.sampling.is_sampling
                done = GeneratedText(
                    text=f"out{spec.id}",
                    generated_tokens=r.generated,
                    finish_reason=FinishReason.LENGTH if sampled else FinishReason.EOS_TOKEN,
                    seed=spec.sampling.seed if sampled else None,
                )
            prefill_tokens = None
            if prefill and r.generated == 1 and spec.prefill_logprobs:
                prefill_tokens = Tokens(ids=[1, 2], logprobs=[math.nan, -1.25], texts=["a", "b"], is_special=[])
            top = [
                Tokens(ids=[7, 8], logprobs=[-0.25, -2.0], texts=["x", "y"], is_special=[False, True])
                for _ in range(1 if spec.top_n_tokens else 0)
            ]
            generations.append(
                Generation(
                    request_id=spec.id, tokens=token, prefill_tokens=prefill_tokens, generated_text=done, top_tokens=top
                )
            )
        if all(r.generated >= r.spec.stopping.max_new_tokens for r in live):
            return StepResult(generations=generations, batch=None, forward_ns=11, decode_ns=22)
        self.batches[batch_id] = live
        return StepResult(generations=generations, batch=self._cached(batch_id, live), forward_ns=11, decode_ns=22)

    def _cached(self, batch_id: int, live: list[_Live]) -> CachedBatchInfo:
        max_tokens = self.max_tokens_override
        if max_tokens is None:
            max_tokens = sum(len(r.spec.slots) for r in live)
        return CachedBatchInfo(
            id=batch_id, request_ids=[r.spec.id for r in live], max_tokens=max_tokens, current_tokens=len(live)
        )


def make_config(uds_path: str, *, rank: int = 0, world_size: int = 1) -> BackendConfig:
    return BackendConfig(
        model=ModelConfig(model_id="fake/model"),
        server=ServerConfig(uds_path=uds_path, rank=rank, world_size=world_size),
    )


def build_fake_engine(config: BackendConfig) -> FakeEngine:
    """Engine factory for CLI tests; ``FAKE_ENGINE_FAIL_BUILD=1`` (test env) makes it fail."""
    if os.environ.get("FAKE_ENGINE_FAIL_BUILD"):
        raise RuntimeError("fake engine: model weights are corrupt")
    return FakeEngine(block_size=config.cache.block_size)


class InProcessShard:
    """Runs ``grpc_server.serve`` on its own thread and event loop."""

    def __init__(self, config: BackendConfig, engine: FakeEngine) -> None:
        self.config = config
        self.engine = engine
        self.socket_path = f"{os.path.abspath(config.server.uds_path)}-{config.server.rank}"
        self.exit_code: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="test-shard", daemon=True)

    def start(self, timeout: float = 10.0) -> InProcessShard:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket_path):
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("in-process shard did not create its socket")
            time.sleep(0.01)
        return self

    def stop(self) -> int | None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        return self.exit_code

    def _main(self) -> None:
        from tgi_paged_backend.server import grpc_server

        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            return await grpc_server.serve(self.config, lambda _: self.engine, stop=self._stop, grace_s=1.0)

        self.exit_code = asyncio.run(main())
