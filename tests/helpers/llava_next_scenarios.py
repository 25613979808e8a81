"""LLaVA-NeXT served the way the v3 router drives it, with images: the scenarios of the family matrix's
columns (one image; images batched with text-only requests; chunked prefill cutting inside images;
recompute and swap preemption; ``--speculate 3`` with oracle drafts under preemption), each run on a fresh
engine over the tiny checkpoint of :mod:`tests.helpers.llava_next_models` and compared with HF ``generate``
on the same images (``tests/engine/test_shard_engine_llava_next.py`` asserts more on the same runs; the matrix renders
LLaVA-NeXT's row of ``docs/models.md`` from :func:`run_matrix_scenarios`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, make_text, router_warmup
from tests.helpers.llava_next_models import LlavaNextReference, png_bytes
from tests.helpers.speculation_oracle import oracle_drafts
from tgi_paged_backend.engine.types import BatchSpec, ImageInput, RequestSpec, StoppingParams

RED, GREEN, WIDE, SQUARE = png_bytes(40, 24, 1), png_bytes(40, 24, 2), png_bytes(24, 64, 3), png_bytes(32, 32, 4)
"""RED and GREEN: the same size (the same placeholders), other pixels; WIDE, SQUARE: other shapes."""


@dataclass
class ScenarioRun:
    """One scenario after it ran: the engine, the router's view, the requests, the image encodes."""

    engine: Any
    driver: RouterDriver
    specs: list[RequestSpec]
    encodes: list[int] = field(default_factory=list)
    """Images per call of the encoder, in order."""


def image_spec(engine: Any, blocks: RouterBlocks | None, rid: int, parts: Sequence[Any], max_new: int = 8,
               **kw: Any) -> RequestSpec:  # fmt: skip
    """A request whose chunks are ``parts`` (text, or PNG bytes for an image); with ``blocks``, the router's
    reservation for its prompt (the engine's own count: the router's rule is exact for LLaVA-NeXT)."""
    chunks = tuple(ImageInput(p, "image/png") if isinstance(p, bytes) else p for p in parts)
    spec = RequestSpec(
        id=rid,
        text="".join(c for c in chunks if isinstance(c, str)),
        truncate=10_000,
        chunks=chunks if any(isinstance(c, ImageInput) for c in chunks) else (),
        stopping=StoppingParams(max_new_tokens=max_new, ignore_eos_token=True),
        **kw,
    )
    if blocks is None:
        return spec
    got = blocks.allocate(len(engine.image_prompts.encode(spec)[0]) + max_new - 1)
    assert got is not None, "router virtual pool exhausted"
    return RequestSpec(**{**{f.name: getattr(spec, f.name) for f in fields(spec)}, "blocks": got[0], "slots": got[1]})


def counting_encodes(engine: Any) -> list[int]:
    """Record the number of images of every call of the engine's image encoder."""
    encoder = engine.runner.image_encoder
    calls: list[int] = []
    plain = encoder.encode

    def encode(images: Any) -> Any:
        calls.append(len(images))
        return plain(images)

    encoder.encode = encode
    return calls


def mismatches(run: ScenarioRun, reference: Any) -> list[int]:
    """Requests whose tokens differ from HF ``generate`` on the same prompt ids and images."""
    bad = []
    for spec in run.specs:
        ids, _ = run.engine.image_prompts.encode(spec)
        images = [c.data for c in spec.chunks if isinstance(c, ImageInput)]
        if run.driver.tokens[spec.id] != reference.greedy(ids, images, spec.stopping.max_new_tokens):
            bad.append(spec.id)
    return bad


def _started(model_dir: Path, prefill_tokens: int | None, **engine_kw: Any) -> ScenarioRun:
    engine = make_engine(model_dir, **engine_kw)
    if prefill_tokens is not None:
        router_warmup(engine, prefill_tokens)
    blocks = RouterBlocks(engine) if prefill_tokens is not None else None
    return ScenarioRun(engine, RouterDriver(engine, blocks), [], counting_encodes(engine))


def single(model_dir: Path) -> ScenarioRun:
    """One request with one image between text."""
    run = _started(model_dir, None, num_blocks=32)
    run.specs = [image_spec(run.engine, None, 1, ["the fox ", RED, " is quick"])]
    run.driver.run(BatchSpec(id=1, requests=tuple(run.specs)))
    return run


