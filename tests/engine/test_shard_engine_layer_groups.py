"""KV layer groups through the shard engine (issue 24): a tiny Gemma 3 and a tiny gpt-oss (one sliding
layer of window 8 beside one full-attention layer) generate far past the window. The sliding group
keeps only its window, the full group every block; on a pool too small for every request's history in
both groups, requests are preempted by recompute and by swap, and greedy stays token-exact against HF.
With ``TGI_PAGED_LAYER_GROUPS=0`` the same memory cannot even hold one request. Also with the groups:
the Triton kernels (each layer reads its group's block table), fp8 KV (the same tokens as one page map),
a copy-on-write prefix hit (one copy a group) and prefill chunks longer than the window."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
)
from tests.helpers.family_models import FAMILIES, write_family_model
from tests.helpers.triton_serving import LAUNCHERS, route_to_triton
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.engine import build_engine
from tgi_paged_backend.engine.capacity import plan_capacity
from tgi_paged_backend.engine.request_state import RequestStatus
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.memory.types import SCRATCH_BLOCK
from tgi_paged_backend.memory.window_reclaim import max_resident_blocks, num_blocks_outside_window
from tgi_paged_backend.model_files import with_local_model

WINDOW, BLOCK_SIZE, NEW = 8, 4, 40


@pytest.fixture(scope="module", params=["Gemma3", "gpt-oss"])
def hybrid_dir(request, tmp_path_factory):
    family = next(f for f in FAMILIES if f.name == request.param)
    assert family.overrides["sliding_window"] == WINDOW
    return write_family_model(family, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_generation_far_past_the_window_is_exact_with_the_sliding_group_bounded(hybrid_dir, hf_greedy, mode):
    # 3 requests of ~20 + 40 tokens: 15 blocks each in the full group, <= 3 in the sliding one; 30 usable
    # blocks hold two requests' groups, never three full histories in both groups (90)
    engine = make_engine(hybrid_dir, num_blocks=31, block_size=BLOCK_SIZE, preemption=mode, TGI_PAGED_OVERCOMMIT="8")
    assert engine.kv.num_groups == 2 and engine.kv.group_windows == (None, WINDOW)
    assert engine.runner.kv_groups.layers_per_block == 1  # a block holds one layer's K/V
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 4), NEW) for rid in (1, 2, 3)]
    bound = max_resident_blocks(WINDOW, BLOCK_SIZE, 64)  # a prefill chunk reads its window plus itself
    batch = driver.prefill(BatchSpec(id=0, requests=tuple(requests)))
    for _ in range(500):
        if batch is None:
            break
        batch = driver.decode([batch])
        for rid, state in engine.requests.items():
            if state.status is RequestStatus.RUNNING:
                full, sliding = (m.num_physical_blocks for m in engine.kv._maps(rid))
                assert sliding <= min(full, bound), (rid, full, sliding)
    assert batch is None
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), NEW), r.id
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    assert engine.kv.stats().num_reclaimed_blocks_total > 3 * 6
    driver.assert_idle()


def test_one_page_map_for_all_layers_needs_twice_the_memory(hybrid_dir):
    """Same memory, groups off: a block holds both layers, so 15 blocks; a 60-token request needs 16."""
    engine = make_engine(hybrid_dir, num_blocks=15, block_size=BLOCK_SIZE, TGI_PAGED_LAYER_GROUPS="0")
    assert engine.kv.num_groups == 1
    with pytest.raises(ConfigError, match="needs 16 KV blocks"):
        router_warmup(engine, 16, max_total_tokens=60)
    engine = make_engine(hybrid_dir, num_blocks=31, block_size=BLOCK_SIZE)
    router_warmup(engine, 16, max_total_tokens=60)  # 15 full + 3 sliding + scratch fit in 31


def test_warmup_budget_counts_what_the_sliding_groups_do_not_hold():
    """Gemma-2 shape (2 groups), window 4096, 8k-token requests, block size 16: every group keeping every
    block would need 2 x 512 blocks a request, the groups hold 512 + 256 at the end (the window); the
    budget grows by that ratio, also with TGI's default 4096-token prefill chunks, whose peak (the window
    plus a chunk: every block) only the fit check counts."""
    groups = LayerGroups.from_layer_windows([4096, None] * 21)

    def plan(groups, max_prefill_tokens=16, num_blocks_cap=20_001):
        return plan_capacity(
            available_kv_bytes=10**12,
            block_bytes=1000,
            block_size=16,
            num_blocks_cap=num_blocks_cap,
            overcommit=1.0,
            max_position_embeddings=8192,
            max_input_tokens=4096,
            max_total_tokens=8192,
            max_prefill_tokens=max_prefill_tokens,
            groups=groups,
        )

    grouped, single = plan(groups), plan(None)
    assert grouped.physical_tokens == 20_000 // 2 * 16  # a position takes a block slot in both groups
    assert grouped.budget_gain == pytest.approx(1024 / 768)
    assert grouped.max_supported_total_tokens == pytest.approx(160_000 * 1024 / 768, abs=16)
    assert single.budget_gain == 1.0 and single.max_supported_total_tokens == 320_000
    assert plan(groups, max_prefill_tokens=4096).budget_gain == grouped.budget_gain
    assert plan(groups, num_blocks_cap=1 + 512 + 258).budget_gain == grouped.budget_gain  # 16-token chunks fit
    with pytest.raises(ConfigError, match="needs 1025 KV blocks"):  # the 4096-token chunk's peak: every block
        plan(groups, max_prefill_tokens=4096, num_blocks_cap=1 + 512 + 258)


def test_a_follow_up_hits_the_prefix_in_every_group(hybrid_dir, hf_greedy):
    """A finished request's blocks are retained in both groups (the sliding group's registered as they
    left the window); a follow-up sharing its prompt hits them and stays token-exact."""
    engine = make_engine(hybrid_dir, num_blocks=64, block_size=BLOCK_SIZE)
    blocks = RouterBlocks(engine)
    first = router_spec(engine, blocks, 1, make_text(9, 6), 12)
    driver = RouterDriver(engine, blocks)
    driver.run(BatchSpec(id=0, requests=(first,)))
    follow_up = router_spec(engine, blocks, 2, make_text(9, 6) + " " + make_text(10, 2), 12)
    driver.run(BatchSpec(id=1, requests=(follow_up,)))
    assert engine.kv.stats().num_prefix_hit_tokens >= 2 * BLOCK_SIZE
    for r in (first, follow_up):
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), 12), r.id
    driver.assert_idle()


def test_a_follow_up_needs_only_the_sliding_window_before_its_hit_point(hybrid_dir, hf_greedy):
    """The sliding group's blocks behind the window were given back (retained) as the first request ran,
    so under memory pressure they go first. Once they are evicted the follow-up still hits its whole
    shared prompt: the sliding group needs only the blocks the hit point's window reads (the full group
    every block). Token-exact against HF."""
    engine = make_engine(hybrid_dir, num_blocks=64, block_size=BLOCK_SIZE)
    kv = engine.kv
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    first = router_spec(engine, blocks, 1, make_text(9, 8), 12)
    driver.run(BatchSpec(id=0, requests=(first,)))
    prompt = prompt_ids(engine, first.text)
    serials = kv._groups[0].prefix.match(prompt + [0]).serials
    hit_point = len(serials) * BLOCK_SIZE
    behind = num_blocks_outside_window(hit_point - 1, WINDOW, BLOCK_SIZE)
    assert behind >= 2, (len(prompt), hit_point)
    sliding = kv._groups[1].prefix
    for serial in serials[:behind]:  # evict what the follow-up's hit does not need in the sliding group
        block_id = sliding.block_for(serial)
        assert block_id is not None and kv._pool.is_retained(block_id)
        sliding.forget_block(block_id)
        kv._pool.discard_retained(block_id)
    kv.check_invariants()
    follow_up = router_spec(engine, blocks, 2, first.text + " " + make_text(10, 2), 12)
    before = kv.stats().num_prefix_hit_tokens
    driver.run(BatchSpec(id=1, requests=(follow_up,)))
    assert kv.stats().num_prefix_hit_tokens - before >= hit_point - BLOCK_SIZE > behind * BLOCK_SIZE
    for r in (first, follow_up):
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), 12), r.id
    driver.assert_idle()


def test_triton_kernels_read_each_layers_group_table_past_the_window(hybrid_dir, hf_greedy, monkeypatch):
    """The CUDA code path (Triton store / prefill / decode, interpreted on CPU) with one block table per
    group: the sliding layer's kernels get the sliding group's table, whose leading entries are holes
    (the scratch block) once a query is past the window -- in decode, and in the prefill that continues
    a prompt the router cut after 12 tokens -- and the full layer's get the full group's, which has none.
    Token-exact against HF."""
    import tgi_paged_kernels

    calls = route_to_triton(monkeypatch)
    seen: list[tuple[str, int | None, bool]] = []  # per attention call: kernel, the layer's window, a hole
    kernels = ("paged_decode_attention", "paged_prefill_attention")

    for name in kernels:
        routed = getattr(tgi_paged_kernels, name)

        def record(q, k_cache, v_cache, block_tables, *args, _name=name, _routed=routed, **kw):
            seen.append((_name, kw.get("sliding_window"), bool((block_tables[:, 0] == SCRATCH_BLOCK).any())))
            return _routed(q, k_cache, v_cache, block_tables, *args, **kw)

        monkeypatch.setattr(tgi_paged_kernels, name, record)
    # The native CPU decode layer (Gemma 3's form is described) would take decode off the kernels' path.
    engine = make_engine(
        hybrid_dir, num_blocks=32, block_size=BLOCK_SIZE, TGI_PAGED_OVERCOMMIT="4", TGI_PAGED_NATIVE_LAYERS="0"
    )
    seen.clear()  # the load-time checks of the fused attention ran over scratch pools of their own
    assert engine.kv.group_windows == (None, WINDOW)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    new = 16
    requests = [
        router_spec(engine, blocks, 1, make_text(1, 9), new, chunk_len=12),  # the rest: a prefill past the window
        router_spec(engine, blocks, 2, make_text(2, 3), new),
    ]
    assert len(prompt_ids(engine, requests[0].text)) > 12 + BLOCK_SIZE
    assert all(len(prompt_ids(engine, r.text)) + new > 3 * WINDOW for r in requests)  # far past the window
    holes_seen = 0
    batch = driver.prefill(BatchSpec(id=0, requests=tuple(requests)))
    while batch is not None:
        batch = driver.decode([batch])
        holes_seen = max(holes_seen, engine.kv.stats().num_hole_blocks)
    assert set(LAUNCHERS) <= set(calls)
    assert holes_seen > 0 and engine.kv.stats().num_reclaimed_blocks_total > 0
    # both layers reached both routed kernels; the sliding layer read its holed table in each
    assert {(kernel, window) for kernel, window, _ in seen} == {(k, w) for k in kernels for w in (None, WINDOW)}
    for kernel in kernels:
        assert any(hole for k, window, hole in seen if k == kernel and window == WINDOW), kernel
    assert not any(hole for _, window, hole in seen if window is None)  # never the full layer
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), new), r.id
    driver.assert_idle()


def _fp8_engine(model_dir, **env: str):
    """``make_engine``'s settings with ``--kv-cache-dtype fp8_e4m3fn`` (a CLI option, not an env knob)."""
    settings = {
        "TGI_PAGED_NUM_BLOCKS": "64",
        "TGI_PAGED_BLOCK_SIZE": str(BLOCK_SIZE),
        "PREFIX_CACHING": "1",
        **env,
    }
    cli = {"model_id": str(model_dir), "speculate": 0, "kv_cache_dtype": "fp8_e4m3fn"}
    return build_engine(with_local_model(build_config(cli, settings)))


