"""What the GIFT pass costs: one 4096 x 4096 Linear weight gradient on 2 gloo ranks (or GPUs).

Six ways to run the gradient's communication, side by side in one pair of processes:

* eager reference (``GiftReference.reduce_gradients``): Euclidean FP8, GIFT rank 32 with
  periodic factors, GIFT rank 32 with current-step factors (the default);
* compiled (``torch.compile(replicate(model), backend=gift_backend(...))``), same three paths.

GIFT's two rows differ only in where the factors come from: ``periodic`` loads them (the
refresh is excluded: it runs once every K steps), ``current step`` computes them every step
(the input sketch, its all-reduce, Rayleigh-Ritz and a QR); their difference is the cost of
fresh geometry.

The compiled comm-path time is the compiled backward with the collective minus the compiled
backward of the same model without data parallelism (which computes the same local
gradient), so only the communication path (codec, whitening, collective) is counted. All
variants run once per round, interleaved (after one uncounted warm-up round), and each figure
is the median over rounds of the per-round difference, so drift in the machine's load hits
every variant alike. Kernel counts come from Inductor's generated code.

The whole measurement runs twice, under two allocators:

* ``caching``: glibc told to keep freed memory in its heap (``MALLOC_MMAP_MAX_=0``), so a
  64 MiB buffer freed in one step is reused in the next, as the CUDA caching allocator does
  on a GPU;
* ``glibc default``: every buffer above 32 MiB is a fresh ``mmap`` whose pages fault in on
  first touch, each step; this charges ~25 ms per 64 MiB buffer on this machine to whichever
  path allocates more of them.

With ``--device cuda`` it runs once (the CUDA caching allocator), with NCCL on
``min(2, GPUs)`` ranks; on one GPU the collective is a local copy and only the transforms
and codec are timed, which is the overhead question itself.

    python benchmarks/pass_overhead.py [--rounds 10] [--tokens 256] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

import torch
from tabulate import tabulate
from torch import nn
from torch._inductor.utils import run_and_get_code

from gift_compile import GiftConfig, GiftReference, gift_backend, replicate
from gift_compile.testing.ranks import run_on_ranks

DIM = 4096
PATHS = {
    "fp8 euclidean": GiftConfig(layers=()),
    "gift periodic": GiftConfig(layers=("0",), factor_source="periodic", refresh_interval=10**6),
    "gift current step": GiftConfig(layers=("0",)),
}
ALLOCATORS = {
    "caching": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
    "glibc default": {},
}


def model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM, bias=False)).to(device)


def count_kernels(codes: list[str]) -> int:
    """Kernels Inductor generated (C++ on CPU, Triton on GPU)."""
    return sum(len(re.findall(r"^\w+ = async_compile\.(?:cpp_pybinding|triton)\(", code, flags=re.M)) for code in codes)


def seconds(fn, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def agreement(device: torch.device, tokens: int, steps: int = 12) -> float:
    """Largest relative difference, over ``steps`` steps of current-step factors, between the
    reduced gradient of the compiled GIFT path and that of the eager reference (0 = bit for
    bit, what tests/test_compiled_training.py shows on CPU)."""
    config = GiftConfig(layers=("0",))
    compiled_model, reference_model = model(device), model(device)
    compiled = torch.compile(replicate(compiled_model), backend=gift_backend(config, name="agreement"))
    reference = GiftReference(reference_model, config)
    worst = 0.0
    for step in range(steps):
        seed = 1000 * step + torch.distributed.get_rank()
        x = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(seed)).to(device)
        compiled(x).square().mean().backward()
        reference_model(x).square().mean().backward()
        reference.reduce_gradients()
        (got,), want = [p.grad for p in compiled_model.parameters()], reference_model[0].weight.grad
        worst = max(worst, ((got - want).norm() / want.norm()).item())
        compiled_model.zero_grad()
        reference_model.zero_grad()
    return worst


def measure(rank: int, world: int, rounds: int, tokens: int, cache: str, device_type: str):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, f"rank{rank}")
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    x = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(rank)).to(device)

    compiled = {"local": torch.compile(model(device), backend="inductor")}
    eager = {}
    for name, config in PATHS.items():
        eager_model = model(device)
        eager[name] = GiftReference(eager_model, config)
        eager_model(x).sum().backward()
        eager[name].reduce_gradients()  # first step builds the state; later ones reduce .grad in place
        compiled[name] = torch.compile(replicate(model(device)), backend=gift_backend(config, name=name))
    codes = {}
    for name, fn in compiled.items():
        fn(x).sum().backward()  # compile (and the periodic refresh at step 0)
        _, codes[name] = run_and_get_code(lambda: fn(x).sum().backward())

    # The floor of rank-r whitening on this machine: its four GEMMs alone (G U and P U^T to
    # whiten, the same two to unwhiten), nothing else.
    g, basis, projected = (torch.randn(shape, device=device) for shape in [(DIM, DIM), (DIM, 32), (DIM, 32)])

    def one_round() -> dict:
        times = {"local": seconds(lambda: compiled["local"](x).sum().backward(), device)}
        for name in PATHS:
            times["compiled", name] = seconds(lambda: compiled[name](x).sum().backward(), device) - times["local"]
            times["eager", name] = seconds(eager[name].reduce_gradients, device)
        times["gemms"] = 2 * seconds(lambda: (g @ basis, projected @ basis.T), device)
        return times

    one_round()  # warm-up: first calls pay one-off costs, not counted
    measured = []
    for round_ in range(rounds):
        measured.append(one_round())
        if rank == 0:
            print(f"  round {round_ + 1}/{rounds}", flush=True)

    def median(key) -> float:
        return statistics.median(times[key] for times in measured)

    results = {
        name: {
            "eager": median(("eager", name)),
            "compiled": max(median(("compiled", name)), 1e-6),
            "kernels": count_kernels(codes[name]) - count_kernels(codes["local"]),
        }
        for name in PATHS
    }
    results["gift current step"]["gemms"] = median("gemms")
    results["gift current step"]["agreement"] = agreement(device, tokens)
    return results


def report(allocator: str, results: dict) -> None:
    rows = [
        (name, f"{r['eager'] * 1e3:.1f}", f"{r['compiled'] * 1e3:.1f}", f"{r['eager'] / r['compiled']:.1f}x", r["kernels"])
        for name, r in results.items()
    ]
    print(f"\nallocator: {allocator}")
    print(tabulate(rows, headers=["path", "eager comm ms", "compiled comm ms", "eager / compiled", "fused kernels added"]))
    gift, periodic, fp8 = results["gift current step"], results["gift periodic"], results["fp8 euclidean"]
    print(f"GIFT extra time over Euclidean FP8: eager {gift['eager'] / fp8['eager'] - 1:+.1%}, "
          f"compiled {gift['compiled'] / fp8['compiled'] - 1:+.1%} (target <= +25%); "
          f"four rank-32 GEMMs alone: {gift['gemms'] * 1e3:.1f} ms = {gift['gemms'] / fp8['compiled']:+.1%} of FP8's compiled path")
    print(f"current-step factors over periodic (the cost of fresh geometry): compiled "
          f"{gift['compiled'] / periodic['compiled'] - 1:+.1%} (target <= +15%), eager {gift['eager'] / periodic['eager'] - 1:+.1%}")
    print(f"compiled speed-up over eager: fp8 {fp8['eager'] / fp8['compiled']:.1f}x, "
          f"gift {gift['eager'] / gift['compiled']:.1f}x (target >= 3x)")
    print(f"compiled GIFT vs eager reference, 12 steps: largest relative gradient difference {gift['agreement']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (medians reported)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank in the layer's input")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        world = min(2, torch.cuda.device_count())
        if world == 0:
            raise SystemExit("--device cuda: no CUDA device visible")
        print(f"one {DIM}x{DIM} Linear gradient, {world} NCCL rank(s), {args.rounds} rounds ...", flush=True)
        with tempfile.TemporaryDirectory() as cache:
            results = run_on_ranks(measure, world, args.rounds, args.tokens, cache, "cuda", backend="nccl")[0]
        report("CUDA caching", results)
        return
    all_results = {}
    for allocator, env in ALLOCATORS.items():
        print(f"one {DIM}x{DIM} Linear gradient, 2 gloo ranks, {args.rounds} rounds, allocator: {allocator} ...", flush=True)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)  # read by glibc when the rank processes start
        try:
            with tempfile.TemporaryDirectory() as cache:
                all_results[allocator] = run_on_ranks(measure, 2, args.rounds, args.tokens, cache, "cpu")[0]
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
    for allocator, results in all_results.items():
        report(allocator, results)


if __name__ == "__main__":
    main()
