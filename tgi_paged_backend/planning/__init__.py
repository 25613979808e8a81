"""The capacity planner (``tgi-paged-backend plan``) and the allocator simulation it runs.

The planner: bytes per token, pool size and expected concurrency / waste from a model config, a GPU
and a trace; advises ``TGI_PAGED_OVERCOMMIT``.

- ``planner``: the plan arithmetic (``make_plan``, ``plan_from_args`` behind the CLI);
- ``plan``: its inputs and result (``PlanInputs``, ``Plan``, the JSON); ``plan_report``: the printed plan;
- ``presets``: GPUs and model presets; ``model_facts``: the model's config, parameters and per-rank sizes;
- ``param_counts``, ``weights``: parameters per tensor-parallel rank and resident weight bytes.

The simulation: one trace through three KV allocators on the same budget (contiguous max-length, stock
TGI worst-case blocks, this backend's lazy blocks with overcommit and preemption), no model.

- ``allocator_sim``: the model (module docstring) and the trace runner (``simulate``, ``compare``);
- ``sim_config``: budget, knobs and step time; ``sim_allocators``: the three allocators;
  ``sim_results``: results, the comparison and the overcommit advice;
- ``workload``: seeded request traces (ShareGPT-like and Alpaca-like lengths, burst or Poisson
  arrivals), saved and loaded as JSONL;
- ``report``: the text tables and number formats (shared with the benchmarks).

Nothing here is imported by the server: the package only reads the engine's public pieces. The
benchmarks (:mod:`tgi_paged_backend.bench`) build on it; nothing here imports them.
"""
