"""The GPU check: kernels, bandwidth, and SmolLM2 served in bf16 through the launcher spawn and router replay.

Run by ``scripts/gpu_check.sh`` (which installs ``out/gpu_bundle`` first); phases, each timed, the
rest skipped once ``--budget-s`` is spent:

a. kernels (``integration/gpu_kernel_checks.py``): ``examples/bench_paged_attention.py``'s checks
   (store_kv, paged decode single pass and split-K, paged prefill, copy/swap blocks; fp16/bf16/fp32/
   fp8 caches) plus fp8_linear and int_linear at model shapes, all against ``tgi_paged_kernels``
   references; then decode bandwidth on a few shapes against the device's peak;
b. serve: the model (the bundle's SmolLM2 slice padded to 30 layers, see ``integration/gpu_model``;
   else a tiny random Llama) spawned as the TGI launcher does (``--dtype bfloat16``), the v3 router
   replay's startup (Warmup) and two waves of greedy requests; tokens/s; token ids against HF
   ``generate`` on the same device and dtype (identical count, first divergence and HF's top-1
   margin there: a near-tie in bf16 is legitimate, it is reported either way);
c. Triton compilations after Warmup: new entries in the shard's own ``TRITON_CACHE_DIR`` (empty at
   spawn) after the router's Warmup returned, per wave, with the kernel names;
d. CUDA graphs (``integration/decode_graph_check``): the served shard of phase b already runs with the
   launcher's default ``CUDA_GRAPHS``; then, in process on the same model, decode ITL at a few batch
   sizes eagerly and through the captured graphs, and whether their greedy tokens agree.

``--cpu``: phases b and d only, on CPU in float32 with the tiny model: proves the plumbing where there is
no GPU (phase d then runs the static decode step eagerly: no graphs on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch

from integration import gpu_kernel_checks

REPO = Path(__file__).resolve().parents[1]


def _repo_tests_first() -> None:
    """``tests`` here is a namespace package: a regular ``tests`` package installed in the image
    (some wheels ship one) would shadow it whatever the path order, so bind the name to ours."""
    spec = importlib.util.find_spec("tests")
    if spec is not None and spec.origin is not None and not Path(spec.origin).is_relative_to(REPO):
        module = types.ModuleType("tests")
        module.__path__ = [str(REPO / "tests")]
        sys.modules["tests"] = module


_repo_tests_first()

QUESTIONS = (
    "What is the capital of France?", "Give me three tips for writing clean Python code.",
    "Explain in two sentences what a KV cache is in a transformer.", "Write a haiku about autumn leaves.",
    "What is 17 times 23? Show your work briefly.", "Name three planets and one fact about each.",
    "Why is the sky blue? Answer for a ten-year-old.", "Suggest a name for a friendly robot and explain why.",
)  # fmt: skip
NEAR_TIE = 0.25
"""HF's top-1 minus top-2 logit below which a bf16 divergence counts as a near-tie."""


class Budget:
    def __init__(self, total_s: float) -> None:
        self.start, self.total_s = time.monotonic(), total_s
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows(self, phase: str, needs_s: float) -> bool:
        if self.elapsed() + needs_s <= self.total_s:
            return True
        self.skipped.append(phase)
        print(
            f"\n== {phase}: SKIPPED (elapsed {self.elapsed():.0f} s + ~{needs_s:.0f} s > budget {self.total_s:.0f} s)"
        )
        return False

    def phase(self, name: str) -> _Phase:
        return _Phase(name, self)


