"""The HTTP API over the router replay over in-process fake shards (for fast client tests).

::

    with fake_http_stack(FakeShardConfig(eos_after=5)) as stack:
        text_generation.Client(stack.base_url).generate("hi")
        stack.shards[0].methods()   # the gRPC calls the router made

Everything (fake shards, router, uvicorn) runs on one background loop, so synchronous clients can be
used from the calling thread. ``stack.set_gate(method, open=False)`` holds every later call of a shard
method until the gate is opened again (deterministic mid-stream drills).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from integration.router_replay.fake_shard import CharTokenizer, FakeShard, FakeShardConfig, fake_shards

from .generation import ApiConfig
from .serving import BackgroundLoop, HttpStack


class ChatCharTokenizer(CharTokenizer):
    """``CharTokenizer`` with a minimal chat template: ``<role>content`` per message, ``<assistant>`` last."""

    chat_template = "<role>content"

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool = False, add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeHttpStack:
    def __init__(self, stack: HttpStack, shards: list[FakeShard], loop: BackgroundLoop) -> None:
        self.stack = stack
        self.shards = shards
        self.loop = loop
        self._gates: dict[str, asyncio.Event] = {}

    @property
    def base_url(self) -> str:
        return self.stack.base_url

    @property
    def router(self) -> Any:
        return self.stack.router

    def set_gate(self, method: str, *, open: bool) -> None:
        """Close (hold later calls of ``method`` on every shard) or open the gate."""

        async def apply() -> None:
            gate = self._gates.get(method)
            if gate is None:
                gate = self._gates[method] = asyncio.Event()
                gate.set()
                for shard in self.shards:
                    shard.pause[method] = gate
            gate.set() if open else gate.clear()

        self.loop.run(apply())


@contextlib.contextmanager
def fake_http_stack(
    config: FakeShardConfig | None = None,
    *,
    world_size: int = 1,
    tokenizer: Any = None,
    api_config: ApiConfig | None = None,
    router_kwargs: dict[str, Any] | None = None,
    app_kwargs: dict[str, Any] | None = None,
) -> Iterator[FakeHttpStack]:
    tokenizer = tokenizer if tokenizer is not None else ChatCharTokenizer()
    with BackgroundLoop() as loop:
        shards_cm = fake_shards(config, world_size=world_size, tokenizer=tokenizer)
        shards = loop.run(shards_cm.__aenter__())
        try:
            stack = HttpStack(
                shards[0].uds_base_path,
                tokenizer,
                loop=loop,
                config=api_config or ApiConfig(model_id="fake/model"),
                router_kwargs=router_kwargs,
                app_kwargs=app_kwargs,
            )
            with stack:
                fake = FakeHttpStack(stack, shards, loop)
                try:
                    yield fake
                finally:
                    for method in list(fake._gates):
                        fake.set_gate(method, open=True)
        finally:
            loop.run(shards_cm.__aexit__(None, None, None))
