"""Peer comparison harness for ``examples/bench_peers.py`` (report-only; never a CI gate).

One trace from :mod:`tgi_paged_backend.planning.workload` is served by this shard (launcher-exact spawn +
v3 router replay, :mod:`integration.peers.shard_run`), by vLLM's CPU build (a subprocess in the peer
venv that ``scripts/build_peer_venvs.sh`` builds, :mod:`integration.peers.vllm_worker`) and by
transformers' own continuous batching (:mod:`integration.peers.hf_worker`, which also computes the HF
greedy reference and the bare forward). Each engine runs in its own process, so its peak memory is its own.

Modules: ``jobs`` (the traces, prompts and the JSON job every worker reads), ``shard_run``, ``vllm_worker``
(stdlib + vllm only: it runs in another venv), ``hf_worker``, ``host`` (CPU model, ISA flags, native bf16),
``hostbound`` (the host-bound model's checkpoint), ``plan`` (scenarios, alternated rounds, best-of merge),
``run`` (the order), ``report`` (the tables) and ``goals`` (issue 21's goals and floors).
"""
