"""Tiny random causal LMs written to disk, for tests that must run offline and fast.

Each factory writes a complete local model directory (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` + ``tokenizer_config.json``) that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load with ``local_files_only=True``. Weights and
tokenizer are deterministic functions of ``seed``.

The tokenizer is a byte-level BPE trained on :data:`TINY_CORPUS`, so any text encodes; special
tokens are ``<unk>`` = 0, ``<s>`` = 1 (BOS, prepended), ``</s>`` = 2 (EOS), ``<pad>`` = 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

TINY_KINDS: tuple[str, ...] = ("llama", "qwen2", "mistral")
"""The main model families of the parity tests."""

EXTRA_KINDS: tuple[str, ...] = ("phi3", "gemma2")
"""Further families :func:`write_tiny_model` can write (fused QKV; soft-capping + alternating windows)."""

TINY_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache keeps keys and values in fixed-size blocks.",
    "Hello world! How are you today?",
    "Large language models predict the next token from the previous ones.",
    "The router reserves slots; the shard writes keys and values only where it computes.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16.",
    "Once upon a time, a small model learned to count blocks.",
)
"""Sentences the tiny BPE tokenizer is trained on."""

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

_PER_KIND: dict[str, dict[str, Any]] = {
    "llama": dict(num_hidden_layers=3, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=False),  # Qwen2: q/k/v biases
    "mistral": dict(sliding_window=24, rope_theta=10000.0, tie_word_embeddings=False),
    "phi3": dict(sliding_window=20, rope_theta=10000.0, tie_word_embeddings=False),
    "gemma2": dict(
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        rope_theta=10000.0,
    ),
}


def tiny_config(kind: str, *, vocab_size: int = 512, **overrides: Any) -> transformers.PretrainedConfig:
    """Config of a tiny ``kind`` model (hidden 64, 4 query / 2 KV heads of 16 channels)."""
    if kind not in _PER_KIND:
        raise ValueError(f"unknown tiny model kind {kind!r}: allowed {TINY_KINDS + EXTRA_KINDS}")
    kwargs = {**_COMMON, **_PER_KIND[kind], "vocab_size": vocab_size, **overrides}
    return transformers.AutoConfig.for_model(kind, **kwargs)


def make_tiny_tokenizer(vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on :data:`TINY_CORPUS` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(TINY_CORPUS), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def write_tiny_model(
    kind: str, path: Path | str, *, seed: int = 0, vocab_size: int = 512, **config_overrides: Any
) -> Path:
    """Write a tiny random ``kind`` model plus tokenizer to ``path`` (created) and return it.

    ``config_overrides`` go to the config (e.g. ``sliding_window=8``, ``num_hidden_layers=2``).
    """
    return write_model_from_config(tiny_config(kind, vocab_size=vocab_size, **config_overrides), path, seed=seed)


def write_model_from_config(
    config: transformers.PretrainedConfig, path: Path | str, *, seed: int = 0, param_std: dict[str, float] | None = None
) -> Path:
    """Write a random causal LM of ``config`` plus the tiny tokenizer to ``path`` (created).

    Every weight is drawn from ``seed``: norm scales (and layernorm biases) ``1 + 0.1 N(0, 1)``, the rest
    ``initializer_range N(0, 1)``, or ``param_std[suffix] N(0, 1)`` for names ending in a key of
    ``param_std`` (weights whose effect a test must see, e.g. attention sinks; buffers too, e.g. DeepSeek-V3's
    routing correction bias).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    std = getattr(config, "initializer_range", None) or getattr(config, "init_std", None) or 0.1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        # Re-draw every weight from the seed: init order inside transformers is version dependent.
        generator = torch.Generator().manual_seed(seed)
        norm_scales = {
            f"{module_name}.weight" for module_name, module in model.named_modules() if "Norm" in type(module).__name__
        }  # LayerNorms named ln_1, ln_f, ...
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                special = [s for suffix, s in (param_std or {}).items() if name.endswith(suffix)]
                if special:
                    param.copy_(special[0] * torch.randn(param.shape, generator=generator))
                elif name.endswith("norm.weight") or "layernorm" in name or name in norm_scales:
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
                else:
                    param.copy_(std * torch.randn(param.shape, generator=generator))
            for name, buffer in sorted(model.named_buffers()):  # e.g. DeepSeek-V3's routing correction bias
                special = [s for suffix, s in (param_std or {}).items() if name.endswith(suffix)]
                if special:
                    buffer.copy_(special[0] * torch.randn(buffer.shape, generator=generator))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def reference_attention(path: Path | str) -> str:
    """The ``attn_implementation`` of the reference for the model in ``path``: ``eager``, except ``sdpa`` for
    Falcon's ALiBi variants, whose eager path (transformers 5.24) adds the ALiBi bias twice (once folded into the
    causal mask, once more before the scaling); the SDPA path adds it once, as the original Falcon-RW code does
    (``runner/families/falcon.py``)."""
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    return "sdpa" if config.model_type == "falcon" and getattr(config, "alibi", False) else "eager"


def load_reference(path: Path | str, attn_implementation: str | None = None) -> Any:
    """Load ``path`` as a plain HF model (float32, CPU, eval) to compare against (``attn_implementation``: by
    default :func:`reference_attention`'s)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation or reference_attention(path), local_files_only=True
    )
    return model.float().eval()
