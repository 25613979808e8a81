"""Decompress a quantized checkpoint with the independent loader and save its weights.

``PYTHON compressed_tensors_check.py CHECKPOINT OUT.safetensors``, where ``PYTHON`` has
``compressed-tensors`` and ``transformers`` (a throwaway venv: neither is a dependency of this
package). Imports nothing from this repository.

- compressed-tensors checkpoints (FP8 ``float-quantized``, int ``pack-quantized``): transformers'
  compressed-tensors integration with ``run_compressed=False`` dequantizes every quantized linear;
  the model's state dict (float32) is written to ``OUT``;
- AWQ GEMM checkpoints (``quant_method: awq``): compressed-tensors' own ``AutoAWQConverter`` turns each
  ``qweight``/``qzeros``/``scales`` into its ``pack-quantized`` tensors, and its
  ``PackedQuantizationCompressor`` decompresses them; each ``NAME.weight`` is written in the dtype it
  returns (the scales' float16). Where AutoAWQ's sources are also importable (``pip install --no-deps
  autoawq``; its package ``__init__`` needs ``accelerate``, so only ``awq/utils/packing_utils.py`` is
  loaded, by path), its ``dequantize_gemm`` must give the same weights, or the script fails.

``tests/runner/test_quantized_loading.py`` and ``tests/runner/test_int_quantized_loading.py`` compare
``OUT`` with our dequantized weights.
"""

import json
import sys
from pathlib import Path

import compressed_tensors
import torch
import transformers
from safetensors.torch import load_file, save_file


def decompress_compressed_tensors(checkpoint: str) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint,
        dtype=torch.float32,
        local_files_only=True,
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
    )
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if any(v.dtype in (torch.float8_e4m3fn, torch.int32) for v in state.values()):
        raise SystemExit("compressed-tensors left weights compressed")
    return state


def decompress_awq(checkpoint: str) -> dict:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converter = AutoAWQConverter.from_pretrained(checkpoint)
    (scheme,) = converter.update_config(None).config_groups.values()
    tensors = converter.process(load_file(str(Path(checkpoint) / "model.safetensors")))
    out = {}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        name = key.removesuffix(".weight_packed")
        local = {k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.weight_")}
        out[f"{name}.weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].contiguous()
    if not out:
        raise SystemExit("AutoAWQConverter found no AWQ linears")
    _agree_with_autoawq(checkpoint, converter, out)
    return out


def _agree_with_autoawq(checkpoint: str, converter, out: dict) -> None:
    import importlib.util

    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        return
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("autoawq_packing_utils", path)
    packing = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(packing)
    raw = load_file(str(Path(checkpoint) / "model.safetensors"))
    for key, weight in out.items():
        name = key.removesuffix(".weight")
        theirs = packing.dequantize_gemm(
            raw[f"{name}.qweight"], raw[f"{name}.qzeros"], raw[f"{name}.scales"], converter.bits, converter.group_size
        )
        if not torch.equal(theirs.t().contiguous(), weight):
            raise SystemExit(f"AutoAWQ and compressed-tensors disagree on {name}")
    print(f"AutoAWQ ({path}) agrees on {len(out)} linears")


def main(checkpoint: str, out: str) -> None:
    qc = json.loads((Path(checkpoint) / "config.json").read_text())["quantization_config"]
    state = decompress_awq(checkpoint) if qc["quant_method"] == "awq" else decompress_compressed_tensors(checkpoint)
    save_file(state, out)
    print(
        f"compressed-tensors {compressed_tensors.__version__}, transformers {transformers.__version__}: "
        f"{len(state)} tensors ({qc['quant_method']})"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
