"""Next-token choice: penalties, warpers, greedy/sampling, logprobs, top-n, seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from tgi_paged_backend.engine.sampling import (
    choose_next_tokens,
    process_logits,
    sampling_seed,
    validate_sampling_params,
)
from tgi_paged_backend.engine.types import InvalidRequestError
from tgi_paged_backend.engine.types import SamplingParams as SP

NEG = -math.inf


def log_softmax(xs: list[float]) -> list[float]:
    m = max(x for x in xs if x != NEG)
    z = m + math.log(sum(math.exp(x - m) for x in xs if x != NEG))
    return [x - z if x != NEG else NEG for x in xs]


def softmax(xs: list[float]) -> list[float]:
    return [math.exp(v) if v != NEG else 0.0 for v in log_softmax(xs)]


def row(t: torch.Tensor, i: int = 0) -> list[float]:
    return t[i].tolist()


def assert_row(actual: list[float], expected: list[float], tol: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if e == NEG:
            assert a == NEG, (actual, expected)
        else:
            assert a == pytest.approx(e, abs=tol), (actual, expected)


# --------------------------------------------------------------------------------------- greedy / basics


def test_greedy_is_argmax_per_row_and_logprob_is_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 37)
    steps = [0, 3, 7, 1, 100]
    out = choose_next_tokens(logits, [SP(seed=s) for s in range(5)], steps)
    for i, c in enumerate(out):
        assert c.id == int(logits[i].argmax())
        assert c.logprob == pytest.approx(float(torch.log_softmax(logits[i], -1)[c.id]), abs=1e-6)
        assert c.top_ids == [] and c.top_logprobs == []


def test_greedy_ignores_seed_and_step():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.25]])
    ids = {choose_next_tokens(logits, [SP(seed=s)], [st])[0].id for s in range(5) for st in range(5)}
    assert ids == {2}


def test_input_logits_are_not_modified():
    logits = torch.tensor([[1.0, 2.0, -3.0, 0.5], [0.0, 1.0, 2.0, 3.0]])
    before = logits.clone()
    choose_next_tokens(
        logits,
        [SP(repetition_penalty=1.5, temperature=0.5, top_k=2), SP(frequency_penalty=0.7, top_p=0.5, typical_p=0.9)],
        [0, 0],
        [[0, 1], [3, 3]],
        top_n=[2, 2],
    )
    assert torch.equal(logits, before)


def test_bf16_logits_are_processed_in_float32():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    c = choose_next_tokens(logits, [SP()], [0], top_n=[3])[0]
    assert c.id == 2
    assert c.top_logprobs == pytest.approx(log_softmax([3.0, 2.0, 1.0]), abs=1e-6)


# ------------------------------------------------------------------------------------------- penalties


def test_repetition_penalty_hand_computed():
    # negative scores are multiplied, positive divided; duplicates in the history count once
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    out = process_logits(logits, [SP(repetition_penalty=2.0)], [[0, 0, 1, 1, 1, 4]])
    assert_row(row(out), [1.0, -2.0, 0.5, 3.0, -4.0])


def test_repetition_penalty_uses_prompt_and_generated_history_per_request():
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    out = process_logits(logits, [SP(repetition_penalty=4.0), SP()], [[2], [0, 1, 2]])
    assert_row(row(out, 0), [1.0, 1.0, 0.25])
    assert_row(row(out, 1), [1.0, 1.0, 1.0])  # no penalty for the neighbour


def test_frequency_penalty_hand_computed():
    # TGI: score -= penalty * count / len(history)
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    hist = [0, 0, 0, 2]  # len 4
    out = process_logits(logits, [SP(frequency_penalty=0.8)], [hist])
    assert_row(row(out), [1.0 - 0.8 * 3 / 4, 1.0, 1.0 - 0.8 * 1 / 4, 1.0])
    # negative penalty rewards repetition
    out = process_logits(logits, [SP(frequency_penalty=-1.0)], [hist])
    assert_row(row(out), [1.75, 1.0, 1.25, 1.0])


def test_repetition_then_frequency_order():
    logits = torch.tensor([[-1.0, 0.0]])
    out = process_logits(logits, [SP(repetition_penalty=2.0, frequency_penalty=1.0)], [[0]])
    # repetition first: -1*2 = -2, then frequency: -2 - 1*1/1 = -3  (other order would give -4)
    assert_row(row(out), [-3.0, 0.0])


def test_penalties_then_temperature_order():
    logits = torch.tensor([[4.0, 1.0]])
    out = process_logits(logits, [SP(repetition_penalty=2.0, temperature=0.5)], [[0]])
    assert_row(row(out), [4.0, 2.0])  # (4/2)/0.5 and 1/0.5


def test_padded_tensor_histories_match_lists():
    torch.manual_seed(1)
    logits = torch.randn(3, 11)
    hists = [[1, 2, 2, 5], [0], [10, 10, 3]]
    params = [SP(repetition_penalty=1.3, frequency_penalty=0.4), SP(repetition_penalty=0.7), SP(frequency_penalty=-0.5)]
    a = process_logits(logits, params, hists)
    padded = torch.full((3, 4), 7, dtype=torch.int64)  # junk beyond each length must be ignored
    for i, h in enumerate(hists):
        padded[i, : len(h)] = torch.tensor(h)
    b = process_logits(logits, params, padded, history_lens=[len(h) for h in hists])
    c = process_logits(logits, params, [torch.tensor(h) for h in hists])
    assert torch.allclose(a, b) and torch.allclose(a, c)


def test_penalty_without_history_is_an_error():
    with pytest.raises(ValueError):
        process_logits(torch.zeros(1, 3), [SP(repetition_penalty=1.2)], None)


# --------------------------------------------------------------------------------------------- warpers


def test_temperature_hand_computed():
    xs = [1.0, 2.0, 3.0, 0.5]
    out = process_logits(torch.tensor([xs]), [SP(temperature=0.5)])
    assert_row(row(out), [x / 0.5 for x in xs])
    c = choose_next_tokens(torch.tensor([xs]), [SP(temperature=0.5, top_k=1)], [0], top_n=[4])[0]
    assert c.id == 2 and c.logprob == 0.0


def test_top_k_hand_computed_and_keeps_ties():
    xs = [1.0, 2.0, 2.0, 0.0, -1.0]
    out = process_logits(torch.tensor([xs, xs, xs]), [SP(top_k=3), SP(top_k=1), SP(top_k=50)])
    assert_row(row(out, 0), [1.0, 2.0, 2.0, NEG, NEG])
    assert_row(row(out, 1), [NEG, 2.0, 2.0, NEG, NEG])  # tie with the k-th score is kept
    assert_row(row(out, 2), xs)  # k > vocab: nothing removed


def test_top_p_hand_computed():
    xs = [1.0, 2.0, 3.0, 0.5]
    p = softmax(xs)  # ~ [.085, .232, .630, .052]
    assert p[2] < 0.7 < p[2] + p[1]
    out = process_logits(torch.tensor([xs, xs, xs]), [SP(top_p=0.5), SP(top_p=0.7), SP(top_p=0.95)])
    assert_row(row(out, 0), [NEG, NEG, 3.0, NEG])
    assert_row(row(out, 1), [NEG, 2.0, 3.0, NEG])
    # ascending cumsum: .052, .137, .368, 1 -> only entries with cum <= 0.05 go: none
    assert_row(row(out, 2), xs)
    out = process_logits(torch.tensor([xs]), [SP(top_p=0.9)])
    assert_row(row(out), [1.0, 2.0, 3.0, NEG])  # .052 <= .1 removed, .137 > .1 kept


def test_top_p_boundary_is_inclusive():
    # uniform over 4: ascending cum = .25, .5, .75, 1 (exact in float32); removed where cum <= 1 - top_p
    out = process_logits(torch.zeros(3, 4), [SP(top_p=0.5), SP(top_p=0.75), SP(top_p=0.25)])
    assert [int(torch.isfinite(out[i]).sum()) for i in range(3)] == [2, 3, 1]


def test_typical_p_hand_computed():
    xs = [1.0, 2.0, 3.0, 0.5]
    lp = log_softmax(xs)
    ent = -sum(math.exp(v) * v for v in lp)
    shifted = [abs(-v - ent) for v in lp]
    order = sorted(range(4), key=lambda i: shifted[i])
    assert order[:2] == [1, 2]  # token 1 is the most "typical", then the argmax
    out = process_logits(torch.tensor([xs, xs, xs]), [SP(typical_p=0.2), SP(typical_p=0.5), SP(typical_p=0.99)])
    # cum probs in typical order: .232 (tok 1), .862 (tok 2), ...
    assert_row(row(out, 0), [NEG, 2.0, NEG, NEG])  # the argmax itself is filtered
    assert_row(row(out, 1), [NEG, 2.0, 3.0, NEG])
    assert_row(row(out, 2), xs)


def test_warpers_only_touch_their_rows():
    xs = [1.0, 2.0, 3.0, 0.5]
    out = process_logits(torch.tensor([xs] * 4), [SP(), SP(top_k=1), SP(top_p=0.5), SP(typical_p=0.2)])
    assert_row(row(out, 0), xs)


def test_warper_chain_order_temperature_topk_topp():
    xs = [1.0, 2.0, 3.0, 0.5]
    # temperature 2 flattens: softmax([.5,1,1.5,.25]) ~ [.19,.31,.52,.15]; top_k=3 drops token 3;
    # top_p=0.6 then removes tokens whose ascending cum prob over the 3 kept is <= .4
    t = [x / 2.0 for x in xs]
    kept = [t[0], t[1], t[2], NEG]
    probs = softmax(kept)
    asc = sorted(range(3), key=lambda i: probs[i])
    cum, remove = 0.0, set()
    for i in asc[:-1]:
        cum += probs[i]
        if cum <= 0.4:
            remove.add(i)
    expected = [NEG if (i in remove or i == 3) else t[i] for i in range(4)]
    out = process_logits(torch.tensor([xs]), [SP(temperature=2.0, top_k=3, top_p=0.6)])
    assert_row(row(out), expected)


# ------------------------------------------------------------------------------------- logprobs, top-n


def test_logprobs_and_top_n_are_of_the_processed_distribution():
    xs = [1.0, 2.0, 3.0, 0.5, -1.0]
    c = choose_next_tokens(torch.tensor([xs]), [SP(temperature=0.5, top_k=3, seed=3)], [0], top_n=[5])[0]
    expected = log_softmax([x / 0.5 for x in xs[:3]] + [NEG, NEG])
    assert c.top_ids == [2, 1, 0]  # -inf entries excluded even though n=5
    assert c.top_logprobs == pytest.approx([expected[2], expected[1], expected[0]], abs=1e-5)
    assert c.id in (0, 1, 2)
    assert c.logprob == pytest.approx(expected[c.id], abs=1e-5)


def test_top_n_ordering_exact_n_and_per_request():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    out = choose_next_tokens(logits, [SP(), SP(), SP()], [0, 0, 0], top_n=[0, 5, 100])
    assert out[0].top_ids == []
    lp = torch.log_softmax(logits, -1)
    assert out[1].top_ids == torch.topk(lp[1], 5).indices.tolist()
    assert out[1].top_logprobs == sorted(out[1].top_logprobs, reverse=True)
    assert len(out[2].top_ids) == 50  # clamped to the vocab
    assert out[2].top_logprobs == sorted(out[2].top_logprobs, reverse=True)


def test_top_n_with_ties_returns_exactly_n():
    logits = torch.zeros(1, 10)
    c = choose_next_tokens(logits, [SP()], [0], top_n=[3])[0]
    assert len(c.top_ids) == 3 and len(set(c.top_ids)) == 3
    assert c.top_logprobs == pytest.approx([-math.log(10)] * 3)


def test_chosen_logprob_is_finite_with_infinite_logits():
    logits = torch.tensor([[NEG, 1.0, NEG], [NEG, NEG, NEG]])
    out = choose_next_tokens(logits, [SP(), SP(do_sample=True)], [0, 0], top_n=[3, 3])
    assert out[0].id == 1 and out[0].logprob == 0.0 and out[0].top_ids == [1]
    for c in out:
        assert math.isfinite(c.logprob)
        assert all(math.isfinite(v) for v in c.top_logprobs)


# -------------------------------------------------------------------------------------------- sampling


def _draws(logits_row: torch.Tensor, params: SP, steps: range) -> list[int]:
    return [choose_next_tokens(logits_row[None], [params], [s])[0].id for s in steps]


def test_seeded_sampling_reproducible_across_runs():
    logits = torch.zeros(1, 1000)
    a = _draws(logits[0], SP(do_sample=True, seed=1234), range(40))
    b = _draws(logits[0], SP(do_sample=True, seed=1234), range(40))
    assert a == b
    assert len(set(a)) > 30  # it really is random over steps


def test_seeded_sampling_independent_of_batch_composition_and_position():
    torch.manual_seed(3)
    vocab = 257
    target_logits = torch.randn(vocab)
    target = SP(do_sample=True, seed=987654321, temperature=0.9)
    hist = [5, 6, 7]
    alone = []
    for step in range(25):
        alone.append(choose_next_tokens(target_logits[None], [target], [step], [hist], top_n=[2])[0])
    neighbours = [
        SP(),
        SP(do_sample=True, seed=1),
        SP(top_k=3, seed=2, repetition_penalty=1.2),
        SP(do_sample=True, seed=987654321),
    ]  # same seed, different params
    for pos in range(4):
        batched = []
        for step in range(25):
            rows = [torch.randn(vocab) for _ in neighbours]
            rows.insert(pos, target_logits)
            params = list(neighbours)
            params.insert(pos, target)
            steps = [step * 3 + k for k in range(4)]
            steps.insert(pos, step)
            hists = [[1, 2]] * 4
            hists.insert(pos, hist)
            out = choose_next_tokens(torch.stack(rows), params, steps, hists, top_n=[0, 1, 2, 3, 4])
            batched.append(out[pos])
        assert [c.id for c in batched] == [c.id for c in alone]
        assert [c.logprob for c in batched] == pytest.approx([c.logprob for c in alone], abs=1e-6)


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    a = _draws(logits[0], SP(do_sample=True, seed=1), range(20))
    b = _draws(logits[0], SP(do_sample=True, seed=2), range(20))
    assert a != b


def test_full_u64_seeds():
    logits = torch.zeros(1, 1000)
    top = 2**64 - 1
    a = _draws(logits[0], SP(do_sample=True, seed=top), range(20))
    assert a == _draws(logits[0], SP(do_sample=True, seed=top), range(20))
    assert a != _draws(logits[0], SP(do_sample=True, seed=top - 1), range(20))
    # high bits matter (no silent 32-bit reduction)
    assert a != _draws(logits[0], SP(do_sample=True, seed=top & 0xFFFFFFFF), range(20))
    for s in (0, 1, 2**32, 2**63, top):
        assert 0 <= sampling_seed(s, 0) <= top
    assert sampling_seed(top, 1) != sampling_seed(top, 2)


def test_sampling_follows_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(p) for p in probs]] * 4000)
    params = [SP(do_sample=True, seed=s) for s in range(4000)]
    out = choose_next_tokens(logits, params, [7] * 4000)
    counts = [0] * 4
    for c in out:
        counts[c.id] += 1
    for n, p in zip(counts, probs):
        sd = math.sqrt(4000 * p * (1 - p))
        assert abs(n - 4000 * p) < 5 * sd, counts


def test_sampling_never_picks_filtered_tokens():
    torch.manual_seed(4)
    logits = torch.randn(1, 100)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    ids = _draws(logits[0], SP(top_k=3, seed=9), range(200))
    assert set(ids) <= allowed and len(set(ids)) > 1


def test_is_sampling_rule():
    logits = torch.zeros(1, 500)
    # do_sample=False but temperature != 1 -> samples (TGI rule)
    warm = _draws(logits[0], SP(temperature=0.7, seed=5), range(20))
    assert len(set(warm)) > 1
    # plain defaults -> greedy regardless of seed/step
    assert set(_draws(logits[0], SP(seed=5), range(20))) == {0}


def test_watermark_flag_is_accepted_and_ignored():
    torch.manual_seed(5)
    logits = torch.randn(2, 64)
    a = choose_next_tokens(logits, [SP(watermark=True), SP(watermark=True, do_sample=True, seed=3)], [0, 4])
    b = choose_next_tokens(logits, [SP(), SP(do_sample=True, seed=3)], [0, 4])
    assert [c.id for c in a] == [c.id for c in b]


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "bad",
    [
        SP(temperature=0.0),
        SP(temperature=-1.0),
        SP(top_k=-1),
        SP(top_p=0.0),
        SP(top_p=1.5),
        SP(typical_p=0.0),
        SP(repetition_penalty=0.0),
        SP(frequency_penalty=math.nan),
        SP(seed=2**64),
    ],
)
def test_validate_rejects(bad):
    with pytest.raises(InvalidRequestError):
        validate_sampling_params(bad)


def test_validate_accepts_router_defaults_and_u64_seed():
    validate_sampling_params(SP())
    validate_sampling_params(
        SP(
            seed=2**64 - 1,
            temperature=0.1,
            top_k=5,
            top_p=0.9,
            typical_p=0.5,
            repetition_penalty=1.2,
            frequency_penalty=-2.0,
            do_sample=True,
        )
    )
