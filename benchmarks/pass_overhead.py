"""What the GIFT pass costs: one 4096 x 4096 Linear weight gradient on 2 gloo ranks.

Four ways to run the gradient's communication, side by side in one pair of processes:

* eager reference (``GiftReference.reduce_gradients``), Euclidean FP8 and GIFT rank 32;
* compiled (``torch.compile(replicate(model), backend=gift_backend(...))``), same two paths.

The compiled comm-path time is the compiled backward with the collective minus the compiled
backward of the same model without data parallelism (which computes the same local
gradient), so only the communication path (codec, whitening, collective) is counted. The
factor refresh is excluded from the timed steps (it runs once every K steps; see
benchmarks/collectives.py for its cost). Kernel counts come from Inductor's generated code.

    python benchmarks/pass_overhead.py [--steps 10] [--tokens 256]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

import torch
from tabulate import tabulate
from torch import nn
from torch._inductor.utils import run_and_get_code

from common import median_seconds
from gift_compile import GiftConfig, GiftReference, gift_backend, replicate
from gift_compile.launch import run_on_ranks

DIM = 4096
PATHS = {
    "fp8 euclidean": GiftConfig(layers=(), rank=32, refresh_interval=10**6),
    "gift rank 32": GiftConfig(layers=("0",), rank=32, refresh_interval=10**6),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM, bias=False))


def count_kernels(codes: list[str]) -> int:
    return sum(len(re.findall(r"^cpp_fused_\w+ = ", code, flags=re.M)) for code in codes)


def measure(rank: int, world: int, steps: int, tokens: int, cache: str):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, f"rank{rank}")
    x = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(rank))
    results = {}

    local = model()
    compiled_local = torch.compile(local, backend="inductor")
    compiled_local(x).sum().backward()  # compile
    _, base_code = run_and_get_code(lambda: compiled_local(x).sum().backward())
    local_backward = median_seconds(lambda: compiled_local(x).sum().backward(), steps, warmup=0)

    for name, config in PATHS.items():
        eager_model = model()
        reference = GiftReference(eager_model, config)
        eager_model(x).sum().backward()
        reference.reduce_gradients()  # first step refreshes the factors

        eager_model.zero_grad()
        eager_model(x).sum().backward()
        # Each call reduces the current .grad in place: same shapes, same work, every step.
        eager_comm_time = median_seconds(reference.reduce_gradients, steps, warmup=0)

        compiled = torch.compile(replicate(model()), backend=gift_backend(config, name=name))
        compiled(x).sum().backward()  # compile + refresh at step 0
        _, code = run_and_get_code(lambda: compiled(x).sum().backward())
        compiled_backward = median_seconds(lambda: compiled(x).sum().backward(), steps, warmup=0)
        results[name] = {
            "eager": eager_comm_time,
            "compiled": max(compiled_backward - local_backward, 1e-6),
            "kernels": count_kernels(code) - count_kernels(base_code),
        }
        if rank == 0:
            print(f"  measured {name}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method (median reported)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank in the layer's input")
    args = parser.parse_args()
    print(f"one {DIM}x{DIM} Linear gradient, 2 gloo ranks, {args.steps} timed steps each ...", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        results = run_on_ranks(measure, 2, args.steps, args.tokens, cache)[0]
    rows = []
    for name, r in results.items():
        rows.append((name, f"{r['eager'] * 1e3:.1f}", f"{r['compiled'] * 1e3:.1f}", f"{r['eager'] / r['compiled']:.1f}x", r["kernels"]))
    print()
    print(tabulate(rows, headers=["path", "eager comm ms", "compiled comm ms", "eager / compiled", "fused kernels added"]))
    gift, fp8 = results["gift rank 32"], results["fp8 euclidean"]
    print(f"\nGIFT extra time over Euclidean FP8: eager {gift['eager'] / fp8['eager'] - 1:+.1%}, "
          f"compiled {gift['compiled'] / fp8['compiled'] - 1:+.1%} (target <= +25%)")
    print(f"compiled speed-up over eager: fp8 {fp8['eager'] / fp8['compiled']:.1f}x, gift {gift['eager'] / gift['compiled']:.1f}x (target >= 3x)")


if __name__ == "__main__":
    main()
