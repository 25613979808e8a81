"""ModelSpec derivation from HF configs and ForwardBatch packing (no model weights needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.tiny_models import tiny_config
from tgi_paged_backend.runner.input_batch import ForwardBatch, RequestChunk, build_forward_batch, layout_tokens
from tgi_paged_backend.runner.model.spec import ModelSpec, resolve_kv_dtype


# ----------------------------------------------------------------------------- ModelSpec
@pytest.mark.parametrize("kind, window", [("llama", None), ("qwen2", None), ("mistral", 24)])
def test_spec_from_tiny_configs(kind: str, window: int | None) -> None:
    spec = ModelSpec.from_hf_config(tiny_config(kind), torch.float32)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size) == (4, 2, 16, 64)
    assert spec.vocab_size == spec.vocab == 512 and spec.hidden == 64
    assert spec.sliding_window == window
    assert spec.softcap == 0.0 and spec.model_type == kind


def test_spec_ignores_declared_but_unused_sliding_window() -> None:
    config = transformers.Qwen2Config(sliding_window=128, use_sliding_window=False)
    assert ModelSpec.from_hf_config(config, torch.float16).sliding_window is None
    no_window = transformers.MistralConfig(sliding_window=None)
    assert ModelSpec.from_hf_config(no_window, torch.float16).sliding_window is None


def test_spec_head_dim_and_softcap_when_explicit() -> None:
    config = transformers.Gemma2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        attn_logit_softcapping=50.0,
        sliding_window=16,
        num_hidden_layers=2,
    )
    spec = ModelSpec.from_hf_config(config, torch.bfloat16)
    assert spec.head_dim == 32 and spec.softcap == 50.0 and spec.sliding_window == 16


def test_kv_bytes_per_block() -> None:
    spec = ModelSpec.from_hf_config(tiny_config("llama"), torch.float16)  # 3 layers, 2 KV heads x 16
    assert spec.kv_bytes_per_block(16) == 2 * 3 * 16 * 2 * 16 * 2
    assert spec.kv_bytes_per_block(16, torch.float32) == 2 * spec.kv_bytes_per_block(16)
    assert spec.kv_bytes_per_block(8, torch.float8_e4m3fn) == spec.kv_bytes_per_block(16) // 4


def test_resolve_kv_dtype() -> None:
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3fn", torch.float16) is torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_dtype("int4", torch.float16)


# --------------------------------------------------------------------------- ForwardBatch
def test_build_forward_batch_packs_chunks() -> None:
    chunks = [
        RequestChunk([10, 11, 12], num_computed=0, block_table=[7, 3]),  # prompt of 3
        RequestChunk([20], num_computed=5, block_table=[2, 9]),  # decode at position 5
        RequestChunk([30, 31], num_computed=3, block_table=[4, 1], all_logits=True),  # second chunk
    ]
    batch = build_forward_batch(chunks, block_size=4)
    assert batch.input_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert batch.positions.tolist() == [0, 1, 2, 5, 3, 4]
    assert batch.slot_mapping.tolist() == [28, 29, 30, 9 * 4 + 1, 4 * 4 + 3, 1 * 4 + 0]
    assert batch.block_tables.tolist() == [[7, 3], [2, 9], [4, 1]]
    assert batch.query_start_loc.tolist() == [0, 3, 4, 6]
    assert batch.seq_lens.tolist() == [3, 6, 5]
    assert batch.logits_indices.tolist() == [2, 3, 4, 5]
    assert not batch.is_decode
    assert (batch.num_tokens, batch.num_requests) == (6, 3)
    assert batch.block_tables.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64


def test_build_forward_batch_decode_and_padding() -> None:
    batch = build_forward_batch([RequestChunk([1], 8, [5, 6, 0]), RequestChunk([2], 0, [3])], block_size=8)
    assert batch.is_decode
    assert batch.block_tables.tolist() == [[5, 6, 0], [3, 0, 0]]
    assert batch.slot_mapping.tolist() == [6 * 8, 3 * 8]


def test_build_forward_batch_rejects_short_block_table() -> None:
    with pytest.raises(ValueError, match="block table has 1 blocks, 2 needed"):
        build_forward_batch([RequestChunk([1, 2, 3], 14, [0])], block_size=16)


def test_from_numpy_validates_shapes() -> None:
    good = dict(
        input_ids=np.arange(3),
        positions=np.arange(3),
        slot_mapping=np.arange(3),
        block_tables=np.zeros((1, 1)),
        query_start_loc=[0, 3],
        seq_lens=[3],
        logits_indices=[2],
    )
    assert ForwardBatch.from_numpy(**good).num_tokens == 3
    with pytest.raises(ValueError, match="positions"):
        ForwardBatch.from_numpy(**{**good, "positions": np.arange(2)})
    with pytest.raises(ValueError, match="is_decode"):
        ForwardBatch.from_numpy(**good, is_decode=True)


def test_to_same_device_is_identity() -> None:
    batch = build_forward_batch([RequestChunk([1, 2], 0, [0])], block_size=8)
    assert batch.to("cpu") is batch


def _layout_by_loops(computed: list[int], lens: list[int], every: list[bool]) -> dict[str, list[int]]:
    """The packed layout worked out request by request (the reference for layout_tokens)."""
    positions, qsl, logits, starts, offset = [], [0], [], [], 0
    for c, n, all_rows in zip(computed, lens, every):
        positions += list(range(c, c + n))
        starts.append(len(logits))
        logits += list(range(offset, offset + n)) if all_rows else [offset + n - 1]
        offset += n
        qsl.append(offset)
    return {"positions": positions, "query_start_loc": qsl, "logits_indices": logits, "logits_start": starts}


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.booleans()), min_size=1, max_size=8),
)
def test_layout_tokens_equals_the_request_by_request_layout(requests: list[tuple[int, int, bool]]) -> None:
    computed, lens, every = (list(x) for x in zip(*requests))
    layout = layout_tokens(computed, lens, every)
    expected = _layout_by_loops(computed, lens, every)
    for name, values in expected.items():
        assert getattr(layout, name).tolist() == values, name
    assert layout.seq_lens.tolist() == [c + n for c, n in zip(computed, lens)]
    assert layout.logits_count.tolist() == [n if e else 1 for n, e in zip(lens, every)]
    assert layout.is_decode == all(n == 1 for n in lens)


def test_layout_tokens_refuses_empty_steps_and_chunks() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        layout_tokens([], [])
    with pytest.raises(ValueError, match="at least one token"):
        layout_tokens([3, 4], [1, 0])
