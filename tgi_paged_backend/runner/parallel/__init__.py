"""Tensor parallelism (``--num-shard N``): the process group, slicing each layer for a rank, the fused
parts' layouts and the per-rank runner."""
