"""The family matrix: each family of :mod:`tests.helpers.family_models` served by the shard engine,
driven as the v3 router drives it, compared with HF ``generate`` (greedy) token for token.

Scenarios (:data:`SCENARIOS`), each on a fresh engine with router-style block reservations and the
contract checks of ``RouterDriver`` after every RPC:

- ``single``: one request;
- ``mixed_batch``: three requests of different prompt lengths and budgets in one batch;
- ``chunked_prefill``: a Warmup prefill budget of 16 tokens, a long prompt cut by the router's
  ``chunk_len`` and continued by the shard;
- ``preempt_recompute`` / ``preempt_swap``: a 32-token physical pool for three requests needing
  about 60, so the youngest requests are preempted (and the test asserts they were).

Sliding-window block reclaim: a family whose every layer is windowed (``ModelSpec.reclaim_window``)
must give blocks back in the preemption scenarios (histories of ~20 tokens under a window of 8); a
family mixing windowed and full layers keeps every block (one page map serves all layers).

A family the backend refuses is expected to stop at start with a ``ModelLoadError`` naming its
architecture. ``python -m tests.helpers.family_matrix --write docs/models.md`` runs the matrix
and writes the table (:func:`render_markdown`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
)
from tests.helpers.family_models import (
    FAMILIES,
    Family,
    family_config,
    is_available,
    num_kv_groups,
    write_family_model,
)
from tests.helpers.family_tp import TpOutcome, run_tp, tp_families
from tests.helpers.llava_next_scenarios import run_matrix_scenarios
from tests.helpers.speculation_oracle import oracle_drafts
from tests.helpers.tiny_models import load_reference
from tests.helpers.vlm_families import VLM_FAMILIES, VlmFamily, as_family, write_config_only, write_served
from tests.helpers.vlm_tp import vlm_tp_outcome
from tgi_paged_backend.bench.sliding_window import long_run_table
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.runner.model.loader import ModelLoadError
from tgi_paged_backend.runner.model_runner import ModelRunner

SCENARIOS: tuple[str, ...] = (
    "single",
    "mixed_batch",
    "chunked_prefill",
    "preempt_recompute",
    "preempt_swap",
    "speculate",
)
SPECULATE = 3
"""``--speculate`` of the speculate scenario (drafts from an oracle, preemption by recompute)."""
BLOCK_SIZE = 4

REFUSED: dict[str, str] = {}
"""Families the backend refuses at start, and a phrase the refusal must contain."""


@functools.cache
def _reference(model_dir: str) -> torch.nn.Module:
    return load_reference(model_dir)


@functools.cache
def hf_greedy(model_dir: str, ids: tuple[int, ...], max_new: int) -> list[int]:
    """HF ``generate`` greedy, exactly ``max_new`` tokens (EOS ignored, as the requests do)."""
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        out = _reference(model_dir).generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
        )
    return out[0, x.shape[1] :].tolist()


@dataclass
class ScenarioOutcome:
    """What one scenario produced: per request, the engine's tokens and HF's."""

    got: dict[int, list[int]] = field(default_factory=dict)
    want: dict[int, list[int]] = field(default_factory=dict)
    premise: bool = False
    """Whether the scenario happened as meant (prompts chunked, requests preempted in that mode)."""
    reclaim_window: int | None = None
    """The engine's sliding-window reclaim window (``None``: every block is kept)."""
    num_groups: int = 1
    """KV layer groups of the engine's manager (``memory.layer_groups``)."""
    num_reclaimed_blocks: int = 0
    """Blocks the engine gave back behind the window during the scenario."""
    cpu_decode: str = ""
    """How the engine's runner takes an fp32 decode step (:func:`cpu_decode_mark`)."""

    @property
    def exact(self) -> bool:
        return self.premise and bool(self.want) and self.got == self.want


def _requests(engine, blocks, specs):
    return [router_spec(engine, blocks, rid, make_text(rid, words), max_new, **kw) for rid, words, max_new, kw in specs]