def test_fp8_kv_tokens_do_not_depend_on_the_grouping(hybrid_dir):
    """fp8 KV quantizes each element with the same scales whichever block it lands in: paging by layer
    group (holes behind the window included) must give exactly the tokens of one page map for all
    layers."""
    runs = {}
    for grouped in ("1", "0"):
        engine = _fp8_engine(hybrid_dir, TGI_PAGED_LAYER_GROUPS=grouped)
        assert engine.runner.kv_dtype is torch.float8_e4m3fn
        assert engine.kv.num_groups == (2 if grouped == "1" else 1)
        blocks = RouterBlocks(engine)
        driver = RouterDriver(engine, blocks)
        requests = [router_spec(engine, blocks, rid, make_text(20 + rid, 4), 24) for rid in (1, 2)]
        driver.run(BatchSpec(id=0, requests=tuple(requests)))
        driver.assert_idle()
        runs[grouped] = ({r.id: driver.tokens[r.id] for r in requests}, engine.kv.stats().num_reclaimed_blocks_total)
    (grouped_tokens, reclaimed), (single_tokens, _) = runs["1"], runs["0"]
    assert reclaimed > 0
    assert grouped_tokens == single_tokens
    assert all(len(t) == 24 for t in grouped_tokens.values())


def test_a_copy_on_write_hit_copies_the_block_in_every_group(hybrid_dir, hf_greedy, monkeypatch):
    """A follow-up whose prompt is the first request's prompt plus more words matches the first's retained
    blocks up to the middle of a block (the first's generated tokens follow there): the partial block
    comes by copy-on-write, once per group, and the follow-up stays token-exact (a group left without
    its copy would attend over garbage for those positions)."""
    engine = make_engine(hybrid_dir, num_blocks=64, block_size=BLOCK_SIZE)
    text = make_text(30, 5)
    n = len(prompt_ids(engine, text))
    assert n % BLOCK_SIZE, n  # the shared run ends mid-block
    matches, copies = [], []
    match_prefix, allocate = engine.kv.match_prefix, engine.kv.allocate

    def spy_match(rid, ids):
        matches.append(match_prefix(rid, ids))
        return matches[-1]

    def spy_allocate(rid, num_tokens):
        allocation = allocate(rid, num_tokens)
        if allocation is not None:
            copies.extend(allocation.copies)
        return allocation

    monkeypatch.setattr(engine.kv, "match_prefix", spy_match)
    monkeypatch.setattr(engine.kv, "allocate", spy_allocate)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    first = router_spec(engine, blocks, 1, text, 12)
    driver.run(BatchSpec(id=0, requests=(first,)))
    assert not copies
    follow_up = router_spec(engine, blocks, 2, text + " " + make_text(31, 3), 12)
    assert prompt_ids(engine, follow_up.text)[:n] == prompt_ids(engine, text)
    driver.run(BatchSpec(id=1, requests=(follow_up,)))
    hit = matches[-1]
    assert hit.copy_src is not None and hit.num_copy_tokens == n % BLOCK_SIZE
    assert hit.num_cached_tokens == n and hit.num_shared_blocks == n // BLOCK_SIZE
    assert len(copies) == 2 and len({c.src for c in copies}) == len({c.dst for c in copies}) == 2  # one a group
    assert all(c.num_tokens == n % BLOCK_SIZE for c in copies)
    for r in (first, follow_up):
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), 12), r.id
    driver.assert_idle()


