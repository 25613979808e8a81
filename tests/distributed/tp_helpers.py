"""Prompts shared by the tensor-parallel tests (router driving lives in tests/helpers/shard_driving.py)."""

from __future__ import annotations

PROMPTS = [
    "hello world this is a test of the paged backend",
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven",
    "a",
    "some more text here to use for a longer prompt than the others in this batch",
    "paged attention splits the cache into blocks",
]
