"""Every mode one after the other: contiguous, stock-TGI mode and paged at each overcommit."""

from __future__ import annotations

import os
import time

import numpy as np

from integration.bench_e2e.contiguous import run_contiguous
from integration.bench_e2e.prompts import build_prompts
from integration.bench_e2e.report import E2EReport, recommend
from integration.bench_e2e.results import STOCK, E2EConfig, ModeResult
from integration.bench_e2e.shard import run_shard_mode


def run_all(cfg: E2EConfig, *, log=print) -> E2EReport:
    """Contiguous, stock-TGI mode and paged at each overcommit, one after the other."""
    import transformers

    t0 = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir)
    prompts = build_prompts(tok, cfg.trace, cfg.seed)
    results: list[ModeResult] = []
    if cfg.run_contiguous:
        log("contiguous (HF static batch) ...")
        results.append(run_contiguous(cfg, prompts, log=log))
    if cfg.run_stock:
        log("stock-TGI mode (overcommit 1) ...")
        results.append(run_shard_mode(cfg, prompts, 1.0, mode=STOCK, log=log))
    for oc in cfg.overcommits:
        log(f"paged (overcommit {oc:g}) ...")
        results.append(run_shard_mode(cfg, prompts, oc, mode="paged", log=log))
    oc, why = recommend(results)
    config = {
        "model_dir": str(cfg.model_dir),
        "requests": len(cfg.trace),
        "num_blocks": cfg.num_blocks,
        "block_size": cfg.block_size,
        "kv_tokens": results[0].pool_tokens if results else 0,
        "max_new_tokens": cfg.max_new_tokens,
        "max_input_tokens": cfg.max_input_tokens,
        "max_total_tokens": cfg.max_total_tokens,
        "max_batch_prefill_tokens": cfg.max_batch_prefill_tokens,
        "threads": cfg.threads,
        "overcommits": list(cfg.overcommits),
        "seed": cfg.seed,
        "prompt_mean": float(np.mean([r.prompt_tokens for r in cfg.trace])),
        "output_mean": float(np.mean([r.output_tokens for r in cfg.trace])),
        "cpu_count": os.cpu_count(),
    }
    return E2EReport(config, results, oc, why, time.perf_counter() - t0)
