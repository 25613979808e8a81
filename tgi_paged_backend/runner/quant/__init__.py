"""Quantized weights: which ``--quantize`` values are served, and how each format is loaded.

- :mod:`.methods`: the supported ``--quantize`` values, the refusal for the others, and the check that
  the flag agrees with ``quantization_config.quant_method`` in ``config.json`` (torch-free, so the CLI
  can refuse before importing torch).
- :mod:`.fp8`: the float8 e4m3 per-output-channel quantizer (load-time ``--quantize fp8`` and the
  tests' checkpoint writer).
- :mod:`.linear`: :class:`~.linear.Fp8Linear` and :class:`~.linear.IntLinear`, the modules that
  replace ``nn.Linear`` (kernels: :mod:`tgi_paged_kernels.fp8_gemm`, :mod:`tgi_paged_kernels.int_gemm`).
- :mod:`.apply`: put the quantized linears into a loaded model, for each format.
- :mod:`.compressed_tensors`: read and validate a compressed-tensors checkpoint's scheme (FP8, or
  ``pack-quantized`` int4/int8).
- :mod:`.int_codes`: the one decoded form of int weights (codes, per-group scales and zeros, ``g_idx``).
- :mod:`.gptq_awq`: GPTQ and AWQ configs and packed tensors; :mod:`.pack_quantized`: compressed-tensors'.
"""
