"""Load a transformers causal LM, its tokenizer and its stop tokens from a local directory.

The model runs through transformers' own modeling code with our paged attention function
(:mod:`tgi_paged_backend.runner.attention`) selected at load time, so every family whose layers
call ``ALL_ATTENTION_FUNCTIONS`` with ``**kwargs`` works the same way (Llama, Mistral, Qwen2,
Phi-3, Gemma). Only safetensors weights from a local directory are read; nothing is fetched.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from loguru import logger
from packaging.version import Version

from tgi_paged_backend.config import ModelConfig
from tgi_paged_backend.runner.attention import register_attention
from tgi_paged_backend.runner.families import falcon
from tgi_paged_backend.runner.families.alibi import install_alibi_attention
from tgi_paged_backend.runner.families.mla import install_latent_attention
from tgi_paged_backend.runner.model import family_support, vlm_loading
from tgi_paged_backend.runner.model.rope_scaling import apply_rope_scaling
from tgi_paged_backend.runner.quant.methods import SUPPORTED_QUANTIZE, QuantizationError, check_quantize, refusal

if TYPE_CHECKING:
    from tgi_paged_backend.runner.quant.compressed_tensors import CompressedFp8Scheme, CompressedIntScheme
    from tgi_paged_backend.runner.quant.gptq_awq import GptqAwqScheme

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
    image_encoder: Any = None
    """A served vision-language model's image encoder (:mod:`.vlm_loading`); ``None`` for text models."""


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
    if model_config.quantize is not None and model_config.quantize not in SUPPORTED_QUANTIZE:
        raise ModelLoadError(refusal(model_config.quantize))


