"""Multi-LoRA serving (``LORA_ADAPTERS`` + ``RequestSpec.adapter_id``) is token-exact with HF + PEFT.

Every scenario drives the engine the way the router does (``RouterDriver``, router reservations) and
compares each request's greedy tokens with ``peft_greedy`` (HF ``generate`` through ``PeftModel``; the
base model alone for an empty or unknown ``adapter_id``). Three adapters per tiny family: ``full``
(all seven projections), ``qv`` (q_proj and v_proj only, larger rank) and ``rs`` (rsLoRA over four
projections, with per-module rank and alpha patterns). Scenarios: a mixed batch of base, the three
adapters (one twice, non-adjacent) and an unknown id on llama, qwen2 and mistral; preemption by
recompute and by swap; chunked prefill; prefix retention keyed by adapter; ``TGI_PAGED_MAX_LORAS=1``
(never two adapters in one forward); a bad ``LORA_ADAPTERS`` entry; decode and verify steps with adapter rows
served by the native decode layers (one call per layer, not the per-op path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import (
    TINY_KIND_FIXTURES,
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
)
from tests.helpers.lora_adapters import LLAMA_TARGETS, peft_greedy, write_adapter
from tests.helpers.native_steps import num_native_layers, record_steps
from tests.helpers.speculation_oracle import OracleDrafts
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.engine import speculation
from tgi_paged_backend.engine.types import BatchSpec, FinishReason

MAX_NEW = 8
ADAPTERS: dict[str, dict] = {
    "full": dict(r=4, alpha=8, targets=LLAMA_TARGETS, seed=11),
    "qv": dict(r=8, alpha=16, targets=("q_proj", "v_proj"), seed=12),
    "rs": dict(
        r=6,
        alpha=4,
        targets=("k_proj", "o_proj", "up_proj", "down_proj"),
        seed=13,
        use_rslora=True,
        rank_pattern={"down_proj": 2},
        alpha_pattern={"o_proj": 12},
    ),
}
UNKNOWN = "no-such-adapter"


# ------------------------------------------------------------------------------------ fixtures


class Family:
    """A tiny base model and its adapters, with cached HF + PEFT references."""

    def __init__(self, base: Path, adapters: dict[str, Path], refs: dict) -> None:
        self.base = base
        self.adapters = adapters
        self._refs = refs

    @property
    def lora_env(self) -> str:
        return ",".join(f"{name}={path}" for name, path in self.adapters.items())

    def engine(self, **kw):
        return make_engine(self.base, LORA_ADAPTERS=self.lora_env, **kw)

    def adapter_dir(self, adapter_id: str) -> Path | None:
        """What serves ``adapter_id``: its directory, ``None`` (the base model) for empty or unknown ids."""
        return self.adapters.get(adapter_id)

    def reference(self, adapter_id: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """``peft_greedy`` per (model, adapter, prompt, max_new), each computed once per module."""
        adapter = self.adapter_dir(adapter_id)
        keys = [(str(self.base), str(adapter), tuple(p), max_new) for p in prompts]
        missing = list(dict.fromkeys(k for k in keys if k not in self._refs))
        if missing:
            got = peft_greedy(self.base, adapter, [list(k[2]) for k in missing], max_new)
            self._refs.update(zip(missing, got))
        return [self._refs[k] for k in keys]


@pytest.fixture(scope="module")
def peft_refs() -> dict:
    """(model, adapter, prompt, max_new) -> greedy tokens, shared by the module's tests."""
    return {}


@pytest.fixture(scope="module")
def families(request, tmp_path_factory, peft_refs):
    """``families(kind) -> Family``: adapters written once per kind and module."""
    made: dict[str, Family] = {}

    def get(kind: str) -> Family:
        if kind not in made:
            base = request.getfixturevalue(TINY_KIND_FIXTURES[kind])
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            adapters = {name: write_adapter(base, root / name, **kw) for name, kw in ADAPTERS.items()}
            made[kind] = Family(base, adapters, peft_refs)
        return made[kind]

    return get