def run_scenario(model_dir: Path, scenario: str) -> ScenarioOutcome:
    """Serve ``model_dir`` through a fresh engine in ``scenario`` and collect tokens and references."""
    torch.manual_seed(0)
    preemption = {"preempt_recompute": "recompute", "preempt_swap": "swap"}.get(scenario, "recompute")
    preempts = scenario.startswith("preempt") or scenario == "speculate"
    # + 1: the scratch block. With KV layer groups a block holds 1/num_groups of the layers (the same
    # memory per block-position), so the same memory is num_groups times the blocks.
    groups = num_kv_groups(model_dir)
    num_blocks = 32 // BLOCK_SIZE * groups + 1 if preempts else 48 * groups
    engine = make_engine(
        model_dir,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        preemption=preemption,
        speculate=SPECULATE if scenario == "speculate" else 0,
        TGI_PAGED_OVERCOMMIT="4",
    )
    if scenario == "chunked_prefill":
        router_warmup(engine, 16)
    elif preempts:
        router_warmup(engine, 32)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    if scenario == "single":
        requests = _requests(engine, blocks, [(1, 6, 8, {})])
    elif scenario == "mixed_batch":
        requests = _requests(engine, blocks, [(1, 2, 7, {}), (2, 9, 4, {}), (3, 5, 9, {})])
    elif scenario == "chunked_prefill":
        short = _requests(engine, blocks, [(1, 2, 6, {})])[0]
        n_short = len(prompt_ids(engine, short.text))
        requests = [short, *_requests(engine, blocks, [(2, 14, 5, {"chunk_len": 16 - n_short})])]
    elif preempts:
        requests = _requests(engine, blocks, [(rid, 3, 12, {}) for rid in (1, 2, 3)])
    else:
        raise ValueError(f"unknown scenario {scenario!r}: allowed {SCENARIOS}")
    truth = []
    for r in requests:
        ids = tuple(prompt_ids(engine, r.text, r.truncate, r.add_special_tokens))
        truth.append([*ids, *hf_greedy(str(model_dir), ids, r.stopping.max_new_tokens)])
    with oracle_drafts(truth) if scenario == "speculate" else contextlib.nullcontext():
        driver.run(BatchSpec(id=0, requests=tuple(requests)))
    driver.assert_idle()
    outcome = ScenarioOutcome(
        premise=True,
        reclaim_window=engine.kv.reclaim_window,
        num_groups=engine.kv.num_groups,
        num_reclaimed_blocks=engine.kv.stats().num_reclaimed_blocks_total,
        cpu_decode=cpu_decode_mark(engine.runner),
    )
    if scenario == "chunked_prefill":
        outcome.premise = len(prompt_ids(engine, requests[1].text)) > 2 * 16  # three forwards or more
    elif scenario.startswith("preempt"):
        outcome.premise = engine.stats.preemptions[preemption] > 0
    elif scenario == "speculate":  # some drafts accepted and some rejected (the small pool preempts, except
        stats = engine.stats  # for windowed families, whose reclaim and fewer steps leave it room)
        outcome.premise = 0 < stats.accepted_tokens < stats.draft_tokens
    for r in requests:
        ids = tuple(prompt_ids(engine, r.text, r.truncate, r.add_special_tokens))
        outcome.got[r.id] = driver.tokens[r.id]
        outcome.want[r.id] = hf_greedy(str(model_dir), ids, r.stopping.max_new_tokens)
    return outcome


@dataclass
class FamilyResult:
    """One row of ``docs/models.md``."""

    family: Family
    architecture: str
    refusal: str | None = None
    """The start-up error message when the backend refuses the family (or ``missing``)."""
    exact: dict[str, bool] = field(default_factory=dict)
    """Scenario -> token-exact against HF."""
    reclaim_window: int | None = None
    num_groups: int = 1
    num_reclaimed_blocks: int = 0
    """Blocks given back behind the window, over all scenarios."""
    cpu_decode: str = "n/a"
    """How the served engines' runner takes an fp32 decode step (:func:`cpu_decode_mark`)."""
    seconds: float = 0.0


NATIVE_DECODE = "native (one C++ call per layer)"


