"""Paged-KV kernels for tgi-paged-backend, imported as ``tgi_paged_kernels``.

Public functions (``api``), each with a Triton path for CUDA tensors and a plain-torch path for CPU:

- ``store_kv``: write new tokens' K/V into their slots (fp16/bf16/fp32/fp8 caches)
- ``paged_decode_attention``: one query token per request, GQA/MQA, softcap, sliding window,
  split-K chosen by shape
- ``paged_prefill_attention``: packed variable-length causal prefill over a cached prefix
- ``plan_decode_gather``: the CPU decode's per-step plan (which blocks each request reads, what it must
  not see), built once per step and passed to every layer's ``paged_decode_attention`` (module
  ``cpu_attention``, the SDPA-based CPU attention)
- ``copy_blocks``: copy-on-write of whole blocks inside the pool, all layers
- ``swap_blocks``: whole blocks between the pool and the CPU swap space, all layers
- ``fp8_linear`` (module ``fp8_gemm``; no submodule is named like a public function, since importing it
  would replace the function on the package): weight-only FP8 linear, a dequantize-GEMM over float8 e4m3
  weights with per-output-channel scales (``--quantize``); its CPU path dequantizes on the fly
- ``int_linear`` (module ``int_gemm``): weight-only int4/int8 linear with per-group scales and zero points
  and a group index (GPTQ, AWQ, compressed-tensors ``pack-quantized``), same two paths

Files: one kernel family per module (``kv_store``, ``paged_decode``, ``paged_prefill``,
``block_copy``; shared inner loop in ``_attention_tiles``), each a ``_<name>_kernel`` plus a
``_launch_*`` launcher that checks arguments and computes the grid; ``torch_impl`` (CPU paths);
``reference`` (fp32 per-request references, the specification); ``testing`` (paged test-case
builders and tolerances shared by tests and ``examples/bench_paged_attention.py``).

Words as in the package glossary: *slot* = ``block_id * block_size + offset``; *block table* = a
request's physical blocks in token order; *pool* = all physical blocks of one layer.
"""

from .api import (
    copy_blocks,
    fp8_linear,
    int_linear,
    paged_decode_attention,
    paged_prefill_attention,
    plan_decode_gather,
    store_kv,
    swap_blocks,
)

__all__ = [
    "copy_blocks",
    "fp8_linear",
    "int_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode_gather",
    "store_kv",
    "swap_blocks",
]