def mixed_batch(model_dir: Path) -> ScenarioRun:
    """Text-only requests and requests with one and two images in one batch."""
    run = _started(model_dir, 256, num_blocks=64)
    blocks = run.driver.blocks
    run.specs = [
        image_spec(run.engine, blocks, 10, [make_text(10, 6)], 10),
        image_spec(run.engine, blocks, 11, ["look: ", WIDE, " and ", RED, make_text(11, 3)], 10),
        image_spec(run.engine, blocks, 12, [make_text(12, 4)], 6),
        image_spec(run.engine, blocks, 13, [GREEN, " what is it?"], 9),
    ]
    run.driver.run(BatchSpec(id=2, requests=tuple(run.specs)))
    return run


def chunked_prefill(model_dir: Path, *, then: Any = None) -> ScenarioRun:
    """The router's ``chunk_len`` of 11 cuts the first of two adjacent images; ``then(run)`` runs after the
    first chunk (checks), before the rest of the prefill and the decode."""
    run = _started(model_dir, 256, num_blocks=64)
    run.specs = [image_spec(run.engine, run.driver.blocks, 20, ["the fox ", WIDE, RED, " is quick"], 6, chunk_len=11)]
    batch = run.driver.prefill(BatchSpec(id=3, requests=tuple(run.specs)))
    if then is not None:
        then(run)
    run.driver.drain(batch)
    return run


def preemption(model_dir: Path, mode: str, *, reference: Any = None) -> ScenarioRun:
    """Four prompts (three with an image) that fill the pool exactly at the first step, 16 new tokens each:
    every block an older request needs while decoding comes from a younger one (``mode``: recompute or swap).
    With ``reference``: ``--speculate 3``, drafts from an oracle of its tokens (a wrong one planted every third
    draft, :mod:`tests.helpers.speculation_oracle`), as the matrix's speculate scenario."""
    parts = [[make_text(40, 2), RED], [make_text(41, 9)], [GREEN, make_text(42, 2)], ["a ", SQUARE, "."]]
    sizer = make_engine(model_dir, num_blocks=8)
    lengths = [len(sizer.image_prompts.encode(image_spec(sizer, None, 0, p))[0]) for p in parts]
    prompt_blocks = sum(-(-n // 8) for n in lengths)
    # One page map (Gemma 3's sliding layers would otherwise hold fewer blocks than the prompts: no pool to fill)
    run = _started(model_dir, prompt_blocks * 8, num_blocks=prompt_blocks + 1, block_size=8, preemption=mode,
                   TGI_PAGED_OVERCOMMIT="3", PREFIX_CACHING="0", speculate=3 if reference else 0,
                   TGI_PAGED_LAYER_GROUPS="0")  # fmt: skip
    run.specs = [image_spec(run.engine, run.driver.blocks, 40 + i, p, 16) for i, p in enumerate(parts)]
    truth = [] if reference is None else [_truth(run.engine, reference, spec) for spec in run.specs]
    with oracle_drafts(truth) if reference is not None else contextlib.nullcontext():
        batch = run.driver.prefill(BatchSpec(id=5, requests=tuple(run.specs)))
        assert run.engine.kv.num_free_blocks == 0, "the prompts must fill the pool"
        run.driver.drain(batch)
    return run


def _truth(engine: Any, reference: Any, spec: RequestSpec) -> list[int]:
    """The prompt ids and HF's tokens after them (the oracle's drafts)."""
    ids, _ = engine.image_prompts.encode(spec)
    images = [c.data for c in spec.chunks if isinstance(c, ImageInput)]
    return [*ids, *reference.greedy(ids, images, spec.stopping.max_new_tokens)]


def run_matrix_scenarios(model_dir: Path, reference_class: Any = LlavaNextReference) -> tuple[dict[str, bool], Any]:
    """The matrix's scenario -> token-exact, and a runner of the model (for its CPU decode mark); HF's tokens
    from ``reference_class(model_dir)`` (another family's reference: the scenarios are family-agnostic)."""
    reference = reference_class(model_dir)
    runs = {
        "single": single(model_dir),
        "mixed_batch": mixed_batch(model_dir),
        "chunked_prefill": chunked_prefill(model_dir),
        "preempt_recompute": preemption(model_dir, "recompute"),
        "preempt_swap": preemption(model_dir, "swap"),
        "speculate": preemption(model_dir, "recompute", reference=reference),
    }
    exact = {name: not mismatches(run, reference) for name, run in runs.items()}
    exact["speculate"] &= runs["speculate"].engine.stats.accepted_tokens > 0
    exact["preempt_recompute"] &= runs["preempt_recompute"].engine.stats.preemptions["recompute"] > 0
    exact["preempt_swap"] &= runs["preempt_swap"].engine.stats.preemptions["swap"] > 0
    return exact, runs["single"].engine.runner