def expect_reference(engine, family: Family, driver: RouterDriver, requests) -> None:
    for r in requests:
        ids = prompt_ids(engine, r.text, r.truncate, r.add_special_tokens)
        (want,) = family.reference(r.adapter_id, [ids], r.stopping.max_new_tokens)
        got = driver.tokens[r.id]
        assert got == want, f"request {r.id} (adapter {r.adapter_id!r}, {len(ids)} prompt tokens) differs from PEFT"
        assert driver.final[r.id].generated_text.finish_reason is FinishReason.LENGTH


def serve_layout(engine, family: Family, layout: list[tuple[int, str, int]], text_seed: int) -> None:
    """One batch of ``(request id, adapter id, words)`` requests through the router driver, each token-exact against
    PEFT."""
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [
        router_spec(engine, blocks, rid, make_text(text_seed + rid, words), MAX_NEW, adapter_id=adapter)
        for rid, adapter, words in layout
    ]
    driver.run(BatchSpec(id=9, requests=tuple(requests)))
    expect_reference(engine, family, driver, requests)


def record_lora_slots(engine) -> list[torch.Tensor | None]:
    """Record every forward's ``batch.lora_slots`` (the runner outlives the engine's re-configuration)."""
    seen: list[torch.Tensor | None] = []
    forward = engine.runner.forward

    def recording(batch, *args, **kwargs):
        seen.append(None if batch.lora_slots is None else batch.lora_slots.clone().cpu())
        return forward(batch, *args, **kwargs)

    engine.runner.forward = recording
    return seen


def record_preemptions(engine) -> list:
    """Record every step's preemption events (patch after Warmup: it rebuilds the scheduler)."""
    events: list = []
    plan = engine.scheduler.plan

    def recording(*args, **kwargs):
        result = plan(*args, **kwargs)
        events.extend(result.preemptions)
        return result

    engine.scheduler.plan = recording
    return events


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind", sorted(TINY_KIND_FIXTURES))
def test_mixed_batch_of_adapters_base_and_unknown(families, kind):
    family = families(kind)
    engine = family.engine(num_blocks=48)
    assert engine.adapter_names.names == tuple(ADAPTERS)
    slots = record_lora_slots(engine)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    layout = [(1, "full", 12), (2, "", 5), (3, "qv", 20), (4, "full", 7), (5, UNKNOWN, 9), (6, "rs", 15)]
    requests = [
        router_spec(engine, blocks, rid, make_text(100 + rid, words), MAX_NEW, adapter_id=adapter)
        for rid, adapter, words in layout
    ]
    driver.run(BatchSpec(id=3, requests=tuple(requests)))
    expect_reference(engine, family, driver, requests)
    assert engine.adapter_names.num_unknown == 1
    driver.assert_idle()
    # The prefill packed every adapter (``full`` in two separate runs of rows) and the base rows as -1.
    prefill = slots[0]
    assert prefill is not None and set(prefill.tolist()) == {-1, 0, 1, 2}
    # Each adapter really changes the model: the same prompt differs from the base model's tokens.
    first = prompt_ids(engine, requests[0].text)
    (base_tokens,) = family.reference("", [first], MAX_NEW)
    for name in ADAPTERS:
        (tokens,) = family.reference(name, [first], MAX_NEW)
        assert tokens != base_tokens, f"adapter {name} does not change the greedy tokens: a vacuous test"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_adapters_keeps_outputs_exact(families, mode):
    family = families("llama")
    # 64 physical tokens (block 0 is scratch); four requests of ~12 + 20 tokens need ~128: decoding preempts.
    engine = family.engine(num_blocks=9, block_size=8, preemption=mode, TGI_PAGED_OVERCOMMIT="3")
    router_warmup(engine, 64)
    events = record_preemptions(engine)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    # The base request is the oldest: the younger adapter requests are the victims.
    layout = [(40, ""), (41, "full"), (42, "qv"), (44, "rs")]
    requests = [router_spec(engine, blocks, rid, make_text(rid, 3), 20, adapter_id=a) for rid, a in layout]
    driver.run(BatchSpec(id=5, requests=tuple(requests)))
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    assert {e.request_id for e in events if e.mode == mode} & {41, 42, 44}, events
    if mode == "swap":
        assert engine.stats.swap_bytes["in"] == engine.stats.swap_bytes["out"] > 0
    expect_reference(engine, family, driver, requests)
    driver.assert_idle()
    assert engine.kv.num_swapped_blocks == 0


