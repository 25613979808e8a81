"""The sliding-window reclaim figure: peaks through the real manager agree with the window arithmetic."""

from __future__ import annotations

import pytest

from tgi_paged_backend.bench.sliding_window import compare_reclaim, format_comparisons, simulate_long_run
from tgi_paged_backend.memory.window_reclaim import max_resident_blocks


def test_reclaim_bounds_each_request_by_its_window_and_chunk() -> None:
    run = dict(num_requests=3, prompt_tokens=24, output_tokens=100, block_size=4, max_prefill_tokens=8)
    without = simulate_long_run(window=None, **run)
    with_reclaim = simulate_long_run(window=8, **run)
    assert without.peak_blocks == 3 * 31 and without.peak_request_blocks == 31  # 123 positions
    # An 8-token chunk at 8 reads positions 1..15: blocks 0..3 (the bound allows one more, unaligned).
    assert with_reclaim.peak_request_blocks == 4 <= max_resident_blocks(8, 4, 8)
    # Prompts go one chunk at a time (budget 8), so at most one request holds a chunk's blocks.
    assert with_reclaim.peak_blocks <= max_resident_blocks(8, 4, 8) + 2 * max_resident_blocks(8, 4)
    # The last step (query at 122) reads 115..122: all but the last 3 of 31 blocks were given back.
    assert with_reclaim.num_reclaimed_blocks == 3 * (31 - 3)


def test_mixed_layers_reclaim_nothing_and_hybrid_pools_are_reported_apart() -> None:
    all_windowed = compare_reclaim(
        "w", [8, 8], num_requests=2, prompt_tokens=8, output_tokens=56, block_size=4, max_prefill_tokens=8
    )
    mixed = compare_reclaim(
        "m", [8, None], num_requests=2, prompt_tokens=8, output_tokens=56, block_size=4, max_prefill_tokens=8
    )
    assert all_windowed.with_reclaim.window == 8 and all_windowed.ratio > 2
    assert mixed.with_reclaim.window is None and mixed.ratio == 1.0 and mixed.saving == 0.0
    assert mixed.hybrid_saving == pytest.approx(0.5 * (1 - 3 / 16))
    table = format_comparisons([all_windowed, mixed], block_bytes={"w": 2**30})
    assert "| m | none (mixed layers) |" in table and "GiB" in table


def test_layer_groups_measured_saving_matches_the_analytic_one() -> None:
    """The engine's KV layer groups through the real manager save what the per-layer analytic says at the
    end, within a block per request, and at least the bound LayerGroups.saving gives (padding counted)."""
    from tgi_paged_backend.memory.layer_groups import LayerGroups

    for windows in ([8, None], [8, 8, 8, None], [4, None, 8, None]):
        r = compare_reclaim(
            "g", windows, num_requests=3, prompt_tokens=8, output_tokens=57, block_size=4, max_prefill_tokens=8
        )
        assert r.grouped is not None and r.grouped_saving is not None
        at_end = r.grouped_saving[1]
        per_block = 1 / 16  # one block of a request's 16 (64 positions), as a share
        assert abs(at_end - r.hybrid_saving) <= per_block, (windows, at_end, r.hybrid_saving)
        assert at_end >= LayerGroups.from_layer_windows(windows).saving(64, 4, 1) - 1e-9
        # per request at the end, the blocks held are the groups' arithmetic (padding and partial blocks in)
        assert r.measured_final_request_blocks == r.final_request_blocks, windows
    gemma3 = ([16] * 5 + [None]) * 2 + [16] * 2  # 12 sliding, 2 full: U = 2, 1 full + 6 sliding groups
    r = compare_reclaim("g3", gemma3, num_requests=2, prompt_tokens=40, output_tokens=41, block_size=4)
    # 80 positions = 20 blocks; the last query (79) reads 64..79, so each sliding group keeps 4
    assert r.final_request_blocks == 20 + 6 * 4 == r.measured_final_request_blocks
    assert compare_reclaim("u", [8, 8], num_requests=1, prompt_tokens=8, output_tokens=8, block_size=4).grouped is None
