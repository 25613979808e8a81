"""The host-bound model: a Llama (or another family's form) whose math is negligible, so its step time is everything
but the math.

30 layers (as SmolLM2-135M) of hidden size 128 with head_dim 64 (2 query heads, 1 KV head: grouped
query attention as SmolLM2's 3:1), MLP 256, random weights from a seeded init, SmolLM2's tokenizer and
vocabulary (so the same prompts tokenize to the same ids and the same trace serves it). A decode step
still walks 30 layers of attention, norms and projections, but each GEMM is tiny: what is left is the
engine's Python, op dispatch, attention metadata and sampling -- the part of a step that decides the
speed on a GPU too, where the math is fast. Written once with transformers (``LlamaConfig`` +
``save_pretrained``, safetensors) into ``--out`` and reused while the spec and seed are unchanged.

``form`` (:mod:`integration.peers.hostbound_forms`) keeps the shape and changes the decoder layer: ``qwen3``,
``gemma3``, ``mixtral``; the Llama form keeps its directory name.

Greedy tokens of a random model sit on near-ties (logits are nearly flat), so an exact match against HF
is not a meaningful oracle here: the harness checks only the first few requests and says so.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from integration.peers.hostbound_forms import build_model, form_config_dict
from integration.smollm2 import with_legacy_config_keys

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
"""Copied from the SmolLM2 directory when present (generation config: the same EOS)."""
SPEC_FILE = "hostbound_spec.json"


@dataclass(frozen=True, slots=True)
class HostBoundSpec:
    num_hidden_layers: int = 30
    hidden_size: int = 128
    head_dim: int = 64
    num_attention_heads: int = 2
    """``hidden_size / head_dim``."""
    num_key_value_heads: int = 1
    intermediate_size: int = 256
    seed: int = 0
    """``torch.manual_seed`` before the model is built: the same weights on every host."""
    form: str = "llama"
    """The family form (:data:`~integration.peers.hostbound_forms.FORMS`)."""

    @property
    def name(self) -> str:
        return (
            f"hostbound-{self.form}-{self.num_hidden_layers}x{self.hidden_size}-h{self.num_attention_heads}"
            f"kv{self.num_key_value_heads}-seed{self.seed}"
        )


def config_dict(source: dict, spec: HostBoundSpec) -> dict:
    """The config of ``spec`` in its form, with the vocabulary, special tokens (and, but for Gemma 3, RoPE and
    norm epsilon) of ``source``."""
    if spec.num_attention_heads * spec.head_dim != spec.hidden_size:
        raise ValueError(f"{spec}: num_attention_heads x head_dim must equal hidden_size")
    shape = {
        "hidden_size": spec.hidden_size,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
    }
    return form_config_dict(spec.form, source, shape)


def is_current(path: Path, spec: HostBoundSpec) -> bool:
    """Whether ``path`` holds this spec's checkpoint (config, weights, tokenizer, matching spec file)."""
    try:
        written = json.loads((path / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors", "tokenizer.json")
    return written == asdict(spec) and all((path / f).is_file() for f in files)


def ensure_hostbound_model(
    out_dir: Path, tokenizer_dir: Path, spec: HostBoundSpec = HostBoundSpec(), log=print
) -> Path:
    """``out_dir / spec.name``, written (atomically, by rename) unless it already holds this spec."""
    import torch

    path = Path(out_dir) / spec.name
    if is_current(path, spec):
        return path
    log(f"writing the host-bound model to {path} ...")
    source = json.loads((Path(tokenizer_dir) / "config.json").read_text())
    config = config_dict(source, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".hostbound-", dir=path.parent) as tmp:
        staged = Path(tmp) / spec.name
        with torch.random.fork_rng():
            torch.manual_seed(spec.seed)
            model = build_model(spec.form, config)
        model.save_pretrained(staged, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, staged / name)
        _portable_config(staged / "config.json", spec)
        (staged / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path)
        staged.rename(path)
    return path


def _portable_config(config_file: Path, spec: HostBoundSpec) -> None:
    """Both spellings of RoPE theta and dtype, so older transformers (e.g. a peer venv's) read it too."""
    config = with_legacy_config_keys(json.loads(config_file.read_text()))
    config["_model_name_or_path"] = spec.name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
