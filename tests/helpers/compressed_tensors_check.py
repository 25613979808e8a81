"""Decompress a compressed-tensors checkpoint with the independent loader and save its weights.

``PYTHON compressed_tensors_check.py CHECKPOINT OUT.safetensors``, where ``PYTHON`` has
``compressed-tensors`` and ``transformers`` (a throwaway venv: neither is a dependency of this
package). transformers' compressed-tensors integration with ``run_compressed=False`` dequantizes every
quantized linear to float32; the state dict is written to ``OUT`` for
``tests/runner/test_quantized_loading.py`` to compare with ours. Imports nothing from this repository.
"""

import sys

import compressed_tensors
import torch
import transformers
from safetensors.torch import save_file


def main(checkpoint: str, out: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, local_files_only=True,
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if any(v.dtype == torch.float8_e4m3fn for v in state.values()):
        raise SystemExit("compressed-tensors left fp8 weights compressed")
    save_file(state, out)
    print(f"compressed-tensors {compressed_tensors.__version__}, transformers {transformers.__version__}: "
          f"{len(state)} tensors")


if __name__ == "__main__":
    main(*sys.argv[1:3])
