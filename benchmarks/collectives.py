"""Bytes and time of gradient reduce-scatter / all-reduce: fp32, bf16, FP8 Euclidean, GIFT.

2 gloo ranks on this machine; every method runs side by side in one process pair so ratios
are comparable. The codec runs eagerly and under ``torch.compile`` (Inductor fuses amax,
scale, cast and the whitening epilogue). Then the cost of the factors for several input
widths: current-step statistics (the sketch of 8192 tokens, Rayleigh-Ritz, QR: every step)
against a periodic refresh (the full second moment and its factorization: every K steps).

    python benchmarks/collectives.py            # sizes 1M, 4M, 16M elements
    python benchmarks/collectives.py --quick    # 1M only, fewer repeats
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from tabulate import tabulate

from common import median_seconds
from gift_compile.collectives import WireFormat, bytes_sent
from gift_compile.comm import euclidean_reduce, quantized_reduce
from gift_compile.config import GiftConfig
from gift_compile.geometry import Whitening, factorize, initial_basis, input_sketch, second_moment, whitening_from_sketch
from gift_compile.testing.ranks import run_on_ranks

DEFAULTS = GiftConfig()  # the factor knobs a user gets unless they set them
ONE = torch.ones(())  # the sketch scale of inputs of ordinary magnitude (geometry.input_sketch)
WIRES = {"fp32": WireFormat("fp32"), "bf16": WireFormat("bf16"), "fp8 euclidean": WireFormat("fp8")}


def correlated_inputs(d_in: int, tokens: int, seed: int) -> torch.Tensor:
    mixing = torch.randn(d_in, d_in, generator=torch.Generator().manual_seed(0)) / d_in**0.5
    return torch.randn(tokens, d_in, generator=torch.Generator().manual_seed(seed)) @ mixing


def gift_factors(shape, rank: int, low_rank: int = DEFAULTS.low_rank) -> list[torch.Tensor]:
    """Rank-32 current-step factors of correlated inputs (a few subspace steps in)."""
    basis = initial_basis(shape[1], low_rank)
    for step in range(3):
        whitening, basis, _ = whitening_from_sketch(input_sketch(correlated_inputs(shape[1], 2048, rank + step), basis, ONE), basis, ONE, DEFAULTS.damping)
    return list(whitening.tensors.values())


def time_methods(rank: int, world: int, shapes, repeats: int):
    rows = []
    for shape in shapes:
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        factors, residual = gift_factors(shape, rank), torch.zeros(shape)
        for collective in ("reduce_scatter", "all_reduce"):
            for name, wire in WIRES.items():
                for mode in ("eager", "compiled") if wire.dtype == "fp8" else ("eager",):
                    fn = functools.partial(euclidean_reduce, op="avg", group=None, wire=wire, collective=collective)
                    fn = torch.compile(fn, fullgraph=True) if mode == "compiled" else fn
                    seconds = median_seconds(lambda: fn(grad), repeats)
                    rows.append((shape, collective, name, mode, bytes_sent(shape, world, wire, collective), seconds))
            gather_residual = torch.zeros(-(-shape[0] // world), shape[1]) if collective == "all_reduce" else None

            def gift(g, *tensors):
                return quantized_reduce(g, Whitening.from_list("lowrank", list(tensors)), residual, gather_residual,
                                  op="avg", group=None, wire=WireFormat("fp8"), collective=collective)

            for mode in ("eager", "compiled"):
                fn = torch.compile(gift, fullgraph=True) if mode == "compiled" else gift
                seconds = median_seconds(lambda: fn(grad, *factors), repeats)
                rows.append((shape, collective, "gift rank 32 + EF", mode, bytes_sent(shape, world, WireFormat("fp8"), collective), seconds))
            if rank == 0:
                print(f"  done {shape} {collective}", flush=True)
    return rows


def factor_cost(widths, low_rank: int = DEFAULTS.low_rank, tokens: int = 8192) -> list[tuple[int, float, float, float]]:
    """Seconds of the current-step factors (every step) and of a periodic refresh (every K)."""
    rows = []
    for d in widths:
        x, basis = torch.randn(tokens, d), initial_basis(d, low_rank)
        current = median_seconds(lambda: whitening_from_sketch(input_sketch(x, basis, ONE), basis, ONE, DEFAULTS.damping), 3)
        start = time.perf_counter()
        moment, count = second_moment(x)
        stats = time.perf_counter() - start
        start = time.perf_counter()
        factorize(moment / count, factorization=DEFAULTS.factorization, rank=low_rank, damping=DEFAULTS.damping)
        rows.append((d, current, stats, time.perf_counter() - start))
        print(f"  d_in={d}: current step {current:.3f}s; periodic refresh: statistics {stats:.2f}s, factorize {rows[-1][3]:.2f}s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M elements, 3 repeats, d_in up to 4096")
    args = parser.parse_args()
    shapes = [(1024, 1024)] if args.quick else [(1024, 1024), (2048, 2048), (4096, 4096)]
    repeats = 3 if args.quick else 7
    print(f"timing {len(shapes)} gradient sizes on 2 gloo ranks ...", flush=True)
    rows = run_on_ranks(time_methods, 2, shapes, repeats)[0]
    fp32_time = {(r[0], r[1]): r[5] for r in rows if r[2] == "fp32"}
    fp32_bytes = {(r[0], r[1]): r[4] for r in rows if r[2] == "fp32"}
    table = [
        (f"{shape[0] * shape[1] / 2**20:.0f}M", collective, name, mode, f"{nbytes / 2**20:.2f}",
         f"{nbytes / fp32_bytes[(shape, collective)]:.3f}", f"{seconds * 1e3:.1f}", f"{seconds / fp32_time[(shape, collective)]:.2f}")
        for shape, collective, name, mode, nbytes, seconds in rows
    ]
    print()
    print(tabulate(table, headers=["elements", "collective", "method", "codec", "MiB sent/rank", "x fp32 bytes", "median ms", "x fp32 time"]))
    print("\nfactors (8192 tokens per rank, rank 32):")
    widths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    print(tabulate(factor_cost(widths), headers=["d_in", "current step s (every step)", "periodic: statistics s", "periodic: factorize s"], floatfmt=".3f"))


if __name__ == "__main__":
    main()
