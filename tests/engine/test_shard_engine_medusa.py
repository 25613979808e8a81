"""Medusa heads propose the drafts when ``--model-id`` is a Medusa checkpoint, as stock TGI serves it.

Tiny random heads are written here in the on-disk layout stock reads (``config.json`` with
``medusa_num_heads`` / ``medusa_num_layers`` / ``base_model_name_or_path``, ``medusa_lm_head.safetensors``
with ``{i}.{j}.linear.*`` and ``{i}.{L}.weight``; without the latter the base ``lm_head`` projects). The
reference applies the same heads by hand to HF's last hidden states and replays the verification:
proposal from the hidden state of the last emitted token, accepted while it equals HF's greedy
continuation. The shard must emit exactly HF's tokens, and exactly as many per step as that replay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.engine.conftest import RouterDriver, make_engine, make_text, prompt_ids, spec
from tests.helpers.medusa_heads import NUM_HEADS, write_medusa
from tests.helpers.tiny_models import load_reference
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.model_files import with_local_model
from tgi_paged_backend.runner.model.loader import ModelLoadError


def hand_proposals(base: Path, tensors: dict, ids: list[int], k: int) -> list[list[int]]:
    """Entry ``p``: the first ``k`` heads' argmax, applied by hand to HF's final hidden state at position ``p``."""
    model = load_reference(base)
    hidden = {}
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _m, args: hidden.setdefault("h", args[0]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    hook.remove()
    h = hidden["h"][0]
    guesses = []
    for i in range(k):
        x = h + F.silu(h @ tensors[f"{i}.0.linear.weight"].T + tensors[f"{i}.0.linear.bias"])
        out = tensors.get(f"{i}.1.weight", head.weight)
        guesses.append((x @ out.T).argmax(-1))
    return torch.stack(guesses, dim=1).tolist()


def replay(prompt_len: int, output: list[int], proposals: list[list[int]], k: int) -> list[int]:
    """Tokens per Generation that verification of those proposals yields (prefill emits one)."""
    sizes, n = [1], 1
    while n < len(output):
        room = len(output) - n - 1  # a draft never runs past max_new_tokens
        draft = proposals[prompt_len + n - 2][: min(k, room)]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[n + accepted]:
            accepted += 1
        sizes.append(accepted + 1)
        n += accepted + 1
    return sizes


@pytest.mark.parametrize("own_out, speculate", [(True, None), (False, 2), (False, 4)])
def test_medusa_drafts_follow_hand_applied_heads(tiny_llama_dir, hf_greedy, tmp_path, own_out, speculate):
    # Small residual weights keep the heads near "repeat the last token" (lm_head) or near their own random
    # projection; the tiny model's repetitive greedy text then accepts some drafts and rejects others.
    tensors = write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=own_out, scale=0.05)
    k = NUM_HEADS if speculate is None else speculate
    requests = [spec(rid, make_text(70 + rid, words), 14) for rid, words in ((1, 4), (2, 9), (3, 6))]
    engine = make_engine(tmp_path / "medusa", speculate=speculate, num_blocks=48)
    assert engine.info().speculate == k and engine.runner.medusa is not None
    driver = RouterDriver(engine, check_preempted=False)
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    driver.assert_idle()
    expected_drafted = 0
    for r in requests:
        ids = prompt_ids(engine, r.text)
        output = hf_greedy(tiny_llama_dir, ids, r.stopping.max_new_tokens)
        assert driver.tokens[r.id] == output, f"request {r.id} differs from HF"
        proposals = hand_proposals(tiny_llama_dir, tensors, ids + output, k)
        sizes = replay(len(ids), output, proposals, k)
        assert [len(g.tokens.ids) for g in driver.generations[r.id]] == sizes, f"request {r.id}: other drafts"
        expected_drafted += sum(min(k, len(output) - n - 1) for n in _emitted_before(sizes)[1:])
    assert engine.stats.draft_tokens == expected_drafted


def _emitted_before(sizes: list[int]) -> list[int]:
    out, n = [], 0
    for s in sizes:
        out.append(n)
        n += s
    return out


def test_zero_residual_heads_accept_runs(tiny_llama_dir, hf_greedy, tmp_path):
    """Heads with zero weights propose the last token again (base ``lm_head`` on the same hidden state):
    on repetitive greedy text whole runs are accepted, so the shard takes fewer steps than tokens."""
    tensors = write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=False, scale=0.0)
    for name in tensors:
        tensors[name].zero_()
    save_file(tensors, str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))
    engine = make_engine(tmp_path / "medusa", speculate=3, num_blocks=48)
    request = spec(1, make_text(5, 3), 24)
    driver = RouterDriver(engine, check_preempted=False)
    driver.run(BatchSpec(id=0, requests=(request,)))
    ids = prompt_ids(engine, request.text)
    output = hf_greedy(tiny_llama_dir, ids, 24)
    assert driver.tokens[1] == output
    proposals = hand_proposals(tiny_llama_dir, tensors, ids + output, 3)
    sizes = replay(len(ids), output, proposals, 3)
    assert [len(g.tokens.ids) for g in driver.generations[1]] == sizes
    if max(sizes) == 1:
        pytest.skip("the tiny model's greedy text does not repeat a token here")
    assert engine.stats.accepted_tokens > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_exact_under_preemption(tiny_llama_dir, hf_greedy, tmp_path, preemption):
    """A pool too small for the batch: requests are preempted with a proposal pending and resume drafting
    from it; the tokens stay HF's."""
    write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=False, scale=0.0)
    requests = [spec(rid, make_text(40 + rid, words), 12) for rid, words in ((1, 5), (2, 8), (3, 4), (4, 7))]
    engine = make_engine(tmp_path / "medusa", speculate=3, num_blocks=12, block_size=4, preemption=preemption)
    driver = RouterDriver(engine, check_preempted=False)
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    driver.assert_idle()
    assert engine.stats.preemptions[preemption] > 0, "nothing was preempted: the check would prove nothing"
    # Under this pressure drafts are verified and mostly rejected (a resumed request emits its recomputed
    # token first); acceptance under preemption is covered with oracle drafts in
    # test_shard_engine_speculation.py, the proposer is what differs here.
    assert engine.stats.draft_tokens > 0
    for r in requests:
        ids = prompt_ids(engine, r.text)
        assert driver.tokens[r.id] == hf_greedy(tiny_llama_dir, ids, 12), f"request {r.id} differs from HF"


