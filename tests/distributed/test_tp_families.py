"""Every served family at tensor parallel 2 (gloo): token-exact with HF, or refused with the reason
(``tests/helpers/family_tp.py``; ``docs/models.md`` shows the same column)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.family_tp import run_tp, tp_families

MUST_SERVE = {
    "Llama",
    "Llama-3.1",
    "Mistral",
    "Qwen2",
    "Qwen3",
    "Gemma",
    "Gemma2",
    "Gemma3",
    "Phi",
    "Phi3",
    "StarCoder2",
    "Mixtral",
    "Qwen2-MoE",
    "Qwen3-MoE",
    "gpt-oss",
    "GPT-NeoX",
    "GPT-J",
    "OPT",
    "GPT-2",
    "GPT-BigCode",
    "Granite",
    "Cohere",
    "Cohere2",
    "OLMo2",
    "Falcon",
    "Falcon-7B",
    "Falcon-RW",
    "Bloom",
    "MPT",
    "DeepSeek-V2",
    "DeepSeek-V3",
}
"""The layouts the slicing supports: separate q/k/v/o (Phi: dense) or Phi-3's fused qkv, and gate/up/down, a fused
gate_up, c_fc/c_proj or fc1/fc2; MoE blocks (experts split by their intermediate dimension, a shared expert too;
gpt-oss's interleaved experts and sinks); GPT-NeoX's per-head fused query_key_value, GPT-J's and OPT's out_proj
with fc_in/fc_out or fc1/fc2 (OPT's on the layer itself); GPT-2's Conv1D c_attn/c_proj/c_fc; GPT-BigCode's
one KV head, replicated on every rank; OLMo2's q/k norms over all heads (each rank its slice of the weight, the
sum of squares all-reduced); Falcon's fused query_key_value in each variant's layout (per KV group, or
multi-query's one KV head replicated); Bloom's per-head fused query_key_value and MPT's Wqkv blocks with up/down
MLPs; the ALiBi families (Bloom, MPT, Falcon-RW) with each rank's slopes for its heads; DeepSeek's latent
attention (query heads, kv_b_proj's per-head parts and o_proj split, the latent's projection and norm replicated,
so each rank's pool holds the whole latent) with its MoE (routed experts split, shared experts split and reduced
with the block)."""


def test_every_family_is_exact_or_refused_at_tensor_parallel_two(tmp_path: Path) -> None:
    outcomes = run_tp(tp_families(), tmp_path)
    for name, outcome in outcomes.items():
        if outcome.refusal is not None:
            assert name not in MUST_SERVE, f"{name} refused: {outcome.refusal}"
            assert "tensor parallelism" in outcome.refusal or "divisible" in outcome.refusal, outcome.refusal
        else:
            assert outcome.exact, f"{name}: tokens differ from HF at TP=2"
    assert MUST_SERVE <= {n for n, o in outcomes.items() if o.exact}
