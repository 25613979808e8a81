"""A faithful Python replay of the stock TGI v3 router's side of the gRPC conversation.

The stock Rust router cannot run here; shard tests and the HTTP stand-in drive a shard through this
instead. Behaviour follows ``backends/v3/src/{lib.rs, backend.rs, queue.rs, block_allocator.rs,
radix.rs, client/*}`` and ``router/src/{infer/mod.rs, validation.rs}`` as documented in
``tgi-router-contract.md`` (no code was copied; the replay is written from the behaviour).

Usage::

    router = await Router.connect("/tmp/text-generation-server", "/models/smollm2")
    stream = await router.generate("Hello", GenerateParameters(max_new_tokens=8))
    async for event in stream:          # PrefillEvent?, TokenEvent..., FinalEvent
        ...
    healthy = await router.health()
    await router.close()                # re-raises a RouterFatalError, if one happened

Shard mistakes that would kill the stock batching task, and contract violations it would let
through, raise ``RouterFatalError`` (from every pending stream, from ``generate``/``health``, and
from ``close``). ``FakeShard`` (``fake_shard``) is a minimal in-process shard for tests.
"""

from .allocator import BlockAllocation, SimpleAllocator
from .datatypes import (
    FinalEvent,
    GenerateParameters,
    PrefillEvent,
    PrefillToken,
    StreamEvent,
    Token,
    TokenEvent,
)
from .errors import (
    ClientVisibleError,
    GenerationError,
    IncompleteGenerationError,
    OverloadedError,
    RouterFatalError,
    RouterReplayError,
    RouterStartupError,
    ValidationError,
)
from .grammar import SchemaGrammar
from .info import RouterInfo, RouterStats
from .radix import RadixAllocator
from .router import Router
from .stream import GenerationStream

__all__ = [
    "BlockAllocation",
    "ClientVisibleError",
    "FinalEvent",
    "GenerateParameters",
    "GenerationError",
    "GenerationStream",
    "IncompleteGenerationError",
    "OverloadedError",
    "PrefillEvent",
    "PrefillToken",
    "RadixAllocator",
    "Router",
    "RouterFatalError",
    "RouterInfo",
    "RouterReplayError",
    "RouterStartupError",
    "RouterStats",
    "SchemaGrammar",
    "SimpleAllocator",
    "StreamEvent",
    "Token",
    "TokenEvent",
    "ValidationError",
]
