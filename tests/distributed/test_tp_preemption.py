"""The newly sharded layouts at tensor parallel 2 under preemption (issue 26): two ranks each build the
tensor-parallel shard engine over a pool too small for the batch, so requests are preempted by recompute and
by swap, and rank 0's greedy tokens equal HF's for every request, for a MoE family (Mixtral), fused
projections (Phi-3) and a replicated KV head (GPT-BigCode).

The worker is this module (``python -m tests.distributed.test_tp_preemption --rank ...``), as in
``test_tp_lora.py``: the runner-level harness (``tp_worker.py``) has no engine, so nothing preempts there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 10
PROMPT_WORDS = (5, 8, 4, 7)


def _worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--preemption", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from tests.engine.conftest import make_text
    from tgi_paged_backend.engine import build_engine
    from tgi_paged_backend.engine.types import BatchSpec, RequestSpec, StoppingParams
    from tgi_paged_backend.envs import build_config

    settings = {
        "RANK": str(args.rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(args.port),
        "TGI_PAGED_DIST_TIMEOUT_S": "60",
        "TGI_PAGED_NUM_BLOCKS": "10",  # 9 usable blocks of 4 tokens for 4 requests of ~20-30 tokens: preempts
        "TGI_PAGED_BLOCK_SIZE": "4",
        "TGI_PAGED_PREEMPTION": args.preemption,
        "TGI_PAGED_SWAP_SPACE_GB": "0.01",
    }
    engine = build_engine(build_config({"model_id": args.model, "sharded": True}, settings))
    try:
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
        prompts = {r.id: engine.prompt_tokenizer.encode(r.text, r.truncate, True) for r in requests}
        tokens: dict[int, list[int]] = {r.id: [] for r in requests}
        result = engine.prefill(BatchSpec(id=0, requests=requests), None)
        for _ in range(40 * MAX_NEW):
            for g in result.generations:  # rank 0 only
                tokens[g.request_id].extend(g.tokens.ids)
            if result.batch is None:
                break
            result = engine.decode([result.batch.id])
        assert result.batch is None, "the batch did not finish"
        preemptions = dict(engine.stats.preemptions)
    finally:
        engine.close()
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"prompts": prompts, "tokens": tokens, "preemptions": preemptions}))


@pytest.mark.parametrize(
    ("family", "preemption"), [("Mixtral", "recompute"), ("Phi3", "swap"), ("GPT-BigCode", "recompute")]
)
def test_sharded_layouts_stay_exact_under_preemption(family: str, preemption: str, tmp_path: Path) -> None:
    from tests.helpers.family_matrix import write_family_model
    from tests.helpers.family_tp import tp_families
    from tests.helpers.paged_driver import greedy_hf
    from tests.helpers.tiny_models import EOS_ID, PAD_ID, load_reference
    from tests.helpers.tp_spawn import run_two_ranks

    (spec,) = [f for f in tp_families() if f.name == family]
    model = write_family_model(spec, tmp_path / family)
    argv = ["--model", str(model), "--preemption", preemption]
    result = run_two_ranks("tests.distributed.test_tp_preemption", argv, tmp_path / "result.json", timeout_s=240)
    assert result["preemptions"][preemption] > 0, f"no {preemption} preemption: the test would prove nothing"
    prompts = [result["prompts"][str(i + 1)] for i in range(len(PROMPT_WORDS))]
    expected = greedy_hf(load_reference(model), prompts, MAX_NEW, [EOS_ID], PAD_ID)
    got = [result["tokens"][str(i + 1)] for i in range(len(PROMPT_WORDS))]
    assert got == expected, f"{family} at TP=2 under {preemption} preemption differs from HF"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker()
