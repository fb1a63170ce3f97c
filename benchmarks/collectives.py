"""Bytes and time of gradient reduce-scatter / all-reduce: fp32, bf16, FP8 Euclidean, GIFT.

2 gloo ranks on this machine; every method runs side by side in one process pair so ratios
are comparable. The codec runs eagerly and under ``torch.compile`` (Inductor fuses amax,
scale, cast and the whitening epilogue). Then the cost of one factor refresh (statistics of
8192 tokens + factorization) for several input widths.

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
from gift_compile.comm import euclidean_reduce, gift_reduce
from gift_compile.config import GiftConfig
from gift_compile.geometry import factorize, second_moment
from gift_compile.launch import run_on_ranks
from gift_compile.state import GiftLayerState

WIRES = {"fp32": WireFormat("fp32"), "bf16": WireFormat("bf16"), "fp8 euclidean": WireFormat("fp8")}


def gift_layer(shape, rank: int) -> GiftLayerState:
    """A layer state whose rank-32 factors come from a real refresh on correlated inputs."""
    layer = GiftLayerState("bench", *shape, GiftConfig(rank=32))
    mixing = torch.randn(shape[1], shape[1], generator=torch.Generator().manual_seed(0)) / shape[1] ** 0.5
    x = torch.randn(2048, shape[1], generator=torch.Generator().manual_seed(rank)) @ mixing
    layer.refresh(x, None)
    return layer


def time_methods(rank: int, world: int, shapes, repeats: int):
    rows = []
    for shape in shapes:
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        layer = gift_layer(shape, rank)
        for collective in ("reduce_scatter", "all_reduce"):
            for name, wire in WIRES.items():
                for mode in ("eager", "compiled") if wire.dtype == "fp8" else ("eager",):
                    fn = functools.partial(euclidean_reduce, op="avg", group=None, wire=wire, collective=collective)
                    fn = torch.compile(fn, fullgraph=True) if mode == "compiled" else fn
                    seconds = median_seconds(lambda: fn(grad), repeats)
                    rows.append((shape, collective, name, mode, bytes_sent(shape, world, wire, collective), seconds))
            gift = functools.partial(
                gift_reduce, kind=layer.kind, sides=layer.sides, op="avg", group=None,
                wire=WireFormat.gift(layer.config), collective=collective,
            )
            for mode in ("eager", "compiled"):
                fn = torch.compile(gift, fullgraph=True) if mode == "compiled" else gift
                seconds = median_seconds(lambda: fn(grad, layer.factor_tensors(), layer.residual), repeats)
                rows.append((shape, collective, "gift rank 32", mode, bytes_sent(shape, world, WireFormat("fp8"), collective), seconds))
            if rank == 0:
                print(f"  done {shape} {collective}", flush=True)
    return rows


def refresh_cost(widths, rank: int = 32) -> list[tuple[int, float, float]]:
    rows = []
    for d in widths:
        x = torch.randn(8192, d)
        start = time.perf_counter()
        moment, tokens = second_moment(x)
        stats = time.perf_counter() - start
        start = time.perf_counter()
        factorize(moment / tokens, rank=rank)
        rows.append((d, stats, time.perf_counter() - start))
        print(f"  refresh d_in={d}: stats {stats:.2f}s, factorize {rows[-1][2]:.2f}s", flush=True)
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
    print("\nfactor refresh (8192 tokens, rank 32):")
    widths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    print(tabulate(refresh_cost(widths), headers=["d_in", "statistics s", "factorize s"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