def _decoder_layer_class(runner: ModelRunner) -> str | None:
    """The class of the model's decoder layers (the first module list with one entry per layer)."""
    for module in runner.model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == runner.spec.num_layers:
            return type(module[0]).__name__
    return None


def cpu_decode_mark(runner: ModelRunner) -> str:
    """How ``runner`` takes an fp32 decode step, from what its load-time rewrites report
    (``ModelRunner.native_layers``, ``rewrites``): :data:`NATIVE_DECODE` when its decoder layers are wrapped
    and none kept, else ``per-op: <why>`` (the report's reasons, shortened)."""
    report = runner.native_layers
    if report is None:  # the native rewrite did not run: its outcome says why
        reason = next((o.reason for o in runner.rewrites.outcomes if o.name == "native" and not o.ran), "not run")
        return f"per-op: {reason}".replace("|", "\\|")
    reasons = [
        f"no layer form for {line.split(':')[0]}" if line.endswith(": no layer form for this class") else line
        for line in report.kept
    ]
    if not reasons and not report.wrapped:  # no layer of a class it takes for a decoder layer: nothing logged
        kind = _decoder_layer_class(runner)
        reasons = [f"no layer form for {kind}" if kind else "no decoder layer with a layer form"]
    if not reasons:
        return NATIVE_DECODE
    per_op = f"per-op: {'; '.join(reasons)}".replace("|", "\\|")
    return f"native in {report.wrapped} layers, {per_op}" if report.wrapped else per_op


def start_error(model_dir: Path) -> str | None:
    """The start-up error of the engine on ``model_dir``, or ``None`` when it starts."""
    try:
        make_engine(model_dir, num_blocks=4, block_size=BLOCK_SIZE)
    except ModelLoadError as err:
        return str(err)
    return None


def run_family(family: Family, workdir: Path, scenarios: tuple[str, ...] = SCENARIOS) -> FamilyResult:
    """Write ``family``'s tiny model under ``workdir``, then start it and run ``scenarios``."""
    start = time.perf_counter()
    if not is_available(family):
        return FamilyResult(
            family, "-", refusal=f"missing: transformers {transformers.__version__} has no {family.model_type!r}"
        )
    config = family_config(family)
    result = FamilyResult(family, type(transformers.AutoModelForCausalLM.from_config(config)).__name__)
    model_dir = write_family_model(family, workdir / family.name)
    result.refusal = start_error(model_dir)
    if result.refusal is None:
        for scenario in scenarios:
            outcome = run_scenario(model_dir, scenario)
            result.exact[scenario] = outcome.exact
            result.reclaim_window = outcome.reclaim_window
            result.num_groups = outcome.num_groups
            result.num_reclaimed_blocks += outcome.num_reclaimed_blocks
            result.cpu_decode = outcome.cpu_decode
    result.seconds = time.perf_counter() - start
    return result


def run_vlm_family(vlm: VlmFamily, workdir: Path) -> FamilyResult:
    """A VLM row: the start-up refusal of a config-only checkpoint of the family, or a served one's scenarios."""
    start = time.perf_counter()
    family = as_family(vlm)
    if not is_available(family):
        return FamilyResult(
            family, "-", refusal=f"missing: transformers {transformers.__version__} has no {vlm.model_type!r}"
        )
    if vlm.served:  # its image scenarios on its tiny checkpoint
        exact, runner = run_matrix_scenarios(*write_served(vlm, workdir / vlm.name))
        result = FamilyResult(family, vlm.architecture, exact=exact, cpu_decode=cpu_decode_mark(runner))
    else:
        result = FamilyResult(family, vlm.architecture, refusal=start_error(write_config_only(vlm, workdir / vlm.name)))
    result.seconds = time.perf_counter() - start
    return result


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "**NO**")


def _tp_mark(outcome: TpOutcome | None) -> str:
    if outcome is None:
        return "not run"
    if outcome.refusal is not None:
        reason = outcome.refusal.removeprefix("tensor parallelism").lstrip(": ").split(";")[0].split(": use")[0]
        reason = reason.replace("|", "\\|")
        return f"refused ({reason})"
    return _mark(outcome.exact)


