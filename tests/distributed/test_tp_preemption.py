"""Every family served at tensor parallel 2 stays token-exact under preemption (issue 26): for each family of
``test_tp_families.MUST_SERVE``, two gloo ranks build the tensor-parallel shard engine over a pool too small
for the batch, so requests are preempted, and rank 0's greedy tokens equal HF's for every request. Each family
is asserted to have preempted in its mode, or the check would prove nothing.

The families alternate recompute and swap; those whose sharded layout is most at risk when KV pages leave
and come back run in both modes: the MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss), the fused
projections (Phi-3's qkv and gate_up, GPT-NeoX's query_key_value, GPT-2's c_attn) and GPT-BigCode's one KV
head, replicated on every rank.

One spawn serves every (family, mode) pair: each rank builds an engine per pair through ``build_engine`` and
closes it, which destroys the process groups, and the next engine joins a fresh group on its own port (a
rank may still hold the previous store while its peer rendezvouses, so the ports are never reused). The
worker is this module (``python -m tests.distributed.test_tp_preemption --rank ...``), as in
``test_tp_lora.py``: the runner-level harness (``tp_worker.py``) has no engine, so nothing preempts there.

Speculative decoding (issue 23) runs the same way for a dense, a MoE, a fused-projection and a one-KV-head
family with ``--speculate 3``: n-gram drafts verified on both ranks alike, rejected positions given back,
still token-exact under preemption; and with Medusa heads (``--model-id`` a Medusa checkpoint over a dense
and a MoE base), every rank computing the same proposals from the same replicated hidden state.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 10
PROMPT_WORDS = (5, 8, 4, 7)
BOTH_MODES = {"Mixtral", "Qwen2-MoE", "Qwen3-MoE", "gpt-oss", "Phi3", "GPT-NeoX", "GPT-2", "GPT-BigCode"}
"""MoE, fused-projection and replicated-KV-head families: checked under recompute and under swap."""
POOL = {"TGI_PAGED_NUM_BLOCKS": "10", "TGI_PAGED_BLOCK_SIZE": "4", "TGI_PAGED_SPECULATE_MAX_BATCH": "64"}
"""9 usable blocks of 4 tokens for 4 requests of ~20-30 tokens each: one fits, all four do not (and drafts
in batched decode steps too)."""


def _worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="unused: every pair has its own port")
    parser.add_argument(
        "--pairs", required=True, help="JSON list of [name, model dir, preemption mode, port, speculate]"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--env", default="{}", help="JSON: more settings for every engine")
    args = parser.parse_args()

    from tests.engine.conftest import make_text
    from tests.helpers.family_models import num_kv_groups
    from tgi_paged_backend.engine import build_engine
    from tgi_paged_backend.engine.types import BatchSpec, RequestSpec, StoppingParams
    from tgi_paged_backend.envs import build_config
    from tgi_paged_backend.model_files import with_local_model

    texts = [make_text(700 + i, n) for i, n in enumerate(PROMPT_WORDS)]
    requests = tuple(
        RequestSpec(
            id=i + 1,
            text=text,
            truncate=10_000,
            stopping=StoppingParams(max_new_tokens=MAX_NEW, ignore_eos_token=True),
        )
        for i, text in enumerate(texts)
    )
    results = {}
    for name, model, preemption, port, speculate in json.loads(args.pairs):
        print(f"rank {args.rank}: {name} under {preemption} preemption (port {port})", flush=True)
        settings = {
            "RANK": str(args.rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TGI_PAGED_DIST_TIMEOUT_S": "60",
            "TGI_PAGED_PREEMPTION": preemption,
            "TGI_PAGED_SWAP_SPACE_GB": "0.01",
            **POOL,
            # KV layer groups: a block holds 1/groups of the layers, so the same memory is groups x the blocks
            "TGI_PAGED_NUM_BLOCKS": str((int(POOL["TGI_PAGED_NUM_BLOCKS"]) - 1) * num_kv_groups(model) + 1),
            **json.loads(args.env),
        }
        config = build_config({"model_id": model, "sharded": True, "speculate": speculate}, settings)
        engine = build_engine(with_local_model(config))  # a Medusa checkpoint: its base model with its heads
        try:
            prompts = {r.id: engine.prompt_tokenizer.encode(r.text, r.truncate, True) for r in requests}
            tokens: dict[int, list[int]] = {r.id: [] for r in requests}
            result = engine.prefill(BatchSpec(id=0, requests=requests), None)
            for _ in range(40 * MAX_NEW):
                for g in result.generations:  # rank 0 only
                    tokens[g.request_id].extend(g.tokens.ids)
                if result.batch is None:
                    break
                result = engine.decode([result.batch.id])
            assert result.batch is None, f"{name} under {preemption} preemption: the batch did not finish"
            preemptions = dict(engine.stats.preemptions)
            drafts = (engine.stats.draft_tokens, engine.stats.accepted_tokens)
            tiers = engine.kv.tiers
            loaded = tiers.counters.loaded_blocks if tiers is not None else 0
        finally:
            engine.close()
        results[f"{name}/{preemption}"] = {
            "prompts": prompts,
            "tokens": tokens,
            "preemptions": preemptions,
            "drafts": drafts,
            "host_tier_loads": loaded,
        }
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(results))


def _pairs() -> list[tuple[str, str]]:
    """(family, mode): MUST_SERVE in the matrix's order, alternating modes, :data:`BOTH_MODES` in both."""
    from tests.distributed.test_tp_families import MUST_SERVE
    from tests.helpers.family_tp import tp_families

    names = [f.name for f in tp_families() if f.name in MUST_SERVE]
    assert set(names) == MUST_SERVE, f"not available in this transformers: {sorted(MUST_SERVE - set(names))}"
    pairs = []
    for i, name in enumerate(names):
        modes = ("recompute", "swap") if name in BOTH_MODES else (("recompute", "swap")[i % 2],)
        pairs += [(name, mode) for mode in modes]
    return pairs


