"""Greedy ids come from block maxima and ``max(dim)`` (a fifth of ``argmax``'s time on CPU): the same ids as
``argmax`` on every row (ties, NaN, infinities, strided rows) and log-probabilities equal to ``log_softmax``'s
at the argmax; requests with penalties, warpers, sampling or alternatives still go through the full processing."""

from __future__ import annotations

import math

import pytest
import torch

from tgi_paged_backend.engine import sampling
from tgi_paged_backend.engine.sampling import choose_next_tokens
from tgi_paged_backend.engine.types import SamplingParams

FMIN = torch.finfo(torch.float32).min


def edge_rows(generator: torch.Generator) -> torch.Tensor:
    """Random rows with ties at the maximum, NaN, +inf and an all -inf row."""
    logits = torch.randn(7, 5000, generator=generator) * 4
    logits[1] = torch.randint(-3, 4, (5000,), generator=generator).float()  # many ties at the maximum
    logits[2, [10, 4000]] = float("nan")
    logits[3] = float("-inf")
    logits[4, [77, 90]] = float("inf")
    logits[5, 100:] = float("-inf")
    logits[6, [5, 2500]] = logits[6].max() + 1.0  # a two-way tie of the maximum
    return logits


@pytest.mark.parametrize("threads", [1, 2])
def test_first_maximum_is_argmax(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(threads)
        logits = edge_rows(generator)
        assert torch.equal(sampling._first_maximum(logits), logits.argmax(dim=-1))
        strided = torch.randn(3000, 9, generator=generator).t()  # non-contiguous rows
        assert torch.equal(sampling._first_maximum(strided), strided.argmax(dim=-1))
        ties = torch.zeros(4, 49152)
        assert sampling._first_maximum(ties).tolist() == [0, 0, 0, 0]
        tail = torch.randn(3, 49000, generator=generator)  # a short last block
        tail[0, -1] = tail[1, -5] = 100.0
        tail[2, [48999, 48990]] = float("nan")
        assert sampling._first_maximum(tail).tolist() == [48999, 48995, 48990]
    finally:
        torch.set_num_threads(before)


def test_first_maximum_is_argmax_on_random_shapes_and_ties() -> None:
    generator = torch.Generator().manual_seed(3)
    for trial in range(60):
        rows = int(torch.randint(1, 9, (), generator=generator))
        vocab = int(torch.randint(1, 9000, (), generator=generator))
        if trial % 2:
            logits = torch.randint(-2, 3, (rows, vocab), generator=generator).float()  # ties across blocks
        else:
            logits = torch.randn(rows, vocab, generator=generator)
        if trial % 5 == 0:
            logits[0, torch.randint(0, vocab, (2,), generator=generator)] = float("nan")
        if trial % 7 == 0:
            logits[-1] = float("-inf")
        if trial % 11 == 0:
            logits[0, torch.randint(0, vocab, (2,), generator=generator)] = float("inf")
        assert torch.equal(sampling._first_maximum(logits), logits.argmax(dim=-1)), (trial, rows, vocab)


def test_greedy_logprobs_equal_log_softmax_at_the_argmax() -> None:
    logits = edge_rows(torch.Generator().manual_seed(0))
    out = choose_next_tokens(logits, [SamplingParams() for _ in range(7)], [0] * 7)
    ids = logits.argmax(dim=-1)
    expected = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).squeeze(1).tolist()
    assert [c.id for c in out] == ids.tolist()
    for c, want in zip(out, expected):
        assert math.isfinite(c.logprob) and c.top_ids == [] and c.top_logprobs == []
        assert c.logprob == (want if math.isfinite(want) else FMIN)  # bit-equal; NaN / -inf: float32 min
    assert out[3].logprob == FMIN and out[2].id == 10  # all -inf; the first NaN wins, as in argmax


def test_a_vocabulary_sized_batch_matches_to_1e6() -> None:
    logits = torch.randn(21, 49152, generator=torch.Generator().manual_seed(1)) * 3
    out = choose_next_tokens(logits, [SamplingParams() for _ in range(21)], [0] * 21)
    reference = torch.log_softmax(logits.double(), dim=-1)
    ids = logits.argmax(dim=-1)
    assert [c.id for c in out] == ids.tolist()
    for c, row, i in zip(out, reference, ids.tolist()):
        assert abs(c.logprob - float(row[i])) < 1e-5 * max(1.0, abs(float(row[i])))


