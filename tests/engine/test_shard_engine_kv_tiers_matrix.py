"""KV tiers (issue 42) across the engine's features: the same greedy tokens with the host tier on as off,
with KV layer groups (full + sliding), LoRA adapters (chains salted per adapter: never a load across
adapters), fp8 KV (a load is a bit copy; a disk round trip keeps the raw bytes), speculative decoding; a
disk directory another engine layout wrote is never served; a host tier smaller than one step's offloads
evicts (or loses blocks) instead of failing.

Each scenario visits a few conversations round-robin on a pool that holds about one of them, so the
pool evicts their prefixes and the next visit finds them in the host tier (or on disk after a restart).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import TINY_KIND_FIXTURES, RouterDriver, make_text, spec
from tests.helpers.family_models import FAMILIES, write_family_model
from tests.helpers.lora_adapters import LLAMA_TARGETS, write_adapter
from tgi_paged_backend.engine import build_engine
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.memory.prefix_cache import chain_root
from tgi_paged_backend.model_files import with_local_model

TEXTS = [make_text(700 + i, 40) for i in range(3)]


def build(model_dir: Path, *, num_blocks: int = 24, block_size: int = 8, host_rows: int = 0, **opts: str):
    """An engine like ``conftest.make_engine`` with ``host_rows`` host-tier rows (0: tier off).
    ``opts``: ``kv_cache_dtype`` / ``speculate`` go on the command line, the rest are env knobs."""
    cli = {"model_id": str(model_dir), "speculate": int(opts.pop("speculate", 0))}
    if "kv_cache_dtype" in opts:
        cli["kv_cache_dtype"] = opts.pop("kv_cache_dtype")
    settings = {
        "TGI_PAGED_NUM_BLOCKS": str(num_blocks),
        "TGI_PAGED_BLOCK_SIZE": str(block_size),
        "TGI_PAGED_SWAP_SPACE_GB": "0.01",
        "PREFIX_CACHING": "1",
        "TGI_PAGED_SPECULATE_MAX_BATCH": "64",
        **{k: str(v) for k, v in opts.items()},
    }

    def make(gb: str, env: dict[str, str] = settings):
        return build_engine(with_local_model(build_config(dict(cli), {**env, "TGI_PAGED_HOST_CACHE_GB": gb})))

    if not host_rows:
        return make("0")
    # The probe only measures a block: no disk tier (a disk directory needs a host tier).
    probe = make("0", {k: v for k, v in settings.items() if k != "TGI_PAGED_DISK_CACHE_DIR"})
    block_bytes = probe.runner.pool.block_bytes
    probe.close()
    engine = make(f"{host_rows * block_bytes / 2**30 * 1.0001:.12f}")
    assert engine.kv.tiers is not None and engine.kv.tiers.host.num_rows == host_rows
    return engine


def visit(engine, texts: list[str], rounds: int, *, first_id: int = 1, max_new: int = 4, **kw) -> dict[int, list[int]]:
    """Each text in turn, ``rounds`` times, one request at a time; tokens by request id."""
    out: dict[int, list[int]] = {}
    rid = first_id
    for _ in range(rounds):
        for text in texts:
            driver = RouterDriver(engine)
            driver.run(BatchSpec(id=rid, requests=(spec(rid, text, max_new, **kw),)))
            out[rid] = driver.tokens[rid]
            rid += 1
    return out


def counters(engine):
    assert engine.kv.tiers is not None
    return engine.kv.tiers.counters


# ------------------------------------------------------------------------------------ KV layer groups


@pytest.fixture(scope="module", params=["Gemma3", "gpt-oss"])
def hybrid_dir(request, tmp_path_factory):
    family = next(f for f in FAMILIES if f.name == request.param)
    return write_family_model(family, tmp_path_factory.mktemp(request.param))


GROUP_TEXTS = [make_text(730 + i, 10) for i in range(3)]
GROUP_MORE = [t + " " + make_text(760 + i, 3) for i, t in enumerate(GROUP_TEXTS)]
GROUP_POOL = dict(num_blocks=31, block_size=4)


def visit_conversations(engine) -> dict[int, list[int]]:
    """Round 1, then each conversation goes on (its prompt extended): a hit needs the sliding group's
    window blocks before the hit point, which a retained chain has at its end, so round 2 hits there."""
    return {**visit(engine, GROUP_TEXTS, 1), **visit(engine, GROUP_MORE, 1, first_id=4)}


def test_layer_groups_host_and_disk_tiers_keep_the_tokens(hybrid_dir, tmp_path):
    """Full + sliding layers: an entry holds the anchor (full) block and the sliding block when it was
    still resident; the loaded chains give the tier-off tokens, from RAM and after a restart from disk."""
    off = build(hybrid_dir, **GROUP_POOL)
    assert off.kv.num_groups == 2
    want = visit_conversations(off)
    on = build(hybrid_dir, host_rows=96, **GROUP_POOL)
    assert visit_conversations(on) == want
    loaded = counters(on).loaded_blocks
    assert loaded > 0 and counters(on).offloaded_rows > counters(on).offloaded_blocks
    assert counters(on).loaded_rows > loaded  # sliding rows came back with their anchor blocks
    # a hit needs the window's blocks before the hit point: a conversation whose round-1 prompt ends
    # mid-block has given back the sliding block the hit point needs (loaded, but not matched)
    assert on.stats.prefix_hit_tokens >= off.stats.prefix_hit_tokens + 4 * GROUP_POOL["block_size"]
    on.kv.check_invariants()
    on.kv.tiers.host.check_invariants()
    first = build(hybrid_dir, host_rows=12, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path), **GROUP_POOL)
    assert visit(first, GROUP_TEXTS, 1) == {k: v for k, v in want.items() if k <= 3}
    first.close()
    second = build(hybrid_dir, host_rows=96, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path), **GROUP_POOL)
    assert visit(second, GROUP_MORE, 1, first_id=4) == {k: v for k, v in want.items() if k > 3}
    assert second.stats.disk_hit_tokens > 0 and counters(second).loaded_rows > counters(second).loaded_blocks
    assert second.stats.prefix_hit_tokens >= 4 * GROUP_POOL["block_size"]
    assert second.tier_io.traffic.invalid_fetches == 0
    second.kv.check_invariants()


# ------------------------------------------------------------------------------------ LoRA adapters


@pytest.fixture(scope="module")
def lora_env(request, tmp_path_factory) -> tuple[Path, str]:
    base = request.getfixturevalue(TINY_KIND_FIXTURES["llama"])
    root = tmp_path_factory.mktemp("tier-lora")
    a = write_adapter(base, root / "a", r=4, alpha=8, targets=LLAMA_TARGETS, seed=21)
    b = write_adapter(base, root / "b", r=8, alpha=16, targets=("q_proj", "v_proj"), seed=22)
    return base, f"a={a},b={b}"


def test_lora_adapters_with_the_host_tier_keep_the_tokens(lora_env):
    base, adapters = lora_env
    jobs = [(text, adapter) for text in TEXTS[:2] for adapter in ("", "a", "b")]

    def run(engine):
        out = {}
        for rid, (text, adapter) in enumerate(jobs * 2, start=1):
            driver = RouterDriver(engine)
            driver.run(BatchSpec(id=rid, requests=(spec(rid, text, 4, adapter_id=adapter),)))
            out[rid] = driver.tokens[rid]
        return out

    want = run(build(base, LORA_ADAPTERS=adapters))
    assert len({tuple(want[i]) for i in (1, 2, 3)}) == 3, "the adapters should change the tokens"
    on = build(base, host_rows=64, LORA_ADAPTERS=adapters)
    assert run(on) == want
    assert counters(on).loaded_blocks > 0
    on.kv.check_invariants()


def test_a_host_hit_under_one_adapter_never_serves_another(lora_env):
    """The same prompt under adapter a, evicted to the host tier, then under b: b computes its prefix
    (nothing loaded), then a again loads it."""
    base, adapters = lora_env
    want = {}
    off = build(base, LORA_ADAPTERS=adapters)
    for rid, (text, adapter) in enumerate([(TEXTS[0], "a"), (TEXTS[1], "a"), (TEXTS[0], "b")], start=1):
        want[rid] = visit(off, [text], 1, first_id=rid, adapter_id=adapter)[rid]
    on = build(base, host_rows=64, LORA_ADAPTERS=adapters)
    assert visit(on, [TEXTS[0]], 1, first_id=1, adapter_id="a")[1] == want[1]
    assert visit(on, [TEXTS[1]], 1, first_id=2, adapter_id="a")[2] == want[2]  # pushes TEXTS[0] to the host
    assert counters(on).offloaded_blocks > 0
    loaded, hits = counters(on).loaded_blocks, on.stats.prefix_hit_tokens
    assert visit(on, [TEXTS[0]], 1, first_id=3, adapter_id="b")[3] == want[3]
    assert counters(on).loaded_blocks == loaded, "adapter b was served adapter a's K/V"
    assert on.stats.prefix_hit_tokens == hits
    visit(on, [TEXTS[0]], 1, first_id=4, adapter_id="a")
    assert counters(on).loaded_blocks > loaded, "adapter a's own chain should load"


# ------------------------------------------------------------------------------------ fp8 KV


def test_fp8_kv_tier_loads_and_disk_round_trip_are_bit_copies(tiny_llama_dir, tmp_path):
    fp8 = dict(kv_cache_dtype="fp8_e4m3fn")
    off = build(tiny_llama_dir, **fp8)
    assert off.runner.kv_dtype is torch.float8_e4m3fn
    want = visit(off, TEXTS, rounds=2)
    on = build(tiny_llama_dir, host_rows=64, **fp8)
    assert visit(on, TEXTS, rounds=2) == want
    assert counters(on).loaded_blocks > 0
    first = build(tiny_llama_dir, host_rows=4, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path), **fp8)
    visit(first, TEXTS, rounds=1)
    first.close()
    second = build(tiny_llama_dir, host_rows=64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path), **fp8)
    assert visit(second, TEXTS, rounds=1) == {k: v for k, v in want.items() if k <= 3}
    assert second.stats.disk_hit_tokens > 0 and second.tier_io.traffic.invalid_fetches == 0


# ------------------------------------------------------------------------------------ speculation


def test_speculation_with_the_host_tier_keeps_the_tokens(tiny_llama_dir):
    texts = [t + " " + t for t in TEXTS]  # repeats: the n-gram proposer finds drafts
    off = build(tiny_llama_dir, num_blocks=40, speculate=3)
    want = visit(off, texts, rounds=2, max_new=12)
    on = build(tiny_llama_dir, num_blocks=40, speculate=3, host_rows=96)
    assert visit(on, texts, rounds=2, max_new=12) == want
    assert counters(on).loaded_blocks > 0
    assert on.stats.draft_tokens > 0
    on.kv.check_invariants()


# ------------------------------------------------------------------------------------ foreign files


@pytest.mark.parametrize("other", [dict(block_size=4), dict(kv_cache_dtype="fp8_e4m3fn")])
def test_a_disk_dir_of_another_layout_is_never_served(tiny_llama_dir, tmp_path, other):
    """Another block size or KV dtype salts every key differently: nothing is asked for. A foreign file
    renamed to a key this engine asks for fails the fingerprint check: ignored and counted."""
    want = visit(build(tiny_llama_dir), TEXTS, rounds=1)
    layout = dict(num_blocks=48 if "block_size" in other else 24, **other)
    foreign = build(tiny_llama_dir, host_rows=4, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path), **layout)
    visit(foreign, TEXTS, rounds=1)
    foreign.close()
    files = sorted(tmp_path.glob("rank-0/*.kv"))
    assert files
    second = build(tiny_llama_dir, host_rows=64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    assert second._disk is not None
    prompt = second.prompt_tokenizer.encode(TEXTS[0], 10_000, True)
    wanted = second.kv.tiers.missing_blocks(prompt, chain_root(0), None)
    assert wanted and not any(second._disk.contains(b.key) for b in wanted), "a foreign key collided"
    for block, path in zip(wanted, files):  # disguise foreign files as the keys we will ask for
        path.rename(path.with_name(block.key.hex() + ".kv"))
    third = build(tiny_llama_dir, host_rows=64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path))
    assert visit(third, TEXTS, rounds=1) == want
    assert third.stats.disk_hit_tokens == 0
    assert third._disk.stats().ignored_files > 0


# ------------------------------------------------------------------------------------ a tiny host tier


def test_a_host_tier_smaller_than_a_step_of_offloads(tiny_llama_dir):
    """Two rows, while one visit evicts a whole conversation: entries are evicted (or lost) every step,
    nothing fails and the tokens stay the tier-off ones."""
    want = visit(build(tiny_llama_dir), TEXTS, rounds=2)
    on = build(tiny_llama_dir, host_rows=2)
    assert visit(on, TEXTS, rounds=2) == want
    host = on.kv.tiers.host
    assert host.num_evicted + counters(on).lost_blocks > 0
    assert host.num_entries <= 2
    host.check_invariants()
    on.kv.check_invariants()
