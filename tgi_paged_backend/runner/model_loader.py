"""Load a transformers causal LM, its tokenizer and its stop tokens from a local directory.

The model runs through transformers' own modeling code with our paged attention function
(:mod:`tgi_paged_backend.runner.attention`) selected at load time, so every family whose layers
call ``ALL_ATTENTION_FUNCTIONS`` with ``**kwargs`` works the same way (Llama, Mistral, Qwen2,
Phi-3, Gemma). Only safetensors weights from a local directory are read; nothing is fetched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version

from tgi_paged_backend.config import ModelConfig
from tgi_paged_backend.runner.attention import register_attention

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

# transformers renamed ``torch_dtype=`` to ``dtype=`` in 4.56 (the old name warns afterwards).
_DTYPE_KWARG = "dtype" if Version(transformers.__version__) >= Version("4.56.0") else "torch_dtype"


class ModelLoadError(RuntimeError):
    """The model cannot be served by this backend; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for :class:`~tgi_paged_backend.runner.model_runner.ModelRunner`."""

    model: torch.nn.Module
    """The ``*ForCausalLM`` module, in eval mode, on the target device."""
    tokenizer: Any
    """The ``AutoTokenizer`` of the model directory."""
    generation_config: Any
    """``transformers.GenerationConfig`` (defaults when the directory has none)."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end a generation."""
    dtype: torch.dtype
    """Weights and activation dtype."""


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``ModelConfig.dtype`` as a torch dtype; ``None`` is float16 on CUDA, float32 elsewhere."""
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"dtype={name!r} is invalid: allowed {tuple(_DTYPES)}") from None


def eos_token_ids(generation_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """Stop tokens: the generation config's list when it has one, else the tokenizer's EOS."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(gen_eos, (list, tuple)):
        return tuple(int(i) for i in gen_eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        return (int(tok_eos),)
    return () if gen_eos is None else (int(gen_eos),)


def check_supported(model_config: ModelConfig) -> None:
    """Reject options this backend does not implement, naming the launcher flag."""
    if model_config.quantize:
        raise ModelLoadError(
            f"--quantize {model_config.quantize} is not supported by the paged backend; "
            "serve unquantized safetensors weights (or use TGI_BACKEND=stock)"
        )
    if model_config.speculate:
        raise ModelLoadError(
            f"--speculate {model_config.speculate} is not supported by the paged backend; remove it "
            "(speculative decoding is not implemented)"
        )


def _model_dir(model_config: ModelConfig) -> Path:
    path = Path(model_config.model_id).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model_id={model_config.model_id!r} is not a local directory; the paged backend loads "
            "local safetensors only (run `text-generation-server download-weights` first)"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return path


def load_model(model_config: ModelConfig, device: torch.device | str) -> LoadedModel:
    """Load model, tokenizer and generation config from ``model_config.model_id`` (a local dir)."""
    check_supported(model_config)
    device = torch.device(device)
    path = _model_dir(model_config)
    dtype = resolve_dtype(model_config.dtype, device)
    attn_name = register_attention()

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        attn_implementation=attn_name,
        trust_remote_code=model_config.trust_remote_code,
        use_safetensors=True,
        local_files_only=True,
        **{_DTYPE_KWARG: dtype},
    )
    model.to(device)
    model.eval()
    model.requires_grad_(False)

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, trust_remote_code=model_config.trust_remote_code, local_files_only=True)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        generation_config = transformers.GenerationConfig.from_model_config(model.config)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        generation_config=generation_config,
        eos_token_ids=eos_token_ids(generation_config, tokenizer),
        dtype=dtype,
    )
