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

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # the lazy names below, for type checkers
    from .cpu_gemm import moe_experts as moe_experts
    from .cpu_gemm import pack_weight_bf16 as pack_weight_bf16
    from .cpu_gemm import unpack_weight as unpack_weight
    from .cpu_greedy import greedy_pick as greedy_pick
    from .cpu_layer import (
        PACK_BLOCK as PACK_BLOCK,
    )
    from .cpu_layer import (
        LayerForm as LayerForm,
    )
    from .cpu_layer import (
        LayerWeights as LayerWeights,
    )
    from .cpu_layer import (
        decode_layer as decode_layer,
    )
    from .cpu_layer import (
        gemm_packed as gemm_packed,
    )
    from .cpu_layer import (
        pack_weight as pack_weight,
    )
    from .cpu_layer_lora import LayerLora as LayerLora
    from .cpu_layer_lora import LoraTarget as LoraTarget
    from .cpu_layer_stack import LayerStack as LayerStack
    from .cpu_layer_step import decode_layer_parts as decode_layer_parts
    from .cpu_lora import add_lora_cpu as add_lora_cpu
    from .cpu_lora import cpu_b_stack as cpu_b_stack
    from .cpu_native import (
        NativeKernels as NativeKernels,
    )
    from .cpu_native import (
        native_decode_for as native_decode_for,
    )
    from .cpu_native import (
        native_kernels as native_kernels,
    )
    from .cpu_quant import PackedInt8 as PackedInt8
    from .cpu_quant import dequantized_int8 as dequantized_int8
    from .cpu_quant import gemm_packed_int8 as gemm_packed_int8
    from .cpu_quant import pack_fp8 as pack_fp8
    from .cpu_quant import pack_int8 as pack_int8
    from .cpu_quant import pack_int8_layer as pack_int8_layer
    from .fp8_gemm import dequantize_fp8 as dequantize_fp8
    from .int_gemm import (
        check_int_linear as check_int_linear,
    )
    from .int_gemm import (
        dequantize_int as dequantize_int,
    )
    from .int_gemm import (
        pack_codes as pack_codes,
    )
    from .int_gemm import (
        unpack_codes as unpack_codes,
    )
    from .lora import add_lora_triton as add_lora_triton

# The CPU-native, weight-format and LoRA building blocks the model runner uses: public too, imported on
# first use (some modules bring Triton in when it is installed). The package imports kernels only through
# these names (tests/install/test_import_rules.py).
_LAZY = {
    "NativeKernels": "cpu_native",
    "native_kernels": "cpu_native",
    "native_decode_for": "cpu_native",
    "greedy_pick": "cpu_greedy",
    "LayerForm": "cpu_layer",
    "PACK_BLOCK": "cpu_layer",
    "LayerWeights": "cpu_layer",
    "decode_layer": "cpu_layer",
    "decode_layer_parts": "cpu_layer_step",
    "LayerLora": "cpu_layer_lora",
    "LayerStack": "cpu_layer_stack",
    "LoraTarget": "cpu_layer_lora",
    "PackedInt8": "cpu_quant",
    "dequantized_int8": "cpu_quant",
    "gemm_packed_int8": "cpu_quant",
    "pack_fp8": "cpu_quant",
    "pack_int8": "cpu_quant",
    "pack_int8_layer": "cpu_quant",
    "gemm_packed": "cpu_layer",
    "pack_weight": "cpu_layer",
    "unpack_weight": "cpu_gemm",
    "pack_weight_bf16": "cpu_gemm",
    "moe_experts": "cpu_gemm",
    "dequantize_fp8": "fp8_gemm",
    "check_int_linear": "int_gemm",
    "dequantize_int": "int_gemm",
    "pack_codes": "int_gemm",
    "unpack_codes": "int_gemm",
    "add_lora_cpu": "cpu_lora",
    "cpu_b_stack": "cpu_lora",
    "add_lora_triton": "lora",
}

__all__ = [
    "copy_blocks",
    "fp8_linear",
    "int_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode_gather",
    "store_kv",
    "swap_blocks",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
