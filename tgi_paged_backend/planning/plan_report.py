"""The printed plan (``tgi-paged-backend plan``): the model, device, KV, pool, group and trace lines, the
simulation's tables, and the advised overcommit with its reason."""

from __future__ import annotations

from tgi_paged_backend.planning.host_tier import format_host_tier
from tgi_paged_backend.planning.plan import Plan
from tgi_paged_backend.planning.report import comparison_table, fmt_bytes, overcommit_table
from tgi_paged_backend.planning.sim_results import THROUGHPUT_TOLERANCE, WASTE_TOLERANCE, Comparison


def format_plan(plan: Plan) -> str:
    """The planner's printed report."""
    s, t = plan.facts.spec, plan.trace_summary
    kv_form = (
        f"latent KV {s.latent_rank} + RoPE key {s.head_dim - s.latent_rank} (MLA, one entry per token and layer)"
        if s.latent_rank
        else f"{s.num_kv_heads} KV heads x {s.head_dim}"
    )
    lines = [
        f"model        {plan.facts.name}: {s.model_type}, {s.num_layers} layers, {kv_form}, "
        f"{plan.facts.num_params / 1e9:.3f} B params "
        f"({'counted' if plan.facts.params_exact else 'estimated'}), weights {fmt_bytes(plan.weights_bytes)} "
        + (
            f"per rank of {plan.inputs.num_shard} ({fmt_bytes(plan.weights_bytes_total)} in all) "
            if plan.inputs.num_shard > 1
            else ""
        )
        + f"({plan.dtype_name}{f', --quantize {plan.inputs.quantize}' if plan.inputs.quantize else ''})",
        f"device       {plan.device.name}"
        + (f", {fmt_bytes(plan.device_bytes)} x {plan.inputs.memory_fraction:g}" if plan.device_bytes else "")
        + f"; activation peak (prefill {plan.capacity.max_prefill_tokens} tokens) {fmt_bytes(plan.activation_bytes)}",
        f"KV           {plan.bytes_per_token:,} bytes per token"
        + (
            (
                " per rank (the latent whole on each)"
                if s.latent_rank
                else f" per rank ({plan.rank_spec.num_kv_heads} KV heads each)"
            )
            if plan.inputs.num_shard > 1
            else ""
        )
        + f" ({plan.kv_dtype_name}); block of {plan.inputs.block_size} tokens"
        + (f" of one group's {plan.groups.layers_per_block} layers" if plan.groups.num_groups > 1 else "")
        + f" = {fmt_bytes(plan.block_bytes)}; budget {fmt_bytes(plan.kv_budget_bytes)}",
        f"pool         {plan.num_blocks:,} physical blocks (incl. scratch) = {plan.physical_tokens:,} tokens "
        f"that fit{' (every group keeping every block)' if plan.groups.num_groups > 1 else ''}; max_total_tokens "
        f"{plan.capacity.max_total_tokens:,}",
        *group_lines(plan),
        f"trace        {t['requests']} requests, prompt mean {t['prompt_mean']:.0f} (max {t['prompt_max']}), "
        f"output mean {t['output_mean']:.0f} (max {t['output_max']}), max_new_tokens mean "
        f"{t['max_new_tokens_mean']:.0f}, arrivals over {t['duration_s']:.1f} s",
        f"bounds       stock TGI admits at most {plan.physical_tokens / t['reserved_mean']:.1f} mean reservations; "
        f"finished requests average {t['prompt_mean'] + t['output_mean']:.0f} tokens",
        "",
        comparison_table(plan.comparison, time_unit="s"),
        "",
        overcommit_table(plan.comparison),
        "",
        f"advice       TGI_PAGED_OVERCOMMIT={plan.advised_overcommit:g}  (advertises "
        f"{plan.capacity.max_supported_total_tokens:,} tokens to the router): " + advice_reason(plan.comparison),
    ]
    if plan.host_tier is not None:
        lines += ["", *format_host_tier(plan.host_tier, plan.inputs.block_size)]
    lines += [f"note         {n}" for n in plan.notes]
    return "\n".join(lines)


def group_lines(plan: Plan) -> list[str]:
    """The KV layer groups' lines of :func:`format_plan` (none for one group)."""
    g, c = plan.groups, plan.capacity
    if g.num_groups == 1:
        return []
    held, final = plan.group_request_blocks(), plan.group_final_blocks()
    one_map = -(-c.max_total_tokens // plan.inputs.block_size)
    lines = [
        f"groups       {g.num_groups} KV layer groups, a block holds {g.layers_per_block} layers' K/V"
        + (f" ({g.num_padding} padding slots)" if g.num_padding else "")
        + f"; budget gain x{c.budget_gain:.2f}: a max_total_tokens ({c.max_total_tokens:,}) request holds "
        f"{sum(final):,} blocks at its end, {g.num_groups * one_map:,} with one page map for all layers"
    ]
    for i, (window, layers, peak, end) in enumerate(zip(g.windows, g.layers, held, final, strict=True)):
        kind = "full" if window is None else f"window {window}"
        at_peak = "" if peak == end else f", at most {peak:,} while a prefill chunk reads its window"
        lines.append(
            f"{f'group {i}':<13}{kind}, {len(layers)} layers: {end:,} blocks a request at its end{at_peak} "
            f"(one page map for all layers: {one_map:,})"
        )
    return lines


def advice_reason(c: Comparison) -> str:
    best = c.best
    top = max(c.paged.values(), key=lambda r: r.tokens_per_s)
    least = min(c.paged.values(), key=lambda r: r.waste_total)
    fallback = best.tokens_per_s < (1 - THROUGHPUT_TOLERANCE) * top.tokens_per_s
    return (
        f"{'no run met both tolerances, so the fastest within the waste one; rule: ' if fallback else ''}"
        f"the smallest overcommit within {100 * THROUGHPUT_TOLERANCE:g} % of the best simulated throughput "
        f"({best.tokens_per_s:,.0f} vs {top.tokens_per_s:,.0f} tok/s at {top.overcommit:g}) and "
        f"{100 * WASTE_TOLERANCE:g} point(s) of the lowest KV waste "
        f"({100 * best.waste_total:.1f} % vs {100 * least.waste_total:.1f} % at {least.overcommit:g}), recompute "
        f"tax {100 * best.recompute_tax:.1f} % ({best.preemptions_recompute} recompute / "
        f"{best.preemptions_swap} swap preemptions)"
    )
