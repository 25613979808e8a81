"""Issue 39's figures judged against its goals and floors, over one run's reports (one per ``--dtype``).

Report only, never a CI gate. Each figure is a ratio of this shard to vLLM's CPU build in the same run:

- *host-bound burst per form* (float32; Llama, Qwen3, Gemma 3, Mixtral: ``--hostbound-forms``): tokens/s,
  goal >= 1.5x, floor 1.2x;
- *SmolLM2 burst in bfloat16*: tokens/s, goal >= 1.2x on a host that computes bf16 (AVX512-BF16 or AMX); on an
  AVX2-only host the goal is instead this shard's bf16 within 10 % of its own float32 (>= 0.9x);
- *TTFT at 128 prompt tokens* (the ``prefill`` run, one request at a time): goal <= 1.0x (lower is faster).
"""

from __future__ import annotations

from typing import Any

from integration.peers.goals import Goal, engines_by_key, ratio
from integration.peers.hostbound_forms import FORMS


def _sections(reports: list[dict[str, Any]], dtype: str) -> dict[str, dict[str, Any]]:
    for report in reports:
        if report.get("dtype", "float32") == dtype:
            return {s.get("key", ""): s for s in report.get("sections", [])}
    return {}


def _tokens_per_s(section: dict[str, Any] | None) -> float | None:
    shard = engines_by_key(section).get("shard")
    run = shard.runs.get("burst") if shard else None
    return run.tokens_per_s if run else None


def _ttft_ratio(section: dict[str, Any] | None, prompt_tokens: int) -> float | None:
    """shard / vLLM time to first token of the prefill run's request nearest ``prompt_tokens``."""
    by = engines_by_key(section)
    runs = [by[k].runs.get("prefill") if k in by else None for k in ("shard", "vllm")]
    lengths = (section or {}).get("config", {}).get("prefill_prompts", [])
    if not lengths or any(r is None or len(r.ttft_each_s) != len(lengths) for r in runs):
        return None
    k = min(range(len(lengths)), key=lambda i: abs(lengths[i] - prompt_tokens))
    ours, theirs = (r.ttft_each_s[k] for r in runs)  # type: ignore[union-attr]
    return ours / theirs if theirs else None


def issue39_goals(reports: list[dict[str, Any]]) -> list[Goal]:
    fp32, bf16 = _sections(reports, "float32"), _sections(reports, "bfloat16")
    host = next((r.get("host") for r in reports if r.get("host") is not None), None)
    native = getattr(host, "native_bf16", None)
    goals = []
    for form in FORMS:
        key = "hostbound" if form == "llama" else f"hostbound-{form}"
        note = "" if key in fp32 else f"not run (--dtype float32 --scenarios hostbound --hostbound-forms {form})"
        goals.append(
            Goal(
                f"host-bound {form} burst, float32, vs vLLM", ratio(fp32.get(key), "burst"), ">= 1.5x", ">= 1.2x", note
            )
        )
    if native or native is None:
        note = "" if "smollm2" in bf16 else "not run (--dtype bfloat16 --scenarios burst)"
        if native is None:
            note = "; ".join(filter(None, (note, "host ISA unknown")))
        goals.append(
            Goal("SmolLM2 burst, bfloat16, vs vLLM", ratio(bf16.get("smollm2"), "burst"), ">= 1.2x", note=note)
        )
    else:
        ours_bf16, ours_fp32 = _tokens_per_s(bf16.get("smollm2")), _tokens_per_s(fp32.get("smollm2"))
        own = ours_bf16 / ours_fp32 if ours_bf16 and ours_fp32 else None
        note = "AVX2-only host" + ("" if own else "; needs the burst in --dtype float32 bfloat16")
        goals.append(Goal("SmolLM2 burst, this shard bfloat16 / float32", own, ">= 0.9x", note=note))
    prefill = fp32.get("prefill") or bf16.get("prefill")
    note = "" if prefill else "not run (--scenarios prefill)"
    goals.append(
        Goal("TTFT, 128-token prompt, vs vLLM (lower = faster)", _ttft_ratio(prefill, 128), "<= 1.0x", note=note)
    )
    return goals