def test_chunked_prefill_with_adapters(families):
    family = families("llama")
    budget = 32
    engine = family.engine(num_blocks=64)
    router_warmup(engine, budget)
    assert engine.capacity.max_prefill_tokens == budget
    slots = record_lora_slots(engine)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    short = router_spec(engine, blocks, 20, make_text(21, 3), 10, adapter_id="rs")
    n_short = len(prompt_ids(engine, short.text))
    long_a, long_b = make_text(22, 40), make_text(23, 44)
    assert min(len(prompt_ids(engine, t)) for t in (long_a, long_b)) > 3 * budget
    first = router_spec(engine, blocks, 21, long_a, 6, adapter_id="full", chunk_len=budget - n_short)
    second = router_spec(engine, blocks, 22, long_b, 6, adapter_id="qv")
    batch = driver.prefill(BatchSpec(id=1, requests=(short, first, second)))
    assert engine.requests[21].num_computed == budget - n_short and engine.requests[22].num_computed == 0
    # A base request joins mid-flight (chunking mode) while the adapter prompts are still in chunks.
    batch = driver.decode([batch])
    late = router_spec(engine, blocks, 23, make_text(24, 6), 6)
    batch = driver.prefill(BatchSpec(id=2, requests=(late,)), cached=batch)
    driver.drain(batch)
    requests = [short, first, second, late]
    expect_reference(engine, family, driver, requests)
    driver.assert_idle()
    # Each long prompt took three or more forwards, and some forwards mixed adapters' chunks with decodes.
    for rid in (21, 22):
        first_token = next(i for i, res in enumerate(driver.results) if rid in {g.request_id for g in res.generations})
        assert first_token >= 3
    assert any(s is not None and len(set(s.tolist())) >= 3 for s in slots)


def _prefix_runner(engine, family: Family, text: str):
    """``run(adapter_id)``: serve ``text`` under ``adapter_id`` alone; the prefix tokens it reused."""
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    rid = iter(range(1, 100))

    def run(adapter_id: str) -> int:
        r = router_spec(engine, blocks, next(rid), text, MAX_NEW, adapter_id=adapter_id)
        before = engine.stats.prefix_hit_tokens
        driver.run(BatchSpec(id=r.id, requests=(r,)))
        expect_reference(engine, family, driver, [r])
        return engine.stats.prefix_hit_tokens - before

    return run, blocks, driver


def test_prefix_retention_is_keyed_by_adapter(families):
    family = families("llama")
    engine = family.engine(num_blocks=128)
    text = make_text(30, 30)
    n = len(prompt_ids(engine, text))
    full_blocks = (n - 1) // engine.block_size * engine.block_size
    assert full_blocks >= 4 * engine.block_size
    run, blocks, driver = _prefix_runner(engine, family, text)
    assert run("full") == 0
    assert engine.kv.num_retained_blocks >= n // engine.block_size
    # The same tokens under another adapter, or the base model: A's K/V must not be reused.
    assert run("qv") == 0  # (adapters 1 and 2: their chain roots once hashed alike)
    assert run("rs") == 0
    assert run("") == 0
    for adapter_id in ("full", "qv", "rs"):  # under its own adapter it is
        assert run(adapter_id) >= full_blocks, adapter_id
    assert run(UNKNOWN) >= full_blocks  # an unknown id is the base model, and shares its blocks
    # In one batch, requests of two adapters on a prompt A's adapter left retained: each matches its own.
    other = make_text(31, 30)
    a = router_spec(engine, blocks, 200, other, MAX_NEW, adapter_id="full")
    driver.run(BatchSpec(id=200, requests=(a,)))
    # (qv's own blocks of ``text`` may give B their common leading tokens, the BOS, by copy-on-write.)
    common = next(i for i, (x, y) in enumerate(zip(prompt_ids(engine, text), prompt_ids(engine, other))) if x != y)
    assert common < engine.block_size
    b = router_spec(engine, blocks, 201, other, MAX_NEW, adapter_id="qv")
    c = router_spec(engine, blocks, 202, other, MAX_NEW, adapter_id="full")
    before = engine.stats.prefix_hit_tokens
    batch = driver.prefill(BatchSpec(id=201, requests=(b, c)))
    assert engine.requests[201].num_cached_prompt <= common
    assert engine.requests[202].num_cached_prompt >= full_blocks
    assert engine.stats.prefix_hit_tokens - before >= full_blocks
    driver.drain(batch)
    expect_reference(engine, family, driver, [a, b, c])
    driver.assert_idle()


