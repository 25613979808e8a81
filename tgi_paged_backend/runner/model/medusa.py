"""Medusa heads: speculative proposals from the base model's last hidden state.

A Medusa checkpoint is a directory stock TGI serves as ``--model-id``: its ``config.json`` names the base
model (``base_model_name_or_path``) and the head geometry (``medusa_num_heads``, ``medusa_num_layers``),
and ``medusa_lm_head.safetensors`` holds, for head ``i`` and residual block ``j``::

    {i}.{j}.linear.weight   [hidden, hidden]
    {i}.{j}.linear.bias     [hidden]
    {i}.{L}.weight          [vocab, hidden]     (L = medusa_num_layers; optional)

Head ``i`` maps the hidden state ``h`` that produced token ``t+1`` to a guess for token ``t+2+i``:
``h <- h + silu(linear_j(h))`` for every block, then its own vocabulary projection ``{i}.{L}.weight``, or
the base model's ``lm_head`` when the file has none (stock's ``MedusaHeadV1`` and ``MedusaHeadV2``). The
proposal is each head's argmax; the engine verifies it like any draft (``engine.speculation``), so the
heads only change speed, never output.

``config.json`` is read by ``model_files.resolve_medusa`` (which points ``--model-id`` at the base model);
the runner loads the heads here and taps ``lm_head``'s input rows to feed them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from loguru import logger

from tgi_paged_backend.config import ModelConfig
from tgi_paged_backend.runner.model.loader import ModelLoadError

HEADS_FILE = "medusa_lm_head.safetensors"


class MedusaLoadError(ValueError):
    """The Medusa checkpoint does not match its config or the base model."""


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    """The head geometry and base model a Medusa checkpoint's ``config.json`` declares."""

    num_heads: int
    num_layers: int
    base_model: str


def read_medusa_config(path: Path) -> MedusaConfig | None:
    """``path``'s Medusa declaration, or ``None`` when ``path`` is not a Medusa checkpoint."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    raw = json.loads(config_file.read_text())
    if "medusa_num_heads" not in raw:
        return None
    base = raw.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise MedusaLoadError(f"{config_file} declares medusa_num_heads but no base_model_name_or_path")
    try:
        config = MedusaConfig(
            num_heads=int(raw["medusa_num_heads"]),
            num_layers=int(raw.get("medusa_num_layers", 1)),
            base_model=base,
        )
    except (TypeError, ValueError):
        raise MedusaLoadError(f"{config_file}: medusa_num_heads and medusa_num_layers must be integers") from None
    if config.num_heads < 1 or config.num_layers < 0:
        raise MedusaLoadError(f"{config_file}: medusa_num_heads must be >= 1 and medusa_num_layers >= 0")
    if not (path / HEADS_FILE).is_file():
        raise MedusaLoadError(f"{path} declares Medusa heads but has no {HEADS_FILE}")
    return config


class MedusaHeads(torch.nn.Module):
    """The first ``num_heads`` heads of a checkpoint, on the base model's device and dtype.

    ``lm_head`` is the base model's output projection, used by heads that have none of their own."""

    def __init__(self, blocks: torch.nn.ModuleList, outs: list[torch.nn.Linear | None], lm_head: torch.nn.Module):
        super().__init__()
        self.blocks = blocks  # blocks[i]: head i's residual linears
        self.outs = outs
        self.lm_head = lm_head
        self._hidden: torch.Tensor | None = None
        self._proposing = False
        lm_head.register_forward_pre_hook(self._tap)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def num_bytes(self) -> int:
        """Bytes of the heads' own weights (the base ``lm_head`` not counted)."""
        own = [p for p in self.blocks.parameters()] + [
            p for out in self.outs if out is not None for p in out.parameters()
        ]
        return sum(p.numel() * p.element_size() for p in own)

    def _tap(self, _module: torch.nn.Module, args: tuple) -> None:
        """Keep the rows ``lm_head`` is about to project: the hidden states of the forward's logits rows
        (not the heads' own calls through it)."""
        if not self._proposing:
            self._hidden = args[0]

    @torch.inference_mode()
    def propose(self, rows: Sequence[int], k: int) -> list[list[int]]:
        """Each head's argmax token (the first ``k`` heads) at logits rows ``rows`` of the last forward."""
        if not rows or k <= 0:
            return [[] for _ in rows]
        assert self._hidden is not None, "propose() before any forward"
        hidden = self._hidden.reshape(-1, self._hidden.shape[-1])
        h = hidden[torch.tensor(list(rows), device=hidden.device)]
        guesses = []
        self._proposing = True
        try:
            for blocks, out in zip(list(self.blocks)[:k], self.outs[:k]):
                x = h
                for linear in cast(torch.nn.ModuleList, blocks):
                    x = x + F.silu(linear(x))
                logits = (out if out is not None else self.lm_head)(x)
                guesses.append(logits.reshape(len(rows), -1).argmax(-1))
        finally:
            self._proposing = False
        return torch.stack(guesses, dim=1).tolist()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear


def load_medusa_heads(
    path: Path,
    config: MedusaConfig,
    num_heads: int,
    lm_head: torch.nn.Module,
    *,
    hidden_size: int,
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> MedusaHeads:
    """Read the first ``num_heads`` heads of ``path``'s ``medusa_lm_head.safetensors``, checked against the
    base model's ``hidden_size`` and ``vocab_size``, onto ``device`` in ``dtype``."""
    from safetensors import safe_open

    if not 1 <= num_heads <= config.num_heads:
        raise MedusaLoadError(f"{num_heads} heads asked of a checkpoint with {config.num_heads}")
    file = path / HEADS_FILE
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())

        def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in keys:
                raise MedusaLoadError(f"{file} has no {name!r}")
            t = f.get_tensor(name)
            if tuple(t.shape) != shape:
                raise MedusaLoadError(f"{file}: {name!r} has shape {tuple(t.shape)}, the base model needs {shape}")
            return t.to(device=device, dtype=dtype)

        blocks, outs = torch.nn.ModuleList(), []
        for i in range(num_heads):
            blocks.append(
                torch.nn.ModuleList(
                    _linear(
                        tensor(f"{i}.{j}.linear.weight", (hidden_size, hidden_size)),
                        tensor(f"{i}.{j}.linear.bias", (hidden_size,)),
                    )
                    for j in range(config.num_layers)
                )
            )
            out_name = f"{i}.{config.num_layers}.weight"
            outs.append(_linear(tensor(out_name, (vocab_size, hidden_size)), None) if out_name in keys else None)
    return MedusaHeads(blocks, outs, lm_head)


def load_medusa_for(
    model: Any, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> MedusaHeads | None:
    """The Medusa heads proposing drafts for ``model`` (``model_config.medusa_dir``), the first
    ``num_speculative_tokens`` of them; ``None`` without a Medusa checkpoint or with ``--speculate 0``."""
    if model_config.medusa_dir is None or model_config.num_speculative_tokens == 0:
        return None
    path = Path(model_config.medusa_dir)
    config = read_medusa_config(path)
    assert config is not None, f"{path} was resolved as a Medusa checkpoint"
    text = model.config.get_text_config()
    try:
        heads = load_medusa_heads(
            path,
            config,
            model_config.num_speculative_tokens,
            model.get_output_embeddings(),
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            device=device,
            dtype=dtype,
        )
    except MedusaLoadError as err:
        raise ModelLoadError(str(err)) from None
    logger.info("speculation: {} Medusa heads from {}", heads.num_heads, path)
    return heads