def test_every_served_family_stays_exact_under_preemption(tmp_path: Path) -> None:
    _run_pairs(_pairs(), tmp_path, speculate=0)


SPECULATING = [("Llama", "recompute"), ("Mixtral", "swap"), ("Phi3", "recompute"), ("GPT-BigCode", "swap")]
"""Dense, MoE, fused projections, one replicated KV head."""


def test_speculation_stays_exact_at_tensor_parallel_two(tmp_path: Path) -> None:
    results = _run_pairs(SPECULATING, tmp_path, speculate=3)
    assert sum(r["drafts"][0] for r in results.values()) > 0, "nothing was drafted: the check would prove nothing"


MEDUSA = [("Llama", "recompute"), ("Qwen3-MoE", "swap")]
"""Medusa heads (their own projections, and the base lm_head's) over a dense and a MoE base model."""


def test_medusa_stays_exact_at_tensor_parallel_two(tmp_path: Path) -> None:
    results = _run_pairs(MEDUSA, tmp_path, speculate=None, medusa=True)
    assert all(r["drafts"][0] > 0 for r in results.values()), "nothing was drafted: the check would prove nothing"


def test_kv_tiers_stay_exact_at_tensor_parallel_two(tmp_path: Path) -> None:
    """Issue 42 at TP=2: prefix retention with a host tier and a disk tier under recompute preemption (the
    preempted requests' retained blocks are evicted, offloaded and loaded back on resume): every rank's books
    stay identical (the per-step check), the tokens equal HF's, and the host tier did load blocks."""
    env = {"PREFIX_CACHING": "1", "TGI_PAGED_HOST_CACHE_GB": "0.0005", "TGI_PAGED_DISK_CACHE_DIR": str(tmp_path / "kv")}
    results = _run_pairs([("Llama", "recompute"), ("Gemma2", "recompute")], tmp_path, speculate=0, env=env)
    assert all(r["host_tier_loads"] > 0 for r in results.values()), {
        k: r["host_tier_loads"] for k, r in results.items()
    }


def _run_pairs(
    pairs: list[tuple[str, str]],
    tmp_path: Path,
    *,
    speculate: int | None,
    medusa: bool = False,
    env: dict[str, str] | None = None,
) -> dict:
    from integration.net import free_port
    from tests.helpers.family_models import FAMILIES, write_family_model
    from tests.helpers.paged_driver import greedy_hf
    from tests.helpers.tiny_models import EOS_ID, PAD_ID, load_reference
    from tests.helpers.tp_spawn import run_two_ranks

    families = {f.name: f for f in FAMILIES}
    models = {name: write_family_model(families[name], tmp_path / name) for name in dict(pairs)}
    served = dict(models)
    if medusa:  # --model-id names the heads; each rank serves their base model with them
        from tests.helpers.medusa_heads import write_medusa

        for i, name in enumerate(models):
            write_medusa(tmp_path / f"{name}-medusa", models[name], own_out=i % 2 == 0, scale=0.05)
            served[name] = tmp_path / f"{name}-medusa"
    ports: list[int] = []
    while len(ports) < len(pairs):  # distinct: a port is never rendezvoused on twice
        port = free_port()
        ports += [port] if port not in ports else []
    argv = ["--pairs", json.dumps([[n, str(served[n]), m, p, speculate] for (n, m), p in zip(pairs, ports)])]
    argv += ["--env", json.dumps(env or {})]
    results = run_two_ranks("tests.distributed.test_tp_preemption", argv, tmp_path / "result.json", timeout_s=600)

    failures = []
    for name, mode in pairs:
        result = results[f"{name}/{mode}"]
        if result["preemptions"][mode] == 0:
            failures.append(f"{name}: no {mode} preemption ({result['preemptions']}): the check would prove nothing")
            continue
        prompts = [result["prompts"][str(i + 1)] for i in range(len(PROMPT_WORDS))]
        expected = greedy_hf(load_reference(models[name]), prompts, MAX_NEW, [EOS_ID], PAD_ID)
        got = [result["tokens"][str(i + 1)] for i in range(len(PROMPT_WORDS))]
        if got != expected:
            failures.append(
                f"{name} at TP=2 under {mode} preemption (speculate {speculate}) differs from HF: {got} != {expected}"
            )
    assert not failures, "\n".join(failures)
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker()
