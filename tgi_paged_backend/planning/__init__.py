"""The capacity planner (``tgi-paged-backend plan``) and the allocator simulation it runs.

- ``planner``: bytes per token, pool size and expected concurrency / waste from a model config, a
  GPU and a trace; advises ``TGI_PAGED_OVERCOMMIT``.
- ``allocator_sim``: one trace through three KV allocators on the same budget (contiguous max-length,
  stock TGI worst-case blocks, this backend's lazy blocks with overcommit and preemption), no model.
- ``workload``: seeded request traces (ShareGPT-like and Alpaca-like lengths, burst or Poisson
  arrivals), saved and loaded as JSONL.
- ``param_counts``, ``weights``: parameters per tensor-parallel rank and resident weight bytes.
- ``report``: the text tables (and PNG plots) of the simulation and the plan.

Nothing here is imported by the server: the package only reads the engine's public pieces. The
benchmarks (:mod:`tgi_paged_backend.bench`) build on it.
"""
