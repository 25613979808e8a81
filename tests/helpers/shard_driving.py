"""Driving a spawned shard through the router replay: router traffic, HF greedy references.

Shared by the single-rank end-to-end tests and the tensor-parallel tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from integration.router_replay import GenerateParameters, Router
from integration.router_replay.datatypes import FinalEvent
from tests.helpers.tiny_models import load_reference


def hf_greedy(model_dir: Path, prompts: list[str], max_new: int) -> list[list[int]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ref = load_reference(model_dir)
    out = []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        gen = ref.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


async def run_requests(router: Router, prompts: list[str], max_new: int) -> list[list[int]]:
    async def one(text: str) -> list[int]:
        stream = await router.generate(text, GenerateParameters(max_new_tokens=max_new, ignore_eos_token=True))
        events = await stream.collect()
        assert isinstance(events[-1], FinalEvent) and events[-1].generated_tokens == max_new
        return [e.id for e in events if hasattr(e, "id")]

    return list(await asyncio.gather(*(one(p) for p in prompts)))
