"""Vision-language models at tensor parallel 2 (gloo, CPU): the language model's decoder layers are sliced, the
vision tower stays whole on every rank (``runner/parallel/slicing.text_model``), which encodes the images itself.

Two ranks each build the tensor-parallel shard engine (``build_engine`` with ``WORLD_SIZE=2``) over a tiny VLM
and serve one batch: a request with one image, a text-only one, one with two images; rank 0's greedy tokens
equal HF ``generate``'s on the same prompt ids and images. LLaVA-NeXT (``model.model.language_model``),
Qwen2-VL (M-RoPE: the 3-D positions and the decode delta on both ranks), Idefics3 (``model.model.text_model``,
and a vision tower whose encoder layers have ``self_attn`` and ``mlp`` too: they must not be sliced), Gemma 3 and
PaliGemma (bidirectional spans: the same per-row key limits on both ranks).

The worker is this module (``python -m tests.distributed.test_tp_vlm --rank ...``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

MAX_NEW = 6


def _worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from tests.helpers.llava_next_models import png_bytes
    from tests.helpers.llava_next_scenarios import image_spec
    from tgi_paged_backend.engine import build_engine
    from tgi_paged_backend.engine.types import BatchSpec, ImageInput
    from tgi_paged_backend.envs import build_config

    settings = {
        "RANK": str(args.rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(args.port),
        "TGI_PAGED_DIST_TIMEOUT_S": "60",
        "TGI_PAGED_NUM_BLOCKS": "64",
        "TGI_PAGED_BLOCK_SIZE": "8",
    }
    engine = build_engine(build_config({"model_id": args.model}, settings))
    try:
        one, two, three = png_bytes(40, 24, 1), png_bytes(32, 32, 4), png_bytes(24, 64, 3)
        specs = [
            image_spec(engine, None, 1, ["Describe ", one, " in words."], max_new=MAX_NEW),
            image_spec(engine, None, 2, ["A text-only request that shares the batch."], max_new=MAX_NEW),
            image_spec(engine, None, 3, [two, " versus ", three, " now"], max_new=MAX_NEW),
        ]
        prompts = {s.id: engine.image_prompts.encode(s)[0] for s in specs}
        images = {s.id: [c.data.hex() for c in s.chunks if isinstance(c, ImageInput)] for s in specs}
        tokens: dict[int, list[int]] = {s.id: [] for s in specs}
        result = engine.prefill(BatchSpec(id=0, requests=tuple(specs)), None)
        for _ in range(10 * MAX_NEW):
            for g in result.generations:  # rank 0 only: the other ranks report none
                tokens[g.request_id].extend(g.tokens.ids)
            if result.batch is None:
                break
            result = engine.decode([result.batch.id])
        assert result.batch is None, "the batch did not finish"
        heads = engine.runner.spec.num_q_heads
    finally:
        engine.close()
    if args.rank == 0:
        out = {"prompts": prompts, "images": images, "tokens": tokens, "local_q_heads": heads}
        Path(args.out).write_text(json.dumps(out))


@pytest.mark.parametrize("model_type", ["llava_next", "qwen2_vl", "idefics3", "gemma3", "paligemma"])
def test_two_rank_vlm_matches_hf(model_type: str, tmp_path: Path) -> None:
    from tests.helpers.vlm_families import VLM_FAMILIES
    from tests.helpers.vlm_tp import run_vlm_tp

    vlm = next(v for v in VLM_FAMILIES if v.model_type == model_type)
    run = run_vlm_tp(vlm, tmp_path, MAX_NEW)
    assert run.local_q_heads * 2 == run.full_q_heads  # the language model was sliced
    assert run.mismatched == [], f"{vlm.name}: requests {run.mismatched} differ from HF at TP=2"


if __name__ == "__main__":
    _worker()
