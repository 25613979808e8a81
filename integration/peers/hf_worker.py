"""transformers on one job (see ``jobs.py``), in its own process:

    python hf_worker.py reference JOB.json OUT.json   # HF greedy tokens (generate, one request at a time)
    python hf_worker.py bare JOB.json OUT.json        # the bare forward: job["bare"] = {"batch", "context"}
    python hf_worker.py cb JOB.json OUT.json          # transformers' own continuous batching, every run

``reference``: ``generate(do_sample=False, min_new_tokens = max_new_tokens = output_tokens)`` (EOS
ignored) for each of ``job["reference"]`` (``[{"prompt_ids", "output_tokens"}]``), the oracle every engine is
compared with. Every mode loads the model in ``job["dtype"]``. ``bare``: one decode step of ``batch`` rows at
``context`` cached tokens each, the model alone (HF eager modules, its own SDPA attention and a
``DynamicCache``, no engine): median of repeated forwards, the physical limit of a decode step here.
``cb``: ``init_continuous_batching`` (``ContinuousBatchingManager``) with a KV pool of ``kv_tokens``,
requests added at their arrival, per-token timestamps from the manager (``record_timestamps``).
Writes ``{"skipped": reason}`` when the installed transformers has no continuous batching.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def _load(job):
    import torch
    import transformers

    torch.set_num_threads(int(job["threads"]))
    dtype = getattr(torch, job.get("dtype", "float32"))
    model = transformers.AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype).eval()
    return torch, transformers, model


def reference(job) -> dict:
    torch, _, model = _load(job)
    out = []
    with torch.inference_mode():
        for r in job["reference"]:
            n = r["output_tokens"]
            ids = torch.tensor([r["prompt_ids"]])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, ids.shape[1] :].tolist())
    return {"tokens": out}


def bare(job) -> dict:
    torch, transformers, model = _load(job)
    batch, context = int(job["bare"]["batch"]), int(job["bare"]["context"])
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (batch, context), generator=g)
        cache = transformers.DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        for k in range(12):
            pos = torch.full((batch, 1), context + k)
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, position_ids=pos, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    times = sorted(times[2:])  # the first two warm the allocator
    return {"batch": batch, "context": context, "forward_s": times[len(times) // 2], "min_s": times[0]}


def cb(job) -> dict:
    t_setup = time.perf_counter()
    torch, transformers, model = _load(job)
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError as err:
        return {"skipped": f"transformers {transformers.__version__} has no continuous batching ({err})"}
    if not hasattr(model, "init_continuous_batching"):
        return {"skipped": f"transformers {transformers.__version__}: no init_continuous_batching"}
    page = int(job["block_size"])
    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=128)
    cb_cfg = ContinuousBatchingConfig(
        page_size=page, num_blocks=max(1, job["kv_tokens"] // page), max_batch_tokens=job["max_batch_tokens"]
    )
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    manager.start()
    runs = {}
    try:
        with torch.inference_mode():
            warm = manager.add_request(next(iter(job["runs"].values()))[0]["prompt_ids"][:8], max_new_tokens=2)
            while True:
                res = manager.get_result(request_id=warm, timeout=60)
                if res is None or res.is_finished():
                    break
            setup_s = time.perf_counter() - t_setup
            for name, requests in job["runs"].items():
                runs[name] = _serve_cb(manager, requests)
    finally:
        manager.stop(block=True, timeout=10)
    return {
        "engine": f"transformers {transformers.__version__} continuous batching (page {page})",
        "key": "transformers",
        "runs": runs,
        "setup_s": setup_s,
        "notes": [
            f"ContinuousBatchingManager, {job['kv_tokens'] // page} pages x {page}, "
            f"max_batch_tokens {job['max_batch_tokens']}"
        ],
    }


def _serve_cb(manager, requests: list[dict]) -> list[dict]:
    order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival"])
    results = [{"tokens": [], "arrival": r["arrival"], "token_times": []} for r in requests]
    t0 = time.perf_counter()
    ids: dict[str, int] = {}
    for i in order:
        wait = requests[i]["arrival"] - (time.perf_counter() - t0)
        if wait > 0:
            _drain(manager, ids, results, t0, wait)
            time.sleep(max(0.0, requests[i]["arrival"] - (time.perf_counter() - t0)))  # nothing live to drain
        rid = manager.add_request(
            requests[i]["prompt_ids"],
            request_id=f"r{i}",
            max_new_tokens=requests[i]["output_tokens"],
            record_timestamps=True,
            eos_token_id=-1,
        )
        ids[rid] = i
    _drain(manager, ids, results, t0, None)
    return results


def _drain(manager, ids, results, t0, for_s) -> None:
    """Collect finished results for ``for_s`` seconds (``None``: until every added request finished)."""
    deadline = None if for_s is None else time.perf_counter() + for_s
    while ids and (deadline is None or time.perf_counter() < deadline):
        timeout = 1.0 if deadline is None else max(0.001, deadline - time.perf_counter())
        res = manager.get_result(timeout=timeout)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped")
            continue
        if not res.is_finished() or res.request_id not in ids:
            continue
        i = ids.pop(res.request_id)
        results[i]["tokens"] = list(res.generated_tokens)
        results[i]["token_times"] = [t - t0 for t in (res.timestamps or [])]
        results[i]["arrival_abs"] = res.created_time - t0
        if res.error:
            raise RuntimeError(f"request {i}: {res.error}")


def main(mode: str, job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = {"reference": reference, "bare": bare, "cb": cb}[mode](job)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("reference", "bare", "cb"):
        sys.exit(__doc__)
    main(*sys.argv[1:])
