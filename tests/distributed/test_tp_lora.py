"""Multi-LoRA at tensor parallel 2 (gloo, CPU): two ranks each build the tensor-parallel shard engine
(``build_engine`` with ``WORLD_SIZE=2`` and ``LORA_ADAPTERS``) and serve one mixed batch; rank 0's greedy
tokens equal HF + PEFT's for every request.

The ``full`` adapter targets all seven projections, so LoRA runs on column-parallel layers (q/k/v,
gate/up: B cut to the rank's output rows) and row-parallel ones (o/down: A cut to the rank's input
columns, the partial deltas summed by the layer's all-reduce); ``rowpar`` adapts v_proj and the two
row-parallel layers only, with rsLoRA. The tensor-parallel engine's per-step digest check also makes
both ranks agree on every sampled token.

The worker is this module (``python -m tests.distributed.test_tp_lora --rank ...``): the runner-level
harness (``tests/distributed/tp_worker.py``) drives the runner without requests, so it has no
``adapter_id`` to route.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAX_NEW = 8
ADAPTERS: dict[str, dict] = {
    "full": dict(r=4, alpha=8, seed=21),  # all seven projections
    "rowpar": dict(r=6, alpha=6, targets=("v_proj", "o_proj", "down_proj"), seed=22, use_rslora=True),
}
REQUESTS = [  # (request id, number of words, adapter_id)
    (1, 9, "full"),
    (2, 4, ""),
    (3, 14, "rowpar"),
    (4, 6, "full"),
    (5, 11, "unknown-adapter"),
]


# ------------------------------------------------------------------------------------ worker


def _worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--lora-adapters", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from tests.engine.conftest import make_text
    from tgi_paged_backend.engine import build_engine
    from tgi_paged_backend.engine.types import BatchSpec, RequestSpec, StoppingParams
    from tgi_paged_backend.envs import build_config
    from tgi_paged_backend.lora.layers import LoraLinear
    from tgi_paged_backend.runner.cpu import fast_layers

    fast_layers.PACK_MIN_ELEMENTS = 0  # pack every linear, the LoRA wrappers' base GEMMs included
    settings = {
        "RANK": str(args.rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(args.port),
        "TGI_PAGED_DIST_TIMEOUT_S": "60",
        "TGI_PAGED_NUM_BLOCKS": "48",
        "TGI_PAGED_BLOCK_SIZE": "8",
        "PREFIX_CACHING": "1",
        "LORA_ADAPTERS": args.lora_adapters,
    }
    engine = build_engine(build_config({"model_id": args.model}, settings))
    try:
        requests = tuple(
            RequestSpec(
                id=rid,
                text=make_text(300 + rid, words),
                truncate=10_000,
                stopping=StoppingParams(max_new_tokens=MAX_NEW, ignore_eos_token=True),
                adapter_id=adapter,
            )
            for rid, words, adapter in REQUESTS
        )
        prompts = {r.id: engine.prompt_tokenizer.encode(r.text, r.truncate, True) for r in requests}
        tokens: dict[int, list[int]] = {r.id: [] for r in requests}
        result = engine.prefill(BatchSpec(id=0, requests=requests), None)
        for _ in range(10 * MAX_NEW):
            for g in result.generations:  # rank 0 only: the other ranks report none
                tokens[g.request_id].extend(g.tokens.ids)
            if result.batch is None:
                break
            result = engine.decode([result.batch.id])
        assert result.batch is None, "the batch did not finish"
        unknown, wrapped = engine.adapter_names.num_unknown, engine.runner.lora.num_wrapped
        shapes = sorted(  # this rank's LoRA deltas in the first layer: (in, out) features of A and B
            [m.in_features, int(m.b_stack.shape[1])]
            for name, m in engine.runner.model.named_modules()
            if isinstance(m, LoraLinear) and name.startswith("model.layers.0.")
        )
    finally:
        engine.close()
    if args.rank == 0:
        out = {"prompts": prompts, "tokens": tokens, "num_unknown": unknown, "num_wrapped": wrapped, "shapes": shapes}
        Path(args.out).write_text(json.dumps(out))


# ------------------------------------------------------------------------------------ test


def test_two_rank_engine_serves_adapters_exactly(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from tests.helpers.lora_adapters import peft_greedy, write_adapter
    from tests.helpers.tp_spawn import run_two_ranks

    adapters = {name: write_adapter(tiny_llama_dir, tmp_path / name, **kw) for name, kw in ADAPTERS.items()}
    lora_env = ",".join(f"{name}={path}" for name, path in adapters.items())
    result = run_two_ranks(
        "tests.distributed.test_tp_lora",
        ["--model", str(tiny_llama_dir), "--lora-adapters", lora_env],
        tmp_path / "result.json",
        env={"TRITON_INTERPRET": "1"},
        timeout_s=240,
    )

    assert result["num_unknown"] == 1
    assert result["num_wrapped"] == 3 * 7  # every projection of the three layers, on each rank
    # Sharded deltas (hidden 64, 2 KV heads of 16, MLP 128): column-parallel ones compute half the outputs
    # (q 32, k 16, v 16, gate 64, up 64; q/k/v and gate/up each fused into one GEMM, the deltas on its
    # columns), row-parallel ones (o, down) sit on the local GEMM over half the inputs (32 and 64).
    expected = [[64, 32], [64, 16], [64, 16], [32, 64], [64, 64], [64, 64], [64, 64]]
    assert result["shapes"] == sorted(expected)
    for rid, _, adapter in REQUESTS:
        prompt = result["prompts"][str(rid)]
        (want,) = peft_greedy(tiny_llama_dir, adapters.get(adapter), [prompt], MAX_NEW)
        assert result["tokens"][str(rid)] == want, f"request {rid} (adapter {adapter!r}) differs from PEFT at TP=2"
    # Each adapter changes the model (else the comparison would prove nothing about the sharded deltas).
    prompt = result["prompts"]["1"]
    (base,) = peft_greedy(tiny_llama_dir, None, [prompt], MAX_NEW)
    for name, path in adapters.items():
        assert peft_greedy(tiny_llama_dir, path, [prompt], MAX_NEW)[0] != base, name


if __name__ == "__main__":
    _worker()