def render_markdown(
    results: list[FamilyResult], tp: dict[str, TpOutcome] | None = None, reclaim_table: str | None = None
) -> str:
    """``docs/models.md``: one row per family, served or refused with the reason, then the
    sliding-window figure (``reclaim_table``, from :func:`long_run_table`) when given."""
    tp = tp or {}
    lines = [
        "# Model families",
        "",
        "Generated by `.venv/bin/python -m tests.helpers.family_matrix --write docs/models.md` from the family",
        "matrix (`tests/runner/test_family_matrix.py` runs the same scenarios in the suite). Each family is a",
        "tiny random model (2 layers, hidden 64, the family's feature switched on: sliding windows of 8",
        "tokens, soft-capping, MoE, MQA, partial rotary, learned positions, attention sinks) served by the",
        "shard engine as the v3 router drives it, compared with HF `generate` (greedy) token for token.",
        "*Single-shard exact*: one request, a mixed batch and chunked prefill. *Preemption exact*: a pool",
        "small enough that requests are preempted, by recompute and by swap. *TP=2*: two gloo ranks, greedy",
        "through their paged pools against HF (`tests/distributed/test_tp_families.py`); a layout the",
        "Megatron slicing cannot shard is refused at start with the reason. *Sliding-window block",
        "reclaim*: when every layer is windowed, blocks wholly behind the window go back to the pool as",
        "decoding moves on (blocks given back over the six scenarios, window 8, block size 4); families",
        "that mix sliding and full-attention layers get one page map per KV layer group over the one pool",
        "(`memory/layer_groups.py`, `docs/design-layer-groups.md`), and their sliding groups give back what",
        "is behind the window the same way. *Speculation exact*: `--speculate 3` with",
        "drafts from an oracle (the true continuation, one wrong token planted every third draft), so drafts are",
        "accepted whole and in part, in the preemption scenario's small pool (`docs/speculation.md`).",
        "*CPU fp32 decode step*: what the served engine's runner reports (`ModelRunner.native_layers`):",
        "`native (one C++ call per layer)` when every decoder layer's form is described by",
        "`runner/cpu/layer_forms.py` and reproduced at load, so a decode step runs each layer as one",
        "`tgi_paged_kernels.cpu_layer.decode_layer` call; else `per-op` (one Python call per operation) and why.",
        "After Warmup, a model whose decoder layers are all native takes its decode steps as one call for every",
        "layer (`runner/native/stack.py`, proven at Warmup; paged in KV layer groups, each layer its group's slots):",
        "every `native` family below except Gemma3 (local and global RoPE tables) and Cohere2 (mixed rotary kinds)",
        "(`tests/runner/test_native_stack.py`). Of those, the families laid out as",
        "`model.{embed_tokens, rotary_emb, norm, layers}` with `lm_head` (Llama, Mistral, Qwen2/3, Gemma, Gemma2,",
        "Granite, OLMo2, Phi-3, Cohere, StarCoder2, the MoE forms) also skip transformers' model loop on decode steps",
        "(`runner/native/direct.py`, a second Warmup proof; `tests/runner/test_native_direct.py`).",
        "Under `--dtype bfloat16` the same layers are native (each checked against its module's bf16 step and the",
        "fp32 module, `tests/runner/test_native_layers_bf16.py`), verify steps, adapter rows, int8/fp8 weights and",
        "tensor-parallel ranks included, as in fp32 (a rank's verify steps and adapter rows run per op).",
        f"transformers {transformers.__version__}.",
        "",
        "| family | architecture class | single-shard exact | preemption exact | speculation exact | TP=2 exact | "
        "sliding-window block reclaim | CPU fp32 decode step | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.refusal is not None:
            status = "refused" if not r.refusal.startswith("missing") else "missing"
            reason = r.refusal.replace("|", "\\|")
            lines.append(
                f"| {r.family.name} | {r.architecture} | {status} | {status} | {status} | {status} | n/a | n/a | "
                f"{r.family.feature}. **{status.capitalize()} at start:** {reason} |"
            )
            continue
        single = all(r.exact.get(s, False) for s in ("single", "mixed_batch", "chunked_prefill"))
        preempt = all(r.exact.get(s, False) for s in ("preempt_recompute", "preempt_swap"))
        windowed = _reclaim_mark(r)
        lines.append(
            f"| {r.family.name} | {r.architecture} | {_mark(single)} | {_mark(preempt)} | "
            f"{_mark(r.exact.get('speculate'))} | "  # n/a: not run (the VLM rows)
            f"{_tp_mark(tp.get(r.family.name))} | "
            f"{windowed} | {r.cpu_decode} | {r.family.feature} |"
        )
    if reclaim_table is not None:
        lines += ["", *RECLAIM_SECTION, "", reclaim_table]
    return "\n".join(lines) + "\n"


RECLAIM_SECTION = (
    "## Sliding-window KV saving on long runs",
    "",
    "`.venv/bin/python examples/bench_sliding_window.py` (no model, about 20 s): identical requests",
    "admitted together, stepped as the scheduler does (prompts in chunks of 4096 tokens, then one token",
    "per step each) through the real `KVCacheManager`, block size 16, with the reclaim window the",
    "engine takes from the layers (`ModelSpec.reclaim_window`) and without one. Peaks are blocks in",
    "use at once. A prompt chunk longer than the window holds the window plus the chunk, so long",
    "prompts peak at prefill; long generations settle at `ceil(4096 / 16) + 1 = 257` blocks per request.",
    "Gemma 2/3 and gpt-oss mix sliding and full-attention layers: with one page map per request for all",
    "layers the full layers read every position, so nothing is reclaimed (0). The engine pages them by KV",
    "layer group instead (`TGI_PAGED_LAYER_GROUPS`, `docs/design-layer-groups.md`). The last three columns:",
    "the share one page map per layer would free at the final length (analytic, per layer); the share the",
    "engine's groups free, measured through the manager (KV bytes, at the peak and at the end); and the",
    "blocks one request holds at its end, measured beside the groups' arithmetic",
    "(`LayerGroups.final_blocks`: a full group every block, a sliding group the blocks its last query",
    "reads). They agree exactly; Gemma 3's 0.8 % below the per-layer figure is the 8 padded slots of its 7",
    "groups of 10 layers (equal-sized blocks), which the arithmetic counts.",
)


def _has_window(family: Family) -> bool:
    return bool(family.overrides.get("sliding_window"))


def _reclaim_mark(r: FamilyResult) -> str:
    if r.reclaim_window is not None:
        status = "yes" if r.num_reclaimed_blocks > 0 else "**NO**"
        return f"{status}: {r.num_reclaimed_blocks} blocks given back (every layer windowed)"
    if r.num_groups > 1:
        status = "yes" if r.num_reclaimed_blocks > 0 else "**NO**"
        return f"{status}: {r.num_reclaimed_blocks} blocks given back ({r.num_groups} KV layer groups)"
    if _has_window(r.family):
        return "0 (sliding and full layers share the page map)"
    return "n/a (no window)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the markdown table here (else print it)")
    parser.add_argument("--family", action="append", help="only these families (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    families = [f for f in FAMILIES if not args.family or f.name in args.family]
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for family in families:
            results.append(run_family(family, Path(tmp)))
            r = results[-1]
            print(f"{family.name:12s} {r.seconds:5.1f}s {'refused' if r.refusal else r.exact}", flush=True)
        vlms = [v for v in VLM_FAMILIES if not args.family or v.name in args.family]
        results += [run_vlm_family(vlm, Path(tmp)) for vlm in vlms]
        tp = run_tp([f for f in tp_families() if f in families], Path(tmp))
        served = [v for v in vlms if v.served and is_available(as_family(v))]
        tp.update({v.name: vlm_tp_outcome(v, Path(tmp)) for v in served})  # tests/helpers/vlm_tp.py
    text = render_markdown(results, tp, long_run_table())
    if args.write:
        args.write.write_text(text)
    else:
        print(text)
    failed = [r.family.name for r in results if r.refusal is None and not all(r.exact.values())]
    failed += [name for name, o in tp.items() if o.exact is False]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