class _Phase:
    def __init__(self, name: str, budget: Budget) -> None:
        self.name, self.budget = name, budget

    def __enter__(self) -> _Phase:
        self.t0 = time.monotonic()
        print(f"\n== {self.name} (at {self.budget.elapsed():.0f} s)", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        print(f"-- {self.name}: {time.monotonic() - self.t0:.1f} s (total {self.budget.elapsed():.0f} s)", flush=True)


# --------------------------------------------------------------------------------------------- b, c


def prepare_model(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    from integration import gpu_model

    if args.model_dir:
        return Path(args.model_dir), f"given: {args.model_dir}"
    slice_file = Path(args.bundle) / "model" / "smollm2-slice.gguf"
    use_slice = args.model == "slice" or (args.model == "auto" and not args.cpu and slice_file.is_file())
    why = "--model tiny" if args.model == "tiny" else "--cpu" if args.cpu else f"no {slice_file}"
    if use_slice:
        try:
            dest = gpu_model.build_from_slice(slice_file, work / "smollm2", num_layers=gpu_model.SMOLLM2_LAYERS)
            note = json.loads((dest / "config.json").read_text()).get("_gpu_check_note", "")
            return dest, f"SmolLM2 slice ({note})"
        except Exception:  # noqa: BLE001 - still check the serving path, on the fallback
            traceback.print_exc()
            why = "FAILED to build the SmolLM2 slice (traceback above)"
    return gpu_model.write_fallback(work / "tiny-llama"), f"tiny random Llama fallback ({why})"


def prompts_for(model_dir: Path, count: int) -> list[str]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i in range(count):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"
        if tokenizer.chat_template:
            out.append(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
                )
            )
        else:
            out.append(question)
    return out


def triton_cache_entries(cache_dir: Path) -> dict[str, list[str]]:
    """``{cache entry: what it holds}``: a compiled kernel specialization (its ``<kernel>.json`` metadata)
    or a host-side helper Triton builds (a launcher ``.so``, listed as ``host:<name>``)."""
    if not cache_dir.is_dir():
        return {}
    out = {}
    for entry in cache_dir.iterdir():
        if entry.is_dir():
            kernels = sorted(f.stem for f in entry.glob("*.json") if not f.name.startswith("__grp__"))
            out[entry.name] = kernels or sorted(f"host:{f.stem}" for f in entry.glob("*.so")) or ["host:?"]
    return out


def new_compiles(before: dict[str, list[str]], after: dict[str, list[str]]) -> str:
    """``"N kernel compiles (names)"`` for the entries in ``after`` that ``before`` lacks, host helpers apart."""
    names = [name for key, held in after.items() if key not in before for name in held]
    kernels = sorted(n for n in names if not n.startswith("host:"))
    hosts = len(names) - len(kernels)
    text = f"{len(kernels)} kernel compiles" + (f" ({', '.join(kernels)})" if kernels else "")
    return text + (f" + {hosts} host launcher builds" if hosts else "")


def serve(args: argparse.Namespace, model_dir: Path, prompts: list[str], work: Path, time_left: float) -> dict:
    from integration.launcher_spawn import LaunchedShards, LauncherOptions
    from integration.net import free_port
    from integration.router_replay import Router
    from tests.helpers.shard_driving import run_requests

    cache_dir = work / "triton-cache-shard"
    metrics_port = free_port()
    env = {"TRITON_CACHE_DIR": str(cache_dir), "TGI_PAGED_METRICS_PORT": str(metrics_port)}
    capability = None if args.cpu else torch.cuda.get_device_capability()
    opts = LauncherOptions(
        uds_path=str(work / "shard"), dtype=None if args.cpu else "bfloat16", compute_capability=capability,
        max_input_tokens=1024, max_total_tokens=1024 + args.max_new_tokens, env=env,
        inherit=tuple(k for k in os.environ if k != "LOG_LEVEL"),  # the launcher passes its whole env on
    )  # fmt: skip
    result: dict = {"waves": []}

    async def scenario() -> None:
        started = time.monotonic()
        router = await Router.connect(
            opts.uds_path,
            str(model_dir),
            max_input_tokens=1024,
            max_total_tokens=1024 + args.max_new_tokens,
            max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        )
        print(
            f"router replay connected, Warmup done in {time.monotonic() - started:.1f} s "
            f"(max_batch_total_tokens {router.info.max_batch_total_tokens})",
            flush=True,
        )
        after_warmup = triton_cache_entries(cache_dir)
        result["compiled_at_warmup"] = new_compiles({}, after_warmup)
        try:
            for wave in (1, 2):
                before = triton_cache_entries(cache_dir)
                t0 = time.monotonic()
                tokens = await run_requests(router, prompts, args.max_new_tokens)
                elapsed = time.monotonic() - t0
                generated = sum(map(len, tokens))
                compiles = new_compiles(before, triton_cache_entries(cache_dir))
                result["waves"].append({"tokens": tokens, "elapsed": elapsed, "compiles": compiles})
                print(
                    f"wave {wave}: {len(prompts)} requests x {args.max_new_tokens} tokens = {generated} tokens in "
                    f"{elapsed:.2f} s = {generated / elapsed:.0f} tokens/s; Triton compiles during the wave: "
                    f"{compiles}",
                    flush=True,
                )
        finally:
            await router.close()
        result["compiles_after_warmup"] = new_compiles(after_warmup, triton_cache_entries(cache_dir))

    spawned = time.monotonic()
    with LaunchedShards(str(model_dir), opts, ready_timeout=max(60.0, time_left)) as shards:
        print(
            f"shard ready in {time.monotonic() - spawned:.1f} s (argv: {' '.join(shards.argv()[:4])} ...)", flush=True
        )
        try:
            asyncio.run(asyncio.wait_for(scenario(), max(60.0, time_left)))
        finally:
            warmup_lines = [r.text for r in shards.logs if "warmup" in r.text.lower()]
            for line in warmup_lines[-3:]:
                print(f"  shard: {line[:200]}")
            shards.terminate()
            if shards.exit_codes.get(0) not in (0, None):
                print(f"shard exit {shards.exit_codes}; stderr tail:\n{shards.stderr.get(0, '')[-3000:]}")
    return result


def hf_reference(
    model_dir: Path, prompts: list[str], max_new: int, device: torch.device, dtype: torch.dtype
) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and HF's top-1 minus top-2 logit at each step, one request at a time (no padding).

    A plain argmax loop over HF's forward with its KV cache rather than ``generate``: ``generate``
    would need ``min_new_tokens`` to run past EOS, which masks EOS, while the shard under
    ``ignore_eos_token`` may pick EOS and go on.
    """
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    # transformers >= 5.2x names the KV cache argument and output field `cache` (`past_key_values` before).
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    with torch.no_grad():
        for text in prompts:
            step_ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
            past, tokens, margins = None, [], []
            for _ in range(max_new):
                result = model(input_ids=step_ids, use_cache=True, **{cache_name: past})
                top = result.logits[0, -1].float().topk(2)
                tokens.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                past, step_ids = result[cache_name], top.indices[:1].view(1, 1)
            out.append((tokens, margins))
    del model
    return out


def compare(served: list[list[int]], reference: list[tuple[list[int], list[float]]], label: str) -> int:
    identical, lines = 0, []
    for i, (got, (want, margins)) in enumerate(zip(served, reference)):
        if got == want:
            identical += 1
            continue
        pos = next((p for p, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        margin = margins[pos] if pos < len(margins) else float("nan")
        kind = "near-tie" if margin < NEAR_TIE else "MISMATCH (clear margin)"
        lines.append(
            f"  request {i}: first divergence at token {pos}/{len(want)}: served {got[pos : pos + 1]} vs "
            f"HF {want[pos : pos + 1]}, HF top-1 margin {margin:.3f} -> {kind}"
        )
    print(f"{label}: {identical}/{len(served)} sequences identical to HF")
    for line in lines:
        print(line)
    return sum("MISMATCH" in line for line in lines)


def phase_serve(budget: Budget, args: argparse.Namespace, work: Path) -> bool:
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    with budget.phase("b. model"):
        model_dir, description = prepare_model(args, work)
        print(f"model: {model_dir}: {description}")
        args.served_model_dir = model_dir  # phase d reuses it
        prompts = prompts_for(model_dir, args.requests)
    if not budget.allows("b. serve", 60):
        return False
    with budget.phase(
        f"b. serve {args.requests} greedy requests x {args.max_new_tokens} tokens "
        f"({'float32, CPU' if args.cpu else 'bfloat16, CUDA, Triton kernels'})"
    ):
        result = serve(args, model_dir, prompts, work, budget.total_s - budget.elapsed())
    print(
        f"\n== c. Triton compiles (new entries in the shard's TRITON_CACHE_DIR): up to Warmup's end "
        f"{result.get('compiled_at_warmup', 'n/a')}; after Warmup: {result.get('compiles_after_warmup', 'n/a')}"
        + (" (CPU: torch paths, no Triton)" if args.cpu else "")
    )
    if not result["waves"] or not budget.allows("b. HF reference", 30):
        return False
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(model_dir)
    for i, tokens in enumerate(result["waves"][0]["tokens"][:2]):
        print(f"  sample {i}: {tokenizer.decode(tokens)[:160]!r}")
    with budget.phase(f"b. HF generate on {device} ({str(dtype)[6:]}), same prompts"):
        reference = hf_reference(model_dir, prompts, args.max_new_tokens, device, dtype)
        mismatches = sum(compare(w["tokens"], reference, f"wave {i + 1}") for i, w in enumerate(result["waves"]))
    return mismatches == 0


def phase_decode_graphs(budget: Budget, args: argparse.Namespace) -> bool:
    from integration.decode_graph_check import phase_graphs

    model_dir = getattr(args, "served_model_dir", None)
    if model_dir is None or not budget.allows("d. decode graphs", 45):
        return False
    with budget.phase(
        "d. decode ITL with and without CUDA graphs" + (" (CPU: the static step, eager)" if args.cpu else "")
    ):
        if args.cpu:
            return phase_graphs(model_dir, torch.device("cpu"), "float32", batch_sizes=(1, 3), context=24, steps=6)
        return phase_graphs(model_dir, torch.device("cuda"), "bfloat16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="plumbing check without a GPU (phase b, tiny model)")
    parser.add_argument("--bundle", default=str(REPO / "out/gpu_bundle"))
    parser.add_argument("--model-dir", default=None, help="serve this model directory instead")
    parser.add_argument(
        "--model",
        choices=("auto", "slice", "tiny"),
        default="auto",
        help="auto: the bundle's SmolLM2 slice on CUDA, the tiny random Llama with --cpu",
    )
    parser.add_argument("--budget-s", type=float, default=480.0, help="total time budget (default 480)")
    parser.add_argument("--requests", type=int, default=None, help="greedy requests per wave (64; --cpu: 6)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (64; --cpu: 12)")
    parser.add_argument("--max-batch-prefill-tokens", type=int, default=4096)
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args(argv)
    args.requests = args.requests or (6 if args.cpu else 64)
    args.max_new_tokens = args.max_new_tokens or (12 if args.cpu else 64)
    budget = Budget(args.budget_s)
    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"cuda {torch.version.cuda if torch.cuda.is_available() else 'none'}"
    )
    if not args.cpu:
        if not torch.cuda.is_available():
            print("No CUDA device visible to torch: this check needs one (use --cpu for the plumbing check).")
            return 2
        import transformers
        import triton

        print(
            f"device {torch.cuda.get_device_name()}, triton {triton.__version__}, "
            f"transformers {transformers.__version__}"
        )
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton-cache-driver"))
        phases = (
            []
            if args.cpu or args.skip_kernels
            else [("kernels", lambda: gpu_kernel_checks.phase_kernels(budget, torch.device("cuda")))]
        )
        phases += [
            ("serve", lambda: phase_serve(budget, args, work)),
            ("graphs", lambda: phase_decode_graphs(budget, args)),
        ]
        for name, run in phases:
            try:
                results[name] = run()
            except Exception:  # noqa: BLE001 - report, then run the next phase
                traceback.print_exc()
                print(f"{name}: FAILED with the exception above", flush=True)
                results[name] = False
    verdict = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in results.items())
    skipped = f"; skipped: {', '.join(budget.skipped)}" if budget.skipped else ""
    print(f"\nGPU check: {verdict}{skipped}; {budget.elapsed():.0f} s")
    return 0 if all(results.values()) and not budget.skipped else 1


if __name__ == "__main__":
    sys.exit(main())
