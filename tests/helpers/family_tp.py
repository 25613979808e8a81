"""The family matrix at tensor parallel 2: every served family over two gloo ranks
(``tests/distributed/tp_worker.py``, one spawn for all of them), greedy through the paged pools,
compared with HF ``generate`` token for token. A family the tensor-parallel slicing does not support
(fused projections, MoE, MQA with one KV head, ...) must be refused with a ``ModelLoadError`` naming
why, on both ranks alike; it is reported as refused, never served wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.helpers.family_models import FAMILIES, Family, is_available, write_family_model
from tests.helpers.paged_driver import greedy_hf
from tests.helpers.tiny_models import EOS_ID, PAD_ID, load_reference
from tests.helpers.tp_spawn import run_tp_workers

MAX_NEW = 8
START_REFUSED: set[str] = set()
"""Refused by the backend at start whatever the shard count (see ``family_matrix.REFUSED``)."""


@dataclass(frozen=True)
class TpOutcome:
    family: Family
    exact: bool | None
    """Tokens equal HF's (``None`` when refused)."""
    refusal: str | None = None


def tp_families() -> list[Family]:
    return [f for f in FAMILIES if is_available(f) and f.name not in START_REFUSED]


def run_tp(families: list[Family], workdir: Path, timeout_s: float = 600) -> dict[str, TpOutcome]:
    """Serve every family on two ranks in one spawn; compare with HF (none: nothing spawned, e.g. ``--family``
    naming only VLM rows)."""
    if not families:
        return {}
    models = {f.name: write_family_model(f, workdir / f.name) for f in families}
    prompts = [np.random.default_rng(7).integers(4, 320, n).tolist() for n in (5, 19)]
    result = run_tp_workers(
        list(models.values()),
        prompts,
        MAX_NEW,
        workdir / "tp_result.json",
        extra_args=["--allow-refusal"],
        timeout_s=timeout_s,
    )
    outcomes = {}
    for family in families:
        got = result[str(models[family.name])]
        if "refused" in got:
            outcomes[family.name] = TpOutcome(family, None, got["refused"])
            continue
        expected = greedy_hf(load_reference(models[family.name]), prompts, MAX_NEW, [EOS_ID], PAD_ID)
        outcomes[family.name] = TpOutcome(family, got["tokens"] == expected)
    return outcomes
