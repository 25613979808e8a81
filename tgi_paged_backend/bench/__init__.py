"""Benchmarks' shared code (the capacity planner and its simulation are in :mod:`tgi_paged_backend.planning`).

- ``sliding_window``: window reclaim vs keeping every block, analytic and through the memory manager.
- ``layer_groups_concurrency``: the engine with and without KV layer groups on the same pool bytes.
- ``decode_step``: random decode and prefill steps for the forward benchmarks.
- ``plots``: PNG plots (matplotlib, the ``bench`` extra), e.g. of the allocator simulation's comparison.

The end-to-end comparison with a real model is ``integration/bench_e2e.py``.

Nothing here is imported by the server: the package only reads the engine's public pieces.
"""