def test_prefill_chunks_longer_than_the_window_keep_the_sliding_group_bounded(hybrid_dir, hf_greedy):
    """A prompt several windows long, prefilled in 16-token chunks (Warmup's budget, the router's
    ``chunk_len``): each chunk reads its window and itself, so the sliding group gives back what is behind
    it between chunks while the full group keeps every block; token-exact against HF."""
    chunk = 16
    engine = make_engine(hybrid_dir, num_blocks=64, block_size=BLOCK_SIZE)
    router_warmup(engine, chunk)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    request = router_spec(engine, blocks, 1, make_text(40, 16), 8, chunk_len=chunk)
    n = len(prompt_ids(engine, request.text))
    assert n > 2 * chunk and chunk > WINDOW  # three chunks or more, each longer than the window
    chunk_bound = max_resident_blocks(WINDOW, BLOCK_SIZE, chunk)
    behind_during_prefill = 0  # sliding-group blocks given back while the prompt was still being prefilled
    batch = driver.prefill(BatchSpec(id=0, requests=(request,)))
    while batch is not None:
        state = engine.requests[1]
        full, sliding = (m.num_physical_blocks for m in engine.kv._maps(1))
        assert full == -(-state.num_computed // BLOCK_SIZE), (state.num_computed, full)
        assert sliding <= chunk_bound, (state.num_computed, sliding)
        if not state.prefill_done:
            behind_during_prefill = max(behind_during_prefill, full - sliding)
        batch = driver.decode([batch])
    assert behind_during_prefill > 0
    assert driver.tokens[1] == hf_greedy(hybrid_dir, prompt_ids(engine, request.text), 8)
    driver.assert_idle()
