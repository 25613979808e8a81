"""DeepSeek-V3 (multi-head latent attention) through the shard engine, beyond the family matrix's scenarios:
the latent read through the pool's value view by every CPU decode kernel, prefix retention (whole blocks and a
copy-on-write hit), fp8 KV with swap preemption, LoRA on the attention's projections, and the host and disk KV
tiers.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import RouterDriver, make_engine, make_text, prompt_ids, router_warmup, spec
from tests.helpers.family_models import FAMILY_BY_NAME, write_family_model
from tgi_paged_backend.engine import build_engine
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.model_files import with_local_model

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return write_family_model(FAMILY_BY_NAME["DeepSeek-V3"], tmp_path_factory.mktemp("deepseek_v3"))


@pytest.mark.parametrize("cpu_decode", ["native", "compiled", "sdpa"])
def test_every_cpu_decode_kernel_is_exact(v3_dir, hf_greedy, cpu_decode):
    # Each reads the pool's value view (the latent's first kv_lora_rank columns, K's strides): the C++ kernel, the
    # compiled one and the matmul pair per KV head.
    engine = make_engine(v3_dir, num_blocks=48, block_size=BLOCK_SIZE, TGI_PAGED_CPU_DECODE=cpu_decode)
    requests = [spec(rid, make_text(rid, words), new) for rid, words, new in ((1, 3, 6), (2, 8, 5), (3, 5, 7))]
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(v3_dir, prompt_ids(engine, r.text), r.stopping.max_new_tokens)
    driver.assert_idle()


def test_prefix_hits_and_a_copy_on_write_hit_are_exact(v3_dir, hf_greedy):
    engine = make_engine(v3_dir, num_blocks=48, block_size=BLOCK_SIZE)
    text = make_text(40, 5)  # 21 tokens: the shared run ends mid-block
    RouterDriver(engine).run(BatchSpec(id=0, requests=(spec(1, text, 6),)))
    copies = []
    copy_blocks = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda src, dst: (copies.append(len(src)), copy_blocks(src, dst))
    follow_up = text + " " + make_text(41, 3)
    ids = prompt_ids(engine, follow_up)
    before = engine.stats.prefix_hit_tokens
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=1, requests=(spec(2, follow_up, 6),)))
    assert engine.stats.prefix_hit_tokens - before >= BLOCK_SIZE  # whole retained blocks reused
    assert driver.tokens[2] == hf_greedy(v3_dir, ids, 6)
    assert len(prompt_ids(engine, text)) % BLOCK_SIZE and copies  # the mid-block run came by copy-on-write


def _fp8_engine(model_dir, **env: str):
    settings = {"TGI_PAGED_BLOCK_SIZE": str(BLOCK_SIZE), "PREFIX_CACHING": "1", **env}
    cli = {"model_id": str(model_dir), "speculate": 0, "kv_cache_dtype": "fp8_e4m3fn"}
    return build_engine(with_local_model(build_config(cli, settings)))


def test_fp8_latent_survives_swap_preemption_byte_for_byte(v3_dir):
    """fp8 KV stores each latent entry once, in fp8: a run preempted by swap (blocks to CPU and back) gives the
    tokens of a run with room for everyone."""
    runs = {}
    for name, env in (
        ("roomy", {"TGI_PAGED_NUM_BLOCKS": "64"}),
        ("swapped", {"TGI_PAGED_NUM_BLOCKS": "9", "TGI_PAGED_PREEMPTION": "swap", "TGI_PAGED_SWAP_SPACE_GB": "0.01"}),
    ):
        engine = _fp8_engine(v3_dir, TGI_PAGED_OVERCOMMIT="4", **env)
        assert engine.runner.kv_dtype is torch.float8_e4m3fn
        assert engine.runner.block_bytes == BLOCK_SIZE * (16 + 8) * 2  # (kv_lora_rank + rope) x layers x 1 byte
        driver = RouterDriver(engine)
        requests = [spec(rid, make_text(60 + rid, 3), 12) for rid in (1, 2, 3)]
        driver.run(BatchSpec(id=0, requests=tuple(requests)))
        driver.assert_idle()
        runs[name] = ({r.id: driver.tokens[r.id] for r in requests}, engine.stats.preemptions["swap"])
    assert runs["swapped"][1] > 0 and runs["roomy"][1] == 0
    assert runs["swapped"][0] == runs["roomy"][0]


def test_lora_on_the_latent_attentions_projections_is_exact(v3_dir, tmp_path, hf_greedy):
    """An adapter on the query (q_a_proj, q_b_proj), the latent's projection (kv_a_proj_with_mqa) and o_proj, which
    the latent attention calls as modules; one on kv_b_proj (taken apart into the absorbed per-head weights) is
    refused at start."""
    from tests.helpers.lora_adapters import peft_greedy, write_adapter
    from tgi_paged_backend.config import ConfigError

    adapter = write_adapter(v3_dir, tmp_path / "mla", targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"))
    engine = make_engine(v3_dir, num_blocks=48, block_size=BLOCK_SIZE, LORA_ADAPTERS=f"mla={adapter}")
    texts = [make_text(70 + rid, 3 + 2 * rid) for rid in (1, 2)]
    requests = [spec(rid, text, 6, adapter_id="mla") for rid, text in zip((1, 2), texts, strict=True)]
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    want = peft_greedy(v3_dir, adapter, [prompt_ids(engine, t) for t in texts], 6)
    assert [driver.tokens[1], driver.tokens[2]] == want
    assert want != [hf_greedy(v3_dir, prompt_ids(engine, t), 6) for t in texts]  # the adapter changes tokens
    absorbed = write_adapter(v3_dir, tmp_path / "kv_b", targets=("kv_b_proj",))
    with pytest.raises(ConfigError, match="kv_b_proj"):
        make_engine(v3_dir, num_blocks=48, block_size=BLOCK_SIZE, LORA_ADAPTERS=f"kv_b={absorbed}")


def test_host_and_disk_tiers_carry_the_fp8_latent_bit_for_bit(v3_dir, tmp_path):
    """The host tier's rows hold one latent tensor per layer (no value copy): loads from RAM and, after a
    restart, from disk give the tier-off tokens."""
    from tests.engine import test_shard_engine_kv_tiers_matrix as tiers

    fp8 = dict(kv_cache_dtype="fp8_e4m3fn")
    off = tiers.build(v3_dir, **fp8)
    want = tiers.visit(off, tiers.TEXTS, rounds=2)
    on = tiers.build(v3_dir, host_rows=64, **fp8)
    assert on.runner.pool.host_row_shape()[0] == 2  # one tensor per layer, two layers
    assert tiers.visit(on, tiers.TEXTS, rounds=2) == want
    assert tiers.counters(on).loaded_blocks > 0
    first = tiers.build(v3_dir, host_rows=4, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path), **fp8)
    tiers.visit(first, tiers.TEXTS, rounds=1)
    first.close()
    second = tiers.build(v3_dir, host_rows=64, TGI_PAGED_DISK_CACHE_DIR=str(tmp_path), **fp8)
    assert tiers.visit(second, tiers.TEXTS, rounds=1) == {k: v for k, v in want.items() if k <= 3}
    assert second.stats.disk_hit_tokens > 0 and second.tier_io.traffic.invalid_fetches == 0


def test_decompressed_prefill_is_exact(v3_dir, hf_greedy, monkeypatch):
    """Prefill steps that expand the latents to per-head keys and values (prompts, chunks, a follow-up over retained
    blocks) give HF's tokens; decode steps stay absorbed."""
    from tgi_paged_backend.runner.families.mla import PagedLatentAttention

    monkeypatch.setattr(PagedLatentAttention, "prefill_form", "decompressed")
    calls = []
    attend = PagedLatentAttention.attend_decompressed

    def counting(self, metadata, *args):
        calls.append(metadata.batch.is_decode)
        return attend(self, metadata, *args)

    monkeypatch.setattr(PagedLatentAttention, "attend_decompressed", counting)
    engine = make_engine(v3_dir, num_blocks=48, block_size=BLOCK_SIZE)
    router_warmup(engine, 16)  # prefill steps of 16 tokens: the long prompt comes in chunks
    texts = [make_text(80 + rid, words) for rid, words in ((1, 3), (2, 14), (3, 6))]
    driver = RouterDriver(engine)
    driver.run(BatchSpec(id=0, requests=tuple(spec(rid, t, 6) for rid, t in zip((1, 2, 3), texts, strict=True))))
    follow_up = texts[1] + " " + make_text(90, 2)
    before = engine.stats.prefix_hit_tokens
    driver.run(BatchSpec(id=1, requests=(spec(4, follow_up, 5),)))
    assert engine.stats.prefix_hit_tokens > before
    for rid, text in zip((1, 2, 3, 4), [*texts, follow_up], strict=True):
        n = 5 if rid == 4 else 6
        assert driver.tokens[rid] == hf_greedy(v3_dir, prompt_ids(engine, text), n), rid
    assert calls and not any(calls)


def test_auto_prefill_decompresses_long_prompts_only(v3_dir):
    """``auto`` at DeepSeek-V3's sizes (kv_lora_rank 512, rope 64, nope 128, v 128): a 2048-token prompt
    decompresses, 64-token chunks of 16 requests and any decode (one token per request) stay absorbed."""
    from types import SimpleNamespace

    from tgi_paged_backend.runner.families.mla import PagedLatentAttention

    sizes = SimpleNamespace(
        prefill_form="auto", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    decompresses = PagedLatentAttention.decompresses

    def tables(requests: int, tokens: int) -> torch.Tensor:
        return torch.zeros((requests, tokens // 16), dtype=torch.int32)

    assert decompresses(sizes, 2048, tables(1, 2048), 16)
    assert not decompresses(sizes, 16 * 64, tables(16, 4096), 16)
    assert not decompresses(sizes, 8, tables(8, 8192), 16)