def test_max_loras_one_never_mixes_adapters_in_a_forward(families):
    family = families("llama")
    engine = family.engine(num_blocks=64, TGI_PAGED_MAX_LORAS="1")
    slots = record_lora_slots(engine)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    layout = [(1, "full", 9), (2, "", 6), (3, "qv", 11), (4, "full", 4), (5, "qv", 7), (6, UNKNOWN, 5)]
    requests = [
        router_spec(engine, blocks, rid, make_text(200 + rid, words), MAX_NEW, adapter_id=adapter)
        for rid, adapter, words in layout
    ]
    batch = driver.prefill(BatchSpec(id=1, requests=tuple(requests)))
    assert engine.requests[3].waiting_for_adapter and engine.requests[5].waiting_for_adapter
    assert {g.request_id for g in driver.results[-1].generations} == {1, 2, 4, 6}
    driver.drain(batch)
    expect_reference(engine, family, driver, requests)
    driver.assert_idle()
    per_step = [set() if s is None else {int(v) for v in s.tolist() if v >= 0} for s in slots]
    assert all(len(s) <= 1 for s in per_step), per_step
    # The oldest request's adapter keeps its place until its requests finish; then the other one runs.
    with_full = [i for i, s in enumerate(per_step) if s == {0}]
    with_qv = [i for i, s in enumerate(per_step) if s == {1}]
    assert with_full and with_qv and max(with_full) < min(with_qv)
    # The base model's rows (the empty and the unknown id) ran alongside the first adapter.
    assert slots[0] is not None and set(slots[0].tolist()) == {-1, 0}


def test_bad_lora_adapters_entry_is_refused(families, tmp_path):
    family = families("llama")
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"bad={missing}"):
        make_engine(family.base, LORA_ADAPTERS=f"full={family.adapters['full']},bad={missing}")


def test_adapters_keep_the_fused_and_native_layers(tiny_llama_dir, tmp_path) -> None:
    """Loading adapters costs base-model traffic nothing structural: q/k/v and gate/up stay one GEMM each
    (every projection's adapters on its own columns) and the layers keep their one-call native decode."""
    adapter = write_adapter(tiny_llama_dir, tmp_path / "all", r=4, alpha=8, seed=3)
    engine = make_engine(tiny_llama_dir, LORA_ADAPTERS=f"all={adapter}")
    runner = engine.runner
    layers = runner.spec.num_layers
    assert runner.fusion.attentions == layers and runner.fusion.mlps == layers
    assert runner.native_layers is not None and runner.native_layers.wrapped == layers


def test_an_adapter_above_the_rank_limit_is_refused_at_start(tiny_llama_dir, tmp_path) -> None:
    adapter = write_adapter(tiny_llama_dir, tmp_path / "r8", r=8, alpha=16, seed=4)
    with pytest.raises(ConfigError, match="rank 8 is above TGI_PAGED_MAX_LORA_RANK=4"):
        make_engine(tiny_llama_dir, LORA_ADAPTERS=f"r8={adapter}", TGI_PAGED_MAX_LORA_RANK="4")
    with pytest.raises(ConfigError, match="TGI_PAGED_MAX_LORA_RANK='0' is invalid"):
        make_engine(tiny_llama_dir, LORA_ADAPTERS=f"r8={adapter}", TGI_PAGED_MAX_LORA_RANK="0")
    assert make_engine(tiny_llama_dir, LORA_ADAPTERS=f"r8={adapter}", TGI_PAGED_MAX_LORA_RANK="8").runner.lora