def test_penalties_warpers_sampling_and_alternatives_still_get_the_full_processing() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=generator) * 3
    top = int(logits[0].argmax())
    params = [
        SamplingParams(repetition_penalty=50.0),
        SamplingParams(temperature=0.5),
        SamplingParams(do_sample=True, seed=3),
        SamplingParams(),
    ]
    histories = [[top], [], [], []]
    out = choose_next_tokens(logits, params, [0] * 4, histories, top_n=[0, 0, 0, 3])
    scores = sampling.process_logits(logits, params, histories)
    assert out[0].id != top  # the penalty moved the choice off the raw argmax
    assert out[0].id == int(scores[0].argmax())
    for i in (0, 1, 3):  # logprobs of the processed scores, not of the raw logits
        want = float(torch.log_softmax(scores[i], dim=-1)[out[i].id])
        assert out[i].logprob == pytest.approx(want, abs=1e-6)
    assert out[1].logprob != pytest.approx(float(torch.log_softmax(logits[1], dim=-1)[out[1].id]), abs=1e-3)
    assert len(out[3].top_ids) == 3 and out[3].top_ids[0] == out[3].id
    assert out[2].logprob == pytest.approx(float(torch.log_softmax(logits[2], dim=-1)[out[2].id]), abs=1e-6)


def test_the_runners_greedy_pass_chooses_an_all_greedy_batch() -> None:
    """The runner's native pass (``greedy=``) serves a batch whose rows are all greedy without alternatives: the
    same ids as argmax, log_softmax's value within fp32 summation error, NaN and -inf rows made float32 min."""
    from tgi_paged_backend.runner.model_runner import ModelRunner

    logits = edge_rows(torch.Generator().manual_seed(4))
    calls: list[torch.Tensor] = []

    def greedy(scores: torch.Tensor):
        calls.append(scores)
        return ModelRunner.greedy_pick(scores)

    out = choose_next_tokens(logits, [SamplingParams() for _ in range(7)], [0] * 7, greedy=greedy)
    if ModelRunner.greedy_pick(logits) is None:
        pytest.skip("no native kernels here")
    assert len(calls) == 1
    torch_path = choose_next_tokens(logits, [SamplingParams() for _ in range(7)], [0] * 7)
    assert [c.id for c in out] == [c.id for c in torch_path]
    for mine, theirs in zip(out, torch_path):
        assert mine.logprob == pytest.approx(theirs.logprob, rel=1e-5, abs=1e-5)
        assert mine.top_ids == [] and mine.top_logprobs == []
    assert out[3].logprob == FMIN and out[2].id == 10


def test_a_batch_of_sampling_rows_only_skips_the_greedy_pass() -> None:
    def greedy(scores: torch.Tensor):
        raise AssertionError("the greedy pass must not run for this batch")

    params = [SamplingParams(do_sample=True, seed=1), SamplingParams(do_sample=True, seed=2)]
    assert len(choose_next_tokens(torch.randn(2, 300), params, [0, 0], greedy=greedy)) == 2


def test_a_greedy_rows_logprob_does_not_depend_on_its_batch() -> None:
    """With the runner's pass, a greedy row gets the same id and log-probability whether its batch is all greedy or
    holds a sampling row and a row asking for alternatives."""
    from tgi_paged_backend.runner.model_runner import ModelRunner

    logits = torch.randn(3, 4000, generator=torch.Generator().manual_seed(6)) * 4
    if ModelRunner.greedy_pick(logits) is None:
        pytest.skip("no native kernels here")
    greedy = ModelRunner.greedy_pick
    alone = choose_next_tokens(logits[:1], [SamplingParams()], [0], greedy=greedy)
    mixed = choose_next_tokens(
        logits, [SamplingParams(), SamplingParams(do_sample=True, seed=4), SamplingParams()], [0, 0, 0],
        top_n=[0, 0, 2], greedy=greedy,
    )  # fmt: skip
    assert (mixed[0].id, mixed[0].logprob) == (alone[0].id, alone[0].logprob)
    assert mixed[2].id == int(logits[2].argmax()) and mixed[2].top_ids[0] == mixed[2].id
    assert mixed[2].logprob == pytest.approx(mixed[2].top_logprobs[0], rel=1e-5, abs=1e-5)
