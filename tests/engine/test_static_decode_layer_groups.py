"""The static decode step (``TGI_PAGED_COMPILE`` on CPU, CUDA graphs on CUDA) over a pool paged by KV layer
group (issue 24): the static buffers hold one slot mapping and one block table per group, each layer reads
its group's, and a sliding group's holes (the scratch block behind its window) stay harmless padding.

A tiny Gemma 3 and a tiny gpt-oss (one sliding layer of window 8 beside a full one) decode far past the
window under preemption through the eager static step, the compiled one (one graph, rows and width
dynamic) and the CUDA-graph plumbing (capture stood in on CPU): token-exact against HF, and the static
step really ran (with holes in the sliding group's table).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, make_text, prompt_ids, router_spec
from tests.helpers.family_models import FAMILIES, write_family_model
from tests.helpers.static_decode_stand_ins import CountingBackend, fake_cuda_graphs
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.memory.types import SCRATCH_BLOCK
from tgi_paged_backend.runner.input_batch import ForwardBatch, RequestChunk, build_forward_batch
from tgi_paged_backend.runner.static.decode_step import StaticDecodeInputs

WINDOW, BLOCK_SIZE, NEW, MAX_SEQ_LEN = 8, 4, 32, 96
BUCKETS = (1, 2, 4)


@pytest.fixture(scope="module", params=["Gemma3", "gpt-oss"])
def hybrid_dir(request, tmp_path_factory):
    family = next(f for f in FAMILIES if f.name == request.param)
    assert family.overrides["sliding_window"] == WINDOW
    return write_family_model(family, tmp_path_factory.mktemp(request.param))


def _record_holes(step) -> list[bool]:
    """Wrap ``step.inputs.fill``: per filled batch, whether the sliding group's table had a hole."""
    holes: list[bool] = []
    fill = step.inputs.fill

    def recording(batch: ForwardBatch, bucket: int, width: int) -> None:
        holes.append(bool((batch.group_block_tables[0][:, 0] == SCRATCH_BLOCK).any()))
        fill(batch, bucket, width)

    step.inputs.fill = recording
    return holes


@pytest.mark.parametrize("mode", ["eager", "compile", "graphs"])
def test_static_decode_over_grouped_pages_is_exact_past_the_window(hybrid_dir, hf_greedy, monkeypatch, mode):
    engine = make_engine(hybrid_dir, num_blocks=31, block_size=BLOCK_SIZE, TGI_PAGED_OVERCOMMIT="8")
    runner = engine.runner
    assert engine.kv.num_groups == 2 and runner.pool_groups.num_groups == 2
    options: dict = {}
    if mode == "compile":
        torch._dynamo.reset()
        backend = CountingBackend()
        options = {"backend": backend, "dynamic_rows": True, "fixed_width": False}
        buckets = tuple(range(2, 9))
    else:
        buckets = BUCKETS
        graphs = fake_cuda_graphs(monkeypatch) if mode == "graphs" else []
    runner.prepare_static_decode(MAX_SEQ_LEN, mode=mode, buckets=buckets, **options)
    step = runner.static_decode
    assert step is not None and step.inputs.num_groups == 2
    holes = _record_holes(step)

    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(40 + rid, 3 + rid), NEW) for rid in (1, 2, 3)]
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), NEW), r.id
    assert engine.stats.preemptions["recompute"] > 0  # 3 x ~11 blocks of full history > 30 blocks
    assert sum(step.counts.values()) > 10 and any(holes)
    if mode == "compile":
        assert len(backend.graphs) == 1
    if mode == "graphs":
        assert len(graphs) == len(BUCKETS) and sum(g.replays for g in graphs) == sum(step.counts.values())
    driver.assert_idle()


def test_fill_pads_every_groups_slots_and_table() -> None:
    inputs = StaticDecodeInputs(max_batch=4, max_blocks=5, device=torch.device("cpu"), num_groups=2)
    chunks = [RequestChunk([10], 9, [5, 6, 7]), RequestChunk([11], 3, [8])]
    base = build_forward_batch(chunks, BLOCK_SIZE)
    sliding = torch.tensor([[SCRATCH_BLOCK, 12, 13], [14, 0, 0]], dtype=torch.int32)
    batch = ForwardBatch(
        **{name: getattr(base, name) for name in ForwardBatch.__slots__ if not name.startswith("group_")},
        group_slot_mappings=(torch.tensor([13 * BLOCK_SIZE + 1, 14 * BLOCK_SIZE + 3]),),
        group_block_tables=(sliding,),
    )
    inputs.fill(batch, bucket=4, width=5)
    views = inputs.views(4, 5)
    group_slots, group_table = views[-2], views[-1]
    assert group_slots.tolist() == [53, 59, 0, 0]  # padding rows write the scratch slot in every group
    assert group_table.tolist() == [[0, 12, 13, 0, 0], [14, 0, 0, 0, 0]] + [[0] * 5] * 2
    assert views[3].tolist()[:2] == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0]]  # group 0's table
    assert not inputs.fits(base)  # a batch without the second group's tables is not this step's
    with pytest.raises(ValueError, match="num_groups"):
        StaticDecodeInputs(max_batch=4, max_blocks=5, device=torch.device("cpu"), num_groups=0)
