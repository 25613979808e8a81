"""The contiguous baseline: HF transformers static padded batches over a max-length cache of the same KV bytes."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from integration.bench_e2e.results import (
    CONTIGUOUS,
    E2EConfig,
    ModeResult,
    RequestRecord,
    client_figures,
    cpu_probe_ms,
)


def run_contiguous(cfg: E2EConfig, prompts: Sequence[str], *, log=print) -> ModeResult:
    """HF transformers static padded batches over a max-length cache of the same KV bytes."""
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    t_setup = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32).eval()
    ids = [tok.encode(p, add_special_tokens=True) for p in prompts]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    cap = cfg.max_new_tokens
    kv_tokens = cfg.kv_tokens
    order = sorted(range(len(cfg.trace)), key=lambda i: cfg.trace[i].arrival)
    records = {i: RequestRecord(i, len(ids[i]), cfg.trace[i].output_tokens, cfg.trace[i].arrival) for i in order}
    # warm up the kernels once (not timed)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[order[0]][:8]]), logits_to_keep=1)
    setup_s = time.perf_counter() - t_setup
    acc = {"t": 0.0, "internal": 0.0, "reservation": 0.0, "external": 0.0, "used": 0.0}
    samples: dict[str, list[float]] = {"t": [], "running": []}
    rows_per_step: list[int] = []
    computed = peak = 0
    load_before, probe = os.getloadavg()[0], cpu_probe_ms()
    t0 = time.perf_counter()
    pos = 0
    with torch.inference_mode():
        while pos < len(order):
            now = time.perf_counter() - t0
            first = cfg.trace[order[pos]].arrival
            if first > now:
                time.sleep(first - now)
                now = first
            batch: list[int] = []
            longest = 0
            while pos < len(order) and cfg.trace[order[pos]].arrival <= now:
                i = order[pos]
                longest_if = max(longest, len(ids[i]))
                if batch and (len(batch) + 1) * (longest_if + cap) > kv_tokens:
                    break
                batch.append(i)
                longest = longest_if
                pos += 1
            rows, P = len(batch), longest
            L = P + cap
            peak = max(peak, rows)
            input_ids = torch.full((rows, P), pad_id, dtype=torch.long)
            mask = torch.zeros((rows, L), dtype=torch.long)
            for r, i in enumerate(batch):
                input_ids[r, P - len(ids[i]) :] = torch.tensor(ids[i])
                mask[r, P - len(ids[i]) :] = 1
            positions = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)
            cache = transformers.StaticCache(config=model.config, max_cache_len=L)
            steps = max(cfg.trace[i].output_tokens for i in batch)
            padding = sum(P - len(ids[i]) for i in batch)
            t_step = time.perf_counter()
            out = model(
                input_ids=input_ids,
                attention_mask=mask[:, :P],
                position_ids=positions,
                past_key_values=cache,
                cache_position=torch.arange(P),
                use_cache=True,
                logits_to_keep=1,
            )
            computed += sum(len(ids[i]) for i in batch)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            last_pos = positions[:, -1:]
            for g in range(1, steps + 1):  # g tokens generated after this step
                if g > 1:
                    mask[:, P + g - 2] = 1
                    last_pos = last_pos + 1
                    out = model(
                        input_ids=nxt,
                        attention_mask=mask[:, : P + g - 1],
                        position_ids=last_pos,
                        past_key_values=cache,
                        cache_position=torch.tensor([P + g - 2]),
                        use_cache=True,
                    )
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                    computed += rows
                t_now = time.perf_counter()
                dt, t_step = t_now - t_step, t_now
                stamp = t_now - t0
                for i in batch:
                    if g <= cfg.trace[i].output_tokens:
                        records[i].token_times.append(stamp)
                rows_per_step.append(rows)
                # KV accounting for this step (slots of the budget).
                written = P + g - 1  # positions per row with K/V (padding included)
                garbage = sum(max(g - cfg.trace[i].output_tokens, 0) for i in batch)
                useful = sum(len(ids[i]) + min(g, cfg.trace[i].output_tokens) - 1 for i in batch)
                waiting = pos < len(order) and cfg.trace[order[pos]].arrival <= stamp
                acc["t"] += dt
                acc["internal"] += dt * (padding + garbage)
                acc["reservation"] += dt * rows * (L - written)
                acc["external"] += dt * ((kv_tokens - rows * L) if waiting else 0)
                acc["used"] += dt * useful
                samples["t"].append(stamp)
                samples["running"].append(rows)
            log(
                f"  contiguous: batch of {rows} (prompt pad {P}, cache {L} tokens/row) ran {steps} steps, "
                f"{time.perf_counter() - t0:.1f} s"
            )
    share = {
        k: acc[k] / acc["t"] / kv_tokens if acc["t"] else 0.0 for k in ("internal", "reservation", "external", "used")
    }
    return ModeResult(
        mode=CONTIGUOUS,
        overcommit=None,
        **client_figures(list(records.values())),
        peak_admitted=peak,
        peak_running=peak,
        mean_batch=float(np.mean(rows_per_step)),
        preemptions={"recompute": 0, "swap": 0},
        recomputed_tokens=0,
        computed_tokens=computed,
        waste_internal=share["internal"],
        waste_reservation=share["reservation"],
        waste_external=share["external"],
        idle_queued=0.0,
        virtual_unbacked=0.0,
        kv_used=share["used"],
        setup_s=setup_s,
        pool_tokens=kv_tokens,
        notes=[
            f"rows x (longest prompt + {cap}) <= {kv_tokens} KV token slots per batch",
            f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; cpu probe {probe:.0f} ms before, "
            f"{cpu_probe_ms():.0f} ms after",
        ],
        samples=samples,
    )