def _refuse_speculator(path: Path) -> None:
    """An MLP speculator is a separate checkpoint stock TGI pairs with a base model; this backend does not
    run one, so it refuses it rather than serve something else. A Medusa checkpoint arrives here only
    when the config was not resolved (``model_files.with_local_model`` serves its base model with it)."""
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") == "mlp_speculator":
        raise ModelLoadError(
            f"{path} is an MLP speculator checkpoint, which tgi-paged-backend does not serve: point --model-id "
            "at the base model and pass --speculate N (n-gram proposals from each request's history), or use "
            "a Medusa checkpoint"
        )
    if "medusa_num_heads" in raw:
        raise ModelLoadError(
            f"{path} is a Medusa checkpoint: load it through model_files.with_local_model, which serves its "
            "base model with its heads"
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


def _refuse_if(config: Any, reason: str | None) -> None:
    if reason is not None:
        raise ModelLoadError(family_support.refusal_message(config, reason))


def _probe_attention(model: transformers.PreTrainedModel) -> None:
    """Refuse the model unless a one-token forward reaches the paged attention once per layer."""
    config = model.config
    try:
        calls = family_support.probe_layer_calls(model)
    except Exception as err:  # noqa: BLE001 - any failure of foreign modeling code means "not served"
        _refuse_if(
            config, f"a one-token probe forward through the paged attention failed ({type(err).__name__}: {err})"
        )
    num_layers = int((getattr(config, "text_config", None) or config).num_hidden_layers)
    _refuse_if(config, family_support.check_attention_calls(num_layers, calls))


def _resolve_quantization(model_config: ModelConfig, config: Any) -> tuple[str | None, Any]:
    """The format to load (``None``: unquantized) and its validated scheme; a pre-quantized checkpoint's
    ``quantization_config`` is taken off ``config`` so transformers loads the module tree plainly (no
    transformers quantizer or quantization package is needed; the files are read by :mod:`.quant.apply`)."""
    scheme: CompressedFp8Scheme | CompressedIntScheme | GptqAwqScheme | None = None
    try:
        method = check_quantize(model_config.quantize, config)
        if method == "compressed-tensors":
            from tgi_paged_backend.runner.quant.compressed_tensors import parse_scheme

            scheme = parse_scheme(config.quantization_config)
            if getattr(scheme, "dynamic_activations", False):
                logger.info("compressed-tensors: dynamic fp8 input activations are served weight-only (W8A16)")
        elif method in ("gptq", "awq"):
            from tgi_paged_backend.runner.quant.gptq_awq import parse_config

            scheme = parse_config(config.quantization_config)
        if method not in (None, "fp8"):
            del config.quantization_config
    except QuantizationError as err:
        raise ModelLoadError(str(err)) from None
    return method, scheme


def _quantize(model: transformers.PreTrainedModel, method: str | None, scheme: Any, path: Path) -> None:
    """Swap in the quantized linears (on the CPU copy, before it moves to the device)."""
    if method is None:
        return
    from tgi_paged_backend.runner.quant.apply import load_quantized

    before = resident_bytes(model)
    try:
        count, what = load_quantized(model, method, scheme, path)
    except QuantizationError as err:
        raise ModelLoadError(str(err)) from None
    logger.info(
        "--quantize {}: {} linears in {}; weights {:.1f} -> {:.1f} MiB",
        method,
        count,
        what,
        before / 2**20,
        resident_bytes(model) / 2**20,
    )


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, plus what modules hold outside them (``resident_bytes``: the
    packed weights of :mod:`runner.cpu.fast_layers`): what the weights take where they are (fp8 bytes included)."""
    tensors = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    return tensors + sum(int(getattr(m, "resident_bytes", 0)) for m in model.modules())


def load_model(model_config: ModelConfig, device: torch.device | str) -> LoadedModel:
    """Load model, tokenizer and generation config from ``model_config.model_id`` (a local dir)."""
    check_supported(model_config)
    device = torch.device(device)
    path = _model_dir(model_config)
    _refuse_speculator(path)
    dtype = resolve_dtype(model_config.dtype, device)
    attn_name = register_attention()
    config = transformers.AutoConfig.from_pretrained(
        path, trust_remote_code=model_config.trust_remote_code, local_files_only=True
    )
    if model_config.rope_scaling is not None:  # ROPE_SCALING / ROPE_FACTOR replace the config's, as stock
        apply_rope_scaling(config, model_config.rope_scaling, model_config.rope_factor)
    _refuse_if(config, family_support.unsupported_reason(config))
    is_vlm = vlm_loading.is_served_vlm(config)
    if is_vlm:
        _refuse_if(config, vlm_loading.checkpoint_reason(config, path))
    method, scheme = _resolve_quantization(model_config, config)
    # Falcon picks its attention class by name (no interface): built plainly, then given ours (.falcon).
    is_falcon = str(config.model_type) == falcon.MODEL_TYPE
    auto_class = transformers.AutoModelForImageTextToText if is_vlm else transformers.AutoModelForCausalLM
    attn: str | dict[str, str] = falcon.LOAD_ATTENTION if is_falcon else attn_name
    try:
        model = auto_class.from_pretrained(
            path,
            **({} if model_config.rope_scaling is None and method is None else {"config": config}),
            attn_implementation=vlm_loading.attention_implementations(attn_name, config) if is_vlm else attn,
            trust_remote_code=model_config.trust_remote_code,
            use_safetensors=True,
            local_files_only=True,
            **{_DTYPE_KWARG: dtype},
        )
    except KeyError as err:  # modeling code that looks attention classes up by implementation name
        if err.args != (attn_name,):
            raise
        _refuse_if(
            config, f"its modeling code has no {attn_name!r} attention: it bypasses transformers' attention interface"
        )
    except ValueError as err:  # not a causal LM: AutoModelForCausalLM knows no class for this config
        if "Unrecognized configuration class" not in str(err):
            raise
        _refuse_if(config, "it has no causal-LM class in transformers (AutoModelForCausalLM)")
    if is_falcon:
        falcon.install_paged_falcon(model, attn_name)
    _quantize(model, method, scheme, path)
    install_alibi_attention(model)  # Bloom, MPT: their attention modules over the paged pool (others: nothing)
    install_latent_attention(model)  # DeepSeek-V2/V3: the latent attention over the paged latent pool (.mla)
    # transformers decorates PreTrainedModel.to with functools.wraps(nn.Module.to); typeshed's _Wrapped
    # has no __get__, so mypy does not bind the method and takes ``device`` for ``self``.
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    _probe_attention(model)

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, trust_remote_code=model_config.trust_remote_code, local_files_only=True
    )
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        generation_config = transformers.GenerationConfig.from_model_config(model.config)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        generation_config=generation_config,
        eos_token_ids=eos_token_ids(generation_config, tokenizer),
        dtype=dtype,
        image_encoder=vlm_loading.load_image_encoder(model, path) if is_vlm else None,
    )
