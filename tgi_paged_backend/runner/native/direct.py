"""A stacked model's decode step without transformers' model loop: embed the tokens, take the RoPE tables from the
model's rotary module, run the :class:`~.stack.DecodeStack`'s one call, then the final norm and the LM head on the
step's logits rows.

With the stack, a decode step's decoder layers are one native call, and what is left of the step's forward is
transformers' model code around it: the causal-mask helpers, a module call per layer (each passing the stack's
output through), output dataclasses. :class:`DirectDecode` calls the model's own embedding, rotary, norm and head
modules in the order a plain decoder-only model does, with the scalings some families add there, read from the model
(:class:`Ends`: Granite's embedding multiplier and logits scaling, Cohere's logit scale, Gemma 2/3's final logit
soft-cap), and serves only after :func:`prove_direct` (at Warmup, after the stack's proof) ran one decode step both
ways over scratch pools and got the same logits and K/V to the bit. A model that does anything else around its
layers (another layout of its modules, another order of those operations) fails the proof and keeps the model's
forward; ``direct.kept`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger
from torch import nn

from tgi_paged_backend.runner.attention import PagedAttentionMetadata
from tgi_paged_backend.runner.input_batch import ForwardBatch
from tgi_paged_backend.runner.native.stack import DecodeStack, Forward, both_ways, proof_batch


@dataclass(frozen=True, slots=True)
class Ends:
    """What a family does around its layers, in transformers' order: ``embeddings * embedding_multiplier``
    (Granite), then after the LM head ``logits * logit_scale`` (Cohere), ``logits / logits_scaling`` (Granite) and
    ``tanh(logits / cap) * cap`` (Gemma 2/3's final soft-cap). ``None``: the family does not."""

    embedding_multiplier: float | None = None
    logit_scale: float | None = None
    logits_scaling: float | None = None
    final_softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> Ends:
        config = getattr(model, "config", None)

        def number(owner: Any, name: str) -> float | None:
            value = getattr(owner, name, None)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        return cls(
            embedding_multiplier=number(config, "embedding_multiplier"),
            logit_scale=number(model, "logit_scale"),  # Cohere keeps it on the causal LM
            logits_scaling=number(config, "logits_scaling"),
            final_softcap=number(config, "final_logit_softcapping"),
        )

    def embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.embedding_multiplier is None else hidden * self.embedding_multiplier

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class DirectDecode:
    """The modules around a stacked model's layers, and whether its decode steps skip the model's forward."""

    def __init__(
        self, stack: DecodeStack, embed: nn.Module, rotary: nn.Module, norm: nn.Module, head: nn.Module, ends: Ends
    ) -> None:
        self.stack, self.embed, self.rotary, self.norm, self.head, self.ends = stack, embed, rotary, norm, head, ends
        self.enabled = False
        """Set by :func:`prove_direct` when the direct step gave the model's logits and K/V."""
        self.kept = "not proven (no Warmup decode step yet)"
        self.steps = 0
        """Decode steps served directly."""

    def run(self, batch: ForwardBatch, metadata: PagedAttentionMetadata) -> torch.Tensor | None:
        """``[K, vocab]`` fp32 logits of a plain text decode step's rows, or ``None`` (not proven, a step of another
        kind, or inputs the stack does not take: the model's forward serves)."""
        if not self.enabled or not batch.is_decode or batch.image_rows or batch.rope_positions is not None:
            return None
        if not self.stack.takes(metadata, int(batch.input_ids.shape[0])):  # before embedding: the forward serves
            return None
        hidden = self.ends.embeddings(self.embed(batch.input_ids.unsqueeze(0)))
        tables = self.rotary(hidden, batch.positions.unsqueeze(0))
        out = self.stack.call(hidden, tables, metadata, pass_through=False)
        if out is None:
            return None
        self.steps += 1
        logits = self.ends.logits(self.head(self.norm(out)[:, batch.logits_indices, :]))
        return logits[0].float()


def direct_decode(model: nn.Module, stack: DecodeStack) -> DirectDecode | str:
    """``model``'s direct decode step around ``stack``, or why its modules are not laid out for one: a causal LM
    whose ``model`` holds ``embed_tokens``, ``rotary_emb``, ``norm`` and exactly the stack's layers as ``layers``,
    and whose ``lm_head`` is the head."""
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    parts = [getattr(base, name, None) for name in ("embed_tokens", "rotary_emb", "norm", "layers")]
    embed, rotary, norm, layers = parts
    if not isinstance(head, nn.Module) or not all(isinstance(part, nn.Module) for part in parts):
        return "the model's modules are not laid out as model.{embed_tokens, rotary_emb, norm, layers} and lm_head"
    assert isinstance(embed, nn.Module) and isinstance(rotary, nn.Module) and isinstance(norm, nn.Module)
    if not isinstance(layers, nn.ModuleList) or list(layers) != stack.layers:
        return "the stack is not the model's layer list"
    return DirectDecode(stack, embed, rotary, norm, head, Ends.of(model))


def prove_direct(
    direct: DirectDecode,
    forward: Forward,
    k_like: list[torch.Tensor],
    v_like: list[torch.Tensor],
    block_size: int,
    lora_slots: tuple[int, ...] = (-1, -1, -1),
    kv_groups: int = 1,
) -> bool:
    """Run one decode step over scratch pools shaped as ``k_like``/``v_like`` (random history) through the model's
    forward, then directly; enable the direct step when the logits and K/V are equal to the bit (``lora_slots``,
    ``kv_groups``: as :func:`~.stack.prove_stack`'s). Logs the outcome; returns ``direct.enabled``."""
    direct.enabled = False
    if not direct.stack.enabled:
        direct.kept = "the layers are not stacked"
    else:
        direct.kept = _prove(direct, forward, k_like, v_like, *proof_batch(block_size, lora_slots, 1, kv_groups))
    direct.enabled = not direct.kept
    if direct.kept:
        logger.info("native direct decode: the model's forward serves: {}", direct.kept)
    else:
        logger.info("native direct decode: embed, the stack, norm and head without the model's forward")
    return direct.enabled


def _prove(
    direct: DirectDecode,
    forward: Forward,
    k_like: list[torch.Tensor],
    v_like: list[torch.Tensor],
    batch: ForwardBatch,
    blocks: int,
) -> str:
    steps = direct.steps
    try:
        ref, got = both_ways(forward, batch, blocks, k_like, v_like, lambda: setattr(direct, "enabled", True), seed=1)
    except Exception as e:  # noqa: BLE001 - any failure means: the model's forward serves
        return f"its proof step failed: {type(e).__name__}: {e}"
    finally:
        direct.enabled = False
    if direct.steps != steps + 1:
        return "the direct step did not run (inputs of another kind)"
    if not all(torch.equal(a, b) for a, b in zip(ref, got)):
        return "the direct step's logits or K/V differ from the model's forward"
    return ""
