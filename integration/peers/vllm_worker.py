"""vLLM's CPU build on one job (see ``jobs.py``): run by the peer venv's python, stdlib + vllm only.

    python vllm_worker.py serve JOB.json OUT.json

One ``vllm.LLM`` (eager, the job's ``dtype``, greedy, ``ignore_eos``, ``max_tokens`` = each request's
``output_tokens``; KV pool = ``kv_tokens`` via ``num_gpu_blocks_override``; the engine core in this
process) serves every run of the job. Requests go in through the LLM's own engine
(``llm.llm_engine.add_request`` / ``step``, what ``LLM.generate`` loops over), added when their arrival
time has come (or, for a ``sequential`` job, when the previous one finished), so each token gets a timestamp and
Poisson arrivals are honoured.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in-process: one RSS, one clock
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    threads = int(job["threads"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(threads)
    t_setup = time.perf_counter()
    block = 32
    llm = LLM(
        model=job["model_dir"],
        dtype=job.get("dtype", "float32"),
        enforce_eager=True,
        seed=0,
        block_size=block,
        num_gpu_blocks_override=max(1, job["kv_tokens"] // block),
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=max(job["max_batch_tokens"], job["max_model_len"]),
        max_num_seqs=256,
    )
    engine = llm.llm_engine
    setup_s = time.perf_counter() - t_setup
    # warm-up request, not timed
    llm.generate(
        [{"prompt_token_ids": next(iter(job["runs"].values()))[0]["prompt_ids"][:8]}],
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    runs = {}
    for name, requests in job["runs"].items():
        runs[name] = serve(engine, SamplingParams, requests, bool(job.get("sequential")))
    out = {
        "engine": f"vllm {vllm.__version__} (CPU, eager, block {block})",
        "key": "vllm",
        "runs": runs,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "setup_s": setup_s,
        "notes": [
            f"torch {torch.__version__}, {llm.llm_engine.model_config.dtype}, {threads} threads, "
            f"{job['kv_tokens'] // block} KV blocks x {block}, max_num_batched_tokens "
            f"{max(job['max_batch_tokens'], job['max_model_len'])}"
        ],
    }
    json.dump(out, open(out_path, "w"))


def serve(engine, SamplingParams, requests: list[dict], sequential: bool = False) -> list[dict]:
    """Each request added at its arrival time or, ``sequential``, when the one before it has finished (its
    ``arrival`` is then the time it was added)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival"])
    results = [{"tokens": [], "arrival": r["arrival"], "token_times": []} for r in requests]
    pending, live = list(order), set()
    t0 = time.perf_counter()
    while pending or live:
        now = time.perf_counter() - t0
        while pending and requests[pending[0]]["arrival"] <= now and not (sequential and live):
            i = pending.pop(0)
            if sequential:
                results[i]["arrival"] = now
            params = SamplingParams(max_tokens=requests[i]["output_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": requests[i]["prompt_ids"]}, params)
            live.add(i)
        if not live:
            time.sleep(max(0.0, requests[pending[0]]["arrival"] - now))
            continue
        for output in engine.step():
            i = int(output.request_id)
            stamp = time.perf_counter() - t0
            ids = list(output.outputs[0].token_ids)
            new = len(ids) - len(results[i]["tokens"])
            results[i]["tokens"] = ids
            results[i]["token_times"].extend([stamp] * max(new, 0))
            if output.finished:
                live.discard(i)
    return results


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "serve":
        sys.exit(__doc__)
    main(sys.argv[2], sys.argv[3])