def test_speculate_zero_loads_no_heads(tiny_llama_dir, tmp_path):
    write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=True)
    engine = make_engine(tmp_path / "medusa", speculate=0)
    assert engine.info().speculate == 0 and engine.runner.medusa is None


def _resolve(model_id: Path, speculate=None):
    return with_local_model(build_config({"model_id": str(model_id), "speculate": speculate}, {})).model


def test_checkpoint_resolves_to_its_base_model(tiny_llama_dir, tmp_path):
    write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=True)
    model = _resolve(tmp_path / "medusa")
    assert (model.model_id, model.medusa_dir, model.speculate) == (
        str(tiny_llama_dir),
        str(tmp_path / "medusa"),
        NUM_HEADS,
    )
    assert _resolve(tmp_path / "medusa", 2).speculate == 2
    assert _resolve(tiny_llama_dir).medusa_dir is None


def test_bad_checkpoints_are_refused_with_the_reason(tiny_llama_dir, tmp_path):
    write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=True)
    with pytest.raises(ConfigError, match=f"--speculate=5 is invalid.*{NUM_HEADS} heads"):
        _resolve(tmp_path / "medusa", 5)

    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    (tmp_path / "medusa" / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": "no/such"}))
    with pytest.raises(ConfigError, match="base model 'no/such', which is not on local disk"):
        _resolve(tmp_path / "medusa")

    (tmp_path / "medusa" / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no medusa_lm_head.safetensors"):
        _resolve(tmp_path / "medusa")


def test_heads_of_another_model_are_refused(tiny_llama_dir, tmp_path):
    tensors = write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=True)
    tensors["1.0.linear.weight"] = tensors["1.0.linear.weight"][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))
    with pytest.raises(ModelLoadError, match="'1.0.linear.weight' has shape"):
        make_engine(tmp_path / "medusa", speculate=None)


@pytest.mark.parametrize("own_out", [True, False])
def test_heads_module_matches_hand_application(tiny_llama_dir, tmp_path, own_out):
    """``MedusaHeads.propose`` reads the rows ``lm_head`` last projected and applies each head as stock does."""
    from tgi_paged_backend.runner.model.medusa import load_medusa_heads, read_medusa_config

    tensors = write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=own_out, scale=2.0)
    config = read_medusa_config(tmp_path / "medusa")
    hidden, vocab = tensors["0.0.linear.weight"].shape[0], 300
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    if own_out:
        vocab = tensors["0.1.weight"].shape[0]
        lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    heads = load_medusa_heads(
        tmp_path / "medusa", config, 3, lm_head, hidden_size=hidden, vocab_size=vocab,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    h = torch.randn(1, 5, hidden)
    with torch.no_grad():
        lm_head(h)
    expected = []
    for row in (4, 0, 2):
        guesses = []
        for i in range(3):
            x = h[0, row] + F.silu(tensors[f"{i}.0.linear.weight"] @ h[0, row] + tensors[f"{i}.0.linear.bias"])
            out = tensors[f"{i}.1.weight"] if own_out else lm_head.weight
            guesses.append(int((out @ x).argmax()))
        expected.append(guesses)
    assert heads.propose([4, 0, 2], 3) == expected
    assert heads.propose([1], 2)[0] == heads.propose([1], 3)[0][:2]


def test_no_proposals_for_a_batch_that_will_not_draft(tiny_llama_dir, hf_greedy, tmp_path, monkeypatch):
    """CPU default (``TGI_PAGED_SPECULATE_MAX_BATCH`` unset: drafts only alone): while two requests decode
    the heads are not run; once one is left, they propose again. Tokens stay HF's."""
    write_medusa(tmp_path / "medusa", tiny_llama_dir, own_out=False, scale=0.0)
    engine = make_engine(tmp_path / "medusa", speculate=3, TGI_PAGED_SPECULATE_MAX_BATCH="")
    sizes: list[int] = []
    propose = engine.runner.propose_medusa
    monkeypatch.setattr(engine.runner, "propose_medusa", lambda rows, k: sizes.append(len(rows)) or propose(rows, k))
    requests = [spec(1, make_text(5, 3), 4), spec(2, make_text(6, 3), 16)]
    driver = RouterDriver(engine, check_preempted=False)
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    assert sizes and set(sizes) == {1}, sizes  # never computed for both
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(tiny_llama_dir, prompt_ids(engine, r.text), r.stopping.max_new_tokens)