@pytest.mark.parametrize("kind", sorted(TINY_KIND_FIXTURES))
def test_adapter_rows_decode_on_the_native_layers(families, monkeypatch, kind):
    """Decode steps with adapter rows run as one native call per layer (the deltas inside it), token-exact."""
    family = families(kind)
    engine = family.engine(num_blocks=48)
    record = record_steps(engine, monkeypatch)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    layout = [(1, "full", 6), (2, "", 9), (3, "rs", 4), (4, "qv", 11), (5, "full", 3)]
    requests = [
        router_spec(engine, blocks, rid, make_text(300 + rid, words), MAX_NEW, adapter_id=adapter)
        for rid, adapter, words in layout
    ]
    driver.run(BatchSpec(id=7, requests=tuple(requests)))
    expect_reference(engine, family, driver, requests)
    forwards, native = record.count(verify=False, lora=True)
    assert forwards >= MAX_NEW - 1 and native == forwards * num_native_layers(engine) > 0


def test_adapter_rows_decode_in_the_native_stack(families):
    """After Warmup's proof, decode steps with adapter rows run every layer in one native call (each layer its own
    deltas), token-exact against PEFT."""
    family = families("llama")
    engine = family.engine(num_blocks=48)
    engine.runner.warm_decode()  # Warmup's: proves the stack, adapter rows beside base rows
    (stack,) = engine.runner.native_layers.stacks
    assert stack.enabled, stack.kept
    steps = stack.steps
    serve_layout(engine, family, [(1, "full", 6), (2, "", 9), (3, "rs", 4), (4, "qv", 11)], text_seed=300)
    assert stack.steps - steps >= MAX_NEW - 1


def test_adapter_rows_verify_drafts_on_the_native_layers(families, monkeypatch):
    """Speculation with adapters: each request's verify step (its last token and an oracle's draft of its PEFT
    continuation, a wrong token planted) runs natively with the request's adapter, and stays token-exact."""
    family = families("llama")
    engine = family.engine(num_blocks=48, speculate=3)
    blocks = RouterBlocks(engine)
    request = router_spec(engine, blocks, 1, make_text(400, 7), 12, adapter_id="qv")
    ids = prompt_ids(engine, request.text)
    (want,) = family.reference("qv", [ids], 12)
    monkeypatch.setattr(speculation, "ngram_draft", OracleDrafts([ids + want], wrong_every=3))
    record = record_steps(engine, monkeypatch)
    driver = RouterDriver(engine, blocks)
    driver.run(BatchSpec(id=8, requests=(request,)))
    expect_reference(engine, family, driver, [request])
    assert 0 < engine.stats.accepted_tokens < engine.stats.draft_tokens
    forwards, native = record.count(verify=True, lora=True)
    assert forwards > 0 and native == forwards * num_native_layers(engine)


def test_bf16_adapter_files_of_an_fp32_model_stay_bf16_and_decode_exactly(families, tmp_path):
    """Adapters saved in bf16 for an fp32 model stay bf16 on CPU (half the bytes; the kernels widen each value
    exactly, as PEFT does when it loads them): token-exact against PEFT, adapter rows in the native stack; a mix of
    bf16 and fp32 files stacks in fp32."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tgi_paged_backend.lora.layers import LoraLinear

    family = families("llama")
    halves = {}
    for name in ("full", "qv"):
        halves[name] = tmp_path / f"{name}-bf16"
        shutil.copytree(family.adapters[name], halves[name])
        weights = halves[name] / "adapter_model.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
    bf16 = Family(family.base, halves, {})
    engine = bf16.engine(num_blocks=48)
    engine.runner.warm_decode()
    wrappers = [m for m in engine.runner.model.modules() if isinstance(m, LoraLinear)]
    assert wrappers and all(w.a_stack.dtype == w.b_stack.dtype == torch.bfloat16 for w in wrappers)
    fp32_bytes = family.engine(num_blocks=48).runner.lora.num_bytes  # all four fp32 adapters
    assert engine.runner.lora.num_bytes < fp32_bytes / 2  # two adapters, two bytes a value
    (stack,) = engine.runner.native_layers.stacks
    assert stack.enabled, stack.kept
    steps = stack.steps
    serve_layout(engine, bf16, [(1, "full", 6), (2, "", 9), (3, "qv", 4), (4, "full", 11)], text_seed=500)
    assert stack.steps - steps >= MAX_NEW - 1

    mixed = Family(family.base, {"full": halves["full"], "qv": family.adapters["qv"]}, {})
    wrappers = [m for m in mixed.engine(num_blocks=48).runner.model.modules() if isinstance(m, LoraLinear)]
    assert all(w.a_stack.dtype == torch.float32 for w in wrappers)
