"""Benchmarks and the capacity planner.

- ``workload``: seeded request traces (ShareGPT-like and Alpaca-like lengths, burst or Poisson
  arrivals), saved and loaded as JSONL.
- ``allocator_sim``: one trace through three KV allocators on the same budget (contiguous max-length,
  stock TGI worst-case blocks, this backend's lazy blocks with overcommit and preemption), no model.
- ``planner``: bytes per token, pool size and expected concurrency / waste from a model config, a
  GPU and a trace; advises ``TGI_PAGED_OVERCOMMIT`` (``tgi-paged-backend plan``).
- ``e2e``: the same comparison end to end with a real model on CPU (HF static batch, the shard in
  stock-TGI mode, the shard with overcommit).
- ``report``: text tables and PNG plots shared by the above.

Nothing here is imported by the server: the package only reads the engine's public pieces.
"""
