"""KV layer groups (``memory.layer_groups``): the grouping rule on the shapes of the hybrid models the
issue names, and the per-request block arithmetic against the per-layer analytic saving."""

from __future__ import annotations

import pytest

from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.memory.window_reclaim import hybrid_pool_saving

S, F = 4096, None  # Gemma's window, full attention


def alternating(num_layers: int, window: int) -> list[int | None]:
    return [window if i % 2 == 0 else F for i in range(num_layers)]


def every_nth_full(num_layers: int, window: int, n: int) -> list[int | None]:
    return [F if (i + 1) % n == 0 else window for i in range(num_layers)]


GEMMA2_9B = alternating(42, S)
GPT_OSS_20B = alternating(24, 128)
GEMMA3_27B = every_nth_full(62, 1024, 6)  # 52 sliding, 10 full
COHERE2 = every_nth_full(40, S, 4)  # 30 sliding, 10 full


@pytest.mark.parametrize(
    "windows, groups, per_block, padding",
    [
        (GEMMA2_9B, 2, 21, 0),
        (GPT_OSS_20B, 2, 12, 0),
        (COHERE2, 4, 10, 0),
        (GEMMA3_27B, 7, 10, 8),  # 52 sliding layers in 6 groups of 10: the last has 2 (8 padded slots)
        ([F] * 30, 1, 30, 0),  # one type: today's single page map
        ([S] * 32, 1, 32, 0),  # all sliding (Mistral): one group, the window reclaim of today
    ],
)
def test_grouping_rule(windows, groups, per_block, padding):
    g = LayerGroups.from_layer_windows(windows)
    assert (g.num_groups, g.layers_per_block, g.num_padding, g.num_layers) == (groups, per_block, padding, len(windows))
    assert g.windows[0] == (F if F in windows else windows[0])  # full groups first
    for layer, window in enumerate(windows):  # every layer in the group of its own window, slots distinct
        assert g.windows[g.layer_group(layer)] == window
    slots = {(g.layer_group(layer), g.layer_slot(layer)) for layer in range(len(windows))}
    assert len(slots) == len(windows) and all(s < per_block for _, s in slots)
    assert g.is_hybrid == (len(set(windows)) > 1)


def test_groups_keep_layer_order_and_split_types_evenly():
    g = LayerGroups.from_layer_windows([S, S, F, S, S, F, 8, 8])  # two windows and full
    assert g.layers_per_block == 2
    assert g.windows == (F, 8, S, S)
    assert g.layers == ((2, 5), (6, 7), (0, 1), (3, 4))


def test_request_blocks_and_saving_match_the_per_layer_analytic_without_padding():
    bs, chunk = 16, 1
    for windows, tokens in ((GEMMA2_9B, 8192), (GPT_OSS_20B, 4096), (COHERE2, 16384)):
        g = LayerGroups.from_layer_windows(windows)
        assert g.saving(tokens, bs, chunk) == pytest.approx(hybrid_pool_saving(windows, tokens, bs))
    g = LayerGroups.from_layer_windows(GEMMA2_9B)
    # 4k prompt + 4k output: the full group holds 512 blocks, the sliding one 4096/16 + 1 = 257
    assert g.request_blocks(8192, bs, chunk) == 512 + 257
    assert g.saving(8192, bs, chunk) == pytest.approx(1 - 769 * 21 / (512 * 42))  # about 25 %
    # shorter than the window: nothing to save; a prefill chunk widens what a sliding group holds
    assert g.saving(2048, bs, chunk) == 0.0
    assert g.request_blocks(8192, bs, 512) == 512 + min(512, -(-(4096 + 511) // 16) + 1)


def test_final_blocks_per_group():
    g = LayerGroups.from_layer_windows(GEMMA2_9B)
    # 8191 positions written (the last token's K/V never is): 512 blocks; the last query (8190) reads
    # 4095..8190, so blocks 0..254 are behind it and the sliding group keeps 257 (one partly outside)
    assert g.final_blocks(8191, 16) == (512, 257)
    assert g.final_blocks(100, 16) == (7, 7)  # shorter than the window: every block
    assert LayerGroups.uniform(2, 8).final_blocks(17, 4) == (3,)  # query 16 reads 9..16: blocks 2..4
    assert LayerGroups.uniform(2).final_blocks(17, 4) == (5,)


def test_padding_costs_gemma3_a_little_of_the_per_layer_saving():
    g = LayerGroups.from_layer_windows(GEMMA3_27B)
    padded, per_layer = g.saving(16384, 16, 1), hybrid_pool_saving(GEMMA3_27B, 16384, 16)
    assert 0 < per_layer - padded < 0.02 and padded > 0.75


def test_uniform_and_invalid_groups():
    assert LayerGroups.uniform(4) == LayerGroups.from_layer_windows([F] * 4)
    assert LayerGroups.uniform(3, 8).windows == (8,)
    with pytest.raises(ValueError, match="every layer in exactly one group"):
        LayerGroups((F, S), ((0, 1), (1, 2)), 2)
    with pytest.raises(ValueError, match="groups of 1..2 layers"):
        LayerGroups((F,), ((0, 1, 2),), 2)
    with pytest.raises(ValueError, match="without attention layers"):
        LayerGroups.from_layer_windows([])
