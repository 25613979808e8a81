"""A served vision-language model at tensor parallel 2: two ranks of ``tests/distributed/test_tp_vlm.py``'s worker
serve one batch with images (the language model sliced, the vision tower whole on each rank); rank 0's greedy
tokens compared with HF ``generate`` on the same prompt ids and images. Used by that test and by the family
matrix's TP column for the VLM rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.helpers.family_tp import TpOutcome
from tests.helpers.tp_spawn import run_two_ranks
from tests.helpers.vlm_families import VlmFamily, as_family, write_served

WORKER = "tests.distributed.test_tp_vlm"


@dataclass(frozen=True)
class VlmTpRun:
    mismatched: list[str]
    """Request ids whose tokens differ from HF's."""
    local_q_heads: int
    full_q_heads: int


def run_vlm_tp(vlm: VlmFamily, workdir: Path, max_new: int, timeout_s: float = 300) -> VlmTpRun:
    """Serve ``vlm``'s tiny checkpoint on two ranks and compare every request with HF."""
    path, reference_class = write_served(vlm, workdir / vlm.name)
    result = run_two_ranks(WORKER, ["--model", str(path)], workdir / f"{vlm.model_type}_tp.json", timeout_s=timeout_s)
    reference = reference_class(path)
    mismatched = []
    for rid, tokens in result["tokens"].items():
        images = [bytes.fromhex(h) for h in result["images"][rid]]
        if tokens != reference.greedy(result["prompts"][rid], images, max_new):
            mismatched.append(rid)
    full = int(reference.model.config.get_text_config().num_attention_heads)
    return VlmTpRun(mismatched, int(result["local_q_heads"]), full)


def vlm_tp_outcome(vlm: VlmFamily, workdir: Path, max_new: int = 6) -> TpOutcome:
    """The matrix's TP=2 cell of a served VLM: exact when every request matches HF and the text model was sliced."""
    run = run_vlm_tp(vlm, workdir, max_new)
    return TpOutcome(as_family(vlm), not run.mismatched and run.local_q_heads * 2 == run.full_q_heads)
