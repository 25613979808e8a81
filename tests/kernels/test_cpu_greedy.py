"""The native greedy choice (``csrc/cpu_greedy.cpp``, :func:`tgi_paged_kernels.cpu_greedy.greedy_pick`) against its
torch reference: the same ids as ``argmax`` on every row (ties, NaN, infinities, short rows, strided rows, one or
two threads, the AVX-512, AVX2 and scalar builds) and ``log_softmax``'s value there within fp32 summation error
(1e-5)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from tgi_paged_kernels.cpu_greedy import greedy_pick, greedy_pick_ref
from tgi_paged_kernels.cpu_native import CSRC, FLAGS


def edge_rows(generator: torch.Generator, vocab: int = 5000) -> torch.Tensor:
    """Random rows with ties at the maximum, NaN, +inf, an all -inf row and a row of NaN only."""
    logits = torch.randn(9, vocab, generator=generator) * 4
    logits[1] = torch.randint(-3, 4, (vocab,), generator=generator).float()  # many ties at the maximum
    logits[2, [10, vocab - 1]] = float("nan")
    logits[3] = float("-inf")
    logits[4, [77, 90]] = float("inf")
    logits[5, 100:] = float("-inf")
    logits[6, [5, vocab // 2]] = logits[6].max() + 1.0  # a two-way tie of the maximum
    logits[7] = float("nan")
    logits[8, -1] = 1e4  # the maximum in the last value (the scalar tail of every loop)
    return logits


def assert_matches_reference(ids: torch.Tensor, logprobs: torch.Tensor, scores: torch.Tensor) -> None:
    want_ids, want = greedy_pick_ref(scores)
    assert torch.equal(ids, want_ids)
    assert torch.equal(torch.isnan(logprobs), torch.isnan(want))
    finite = ~torch.isnan(want)
    exact = torch.log_softmax(scores[finite].double(), dim=-1).gather(1, want_ids[finite][:, None]).squeeze(1)
    torch.testing.assert_close(logprobs[finite].double(), exact, rtol=1e-5, atol=1e-5)  # fp32 sums of up to 49k terms


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab", [1, 15, 17, 63, 64, 65, 5000, 49152])
def test_greedy_pick_matches_the_reference(native, threads: int, vocab: int) -> None:
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(5, vocab, generator=generator) * 3 if vocab < 100 else edge_rows(generator, vocab)
    picked = greedy_pick(scores)
    assert picked is not None
    assert_matches_reference(*picked, scores)


def test_rows_of_a_wider_tensor_and_refused_inputs(native) -> None:
    wide = torch.randn(6, 700, generator=torch.Generator().manual_seed(1))
    rows = wide[:, :600]  # contiguous values, a row stride of 700
    picked = greedy_pick(rows)
    assert picked is not None
    assert_matches_reference(*picked, rows)
    assert greedy_pick(rows.t()) is None  # values not contiguous
    assert greedy_pick(rows.to(torch.bfloat16)) is None  # fp32 only: the runner's logits are fp32
    assert greedy_pick(rows[0]) is None  # one row needs its [1, V] shape


def test_random_shapes_and_ties(native) -> None:
    generator = torch.Generator().manual_seed(3)
    for trial in range(40):
        rows = int(torch.randint(1, 9, (), generator=generator))
        vocab = int(torch.randint(1, 9000, (), generator=generator))
        if trial % 2:
            scores = torch.randint(-2, 3, (rows, vocab), generator=generator).float()  # ties across blocks
        else:
            scores = torch.randn(rows, vocab, generator=generator) * 5
        if trial % 5 == 0:
            scores[0, torch.randint(0, vocab, (2,), generator=generator)] = float("nan")
        if trial % 7 == 0:
            scores[-1] = float("-inf")
        picked = greedy_pick(scores)
        assert picked is not None
        assert_matches_reference(*picked, scores)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 (CI hosts); baseline (the scalar path)
def test_other_isa_builds_pick_the_same(native, tmp_path, march) -> None:
    if march == "x86-64-v3" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU cannot run AVX2 code")
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler is not None
    flags = [f if f != "-march=native" else f"-march={march}" for f in FLAGS]
    target = tmp_path / "greedy.so"
    done = subprocess.run([compiler, *flags, str(CSRC / "cpu_greedy.cpp"), "-o", str(target)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    fn = ctypes.CDLL(str(target)).tgi_paged_greedy_pick
    fn.restype = ctypes.c_int
    scores = edge_rows(torch.Generator().manual_seed(5), 3001)
    ids, logprobs = torch.empty(9, dtype=torch.int64), torch.empty(9)
    assert fn(ctypes.c_void_p(scores.data_ptr()), ctypes.c_int64(9), ctypes.c_int64(3001), ctypes.c_int64(3001),
              ctypes.c_void_p(ids.data_ptr()), ctypes.c_void_p(logprobs.data_ptr()), ctypes.c_int(2)) == 0  # fmt: skip
    assert_matches_reference(ids, logprobs, scores)
