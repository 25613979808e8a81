"""The vision-language rows of ``docs/models.md``: every VLM family stock TGI 3.3 serves. A refused one is
started from a config-only checkpoint (the backend refuses it from the config, before any weight is read),
so its row shows the start-up refusal message verbatim; a served one (``served``: LLaVA-NeXT, Idefics2/3, SmolVLM,
Qwen2-VL, Qwen2.5-VL, Gemma 3, PaliGemma) runs
the image scenarios of :mod:`tests.helpers.llava_next_scenarios` (issue 40, docs/vlm.md) on its tiny checkpoint
(:func:`write_served`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import transformers

from tests.helpers.family_models import Family


@dataclass(frozen=True)
class VlmFamily:
    name: str
    model_type: str
    architecture: str
    """``architectures[0]`` of the family's released checkpoints."""
    feature: str
    phrase: str
    """A phrase the refusal must contain (``""`` for a served family)."""
    served: bool = False
    """Served by the paged backend: its row comes from its image scenarios, not a refusal."""


VLM_FAMILIES: tuple[VlmFamily, ...] = (
    VlmFamily("LLaVA-NeXT", "llava_next", "LlavaNextForConditionalGeneration",
              "VLM: anyres image tiles, images hashed into prefix keys", "", served=True),
    VlmFamily("Qwen2-VL", "qwen2_vl", "Qwen2VLForConditionalGeneration",
              "VLM: M-RoPE (3-D positions, delta into decode), images hashed into prefix keys", "", served=True),
    VlmFamily("Qwen2.5-VL", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
              "VLM: M-RoPE, windowed vision tower, images hashed into prefix keys", "", served=True),
    VlmFamily("Gemma 3 (vision)", "gemma3", "Gemma3ForConditionalGeneration",
              "VLM: bidirectional attention within each image (per-row key limits), sliding layers", "", served=True),
    VlmFamily("Idefics 2", "idefics2", "Idefics2ForConditionalGeneration",
              "VLM: perceiver resampler, image splitting", "", served=True),
    VlmFamily("Idefics 3", "idefics3", "Idefics3ForConditionalGeneration",
              "VLM: image tiles with row/column separators", "", served=True),
    VlmFamily("SmolVLM", "smolvlm", "SmolVLMForConditionalGeneration",
              "VLM: image tiles with row/column separators", "", served=True),
    VlmFamily("PaliGemma", "paligemma", "PaliGemmaForConditionalGeneration",
              "VLM: prefix-LM (the whole prompt bidirectional), positions from 1", "", served=True),
    VlmFamily("Mllama", "mllama", "MllamaForConditionalGeneration", "VLM: cross-attention", "cross-attention"),
    VlmFamily("Llama 4", "llama4", "Llama4ForConditionalGeneration", "VLM: chunked local attention",
              "chunked local attention"),
)  # fmt: skip


def write_served(vlm: VlmFamily, path: Path) -> tuple[Path, type]:
    """A served family's tiny checkpoint in ``path`` and its HF reference class."""
    if vlm.model_type == "llava_next":
        from tests.helpers.llava_next_models import LlavaNextReference, write_llava_next_model

        return write_llava_next_model(path), LlavaNextReference
    if vlm.model_type in ("gemma3", "paligemma"):
        from tests.helpers.gemma_vlm_models import GemmaVlmReference, write_gemma_vlm_model

        return write_gemma_vlm_model(path, vlm.model_type), GemmaVlmReference
    if vlm.model_type in ("qwen2_vl", "qwen2_5_vl"):
        from tests.helpers.qwen2_vl_models import Qwen2VlReference, write_qwen2_vl_model

        return write_qwen2_vl_model(path, vlm.model_type), Qwen2VlReference
    from tests.helpers.idefics_models import IdeficsReference, write_idefics_model

    return write_idefics_model(path, vlm.model_type), IdeficsReference


def as_family(vlm: VlmFamily) -> Family:
    """The matrix's row type (no tiny overrides: the config alone is refused)."""
    return Family(vlm.name, vlm.model_type, {}, vlm.feature)


def write_config_only(vlm: VlmFamily, path: Path) -> Path:
    """The family's default config with its released architecture name, and a stand-in weight file."""
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.for_model(vlm.model_type)
    config.architectures = [vlm.architecture]
    config.save_pretrained(path)
    safetensors.torch.save_file({"stand_in": torch.zeros(1)}, str(path / "model.safetensors"))
    return path
