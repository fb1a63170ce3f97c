"""Memory traffic of the compiled codec: bytes read and written per gradient element, against the compulsory.

On a GPU the codec is memory-bound: its time is the bytes its kernels move. This benchmark
compiles ``comm.quantized_reduce`` (what every route runs) for one ``d_out x d_in`` gradient per
path on 2 gloo ranks (real ``all_to_all`` / ``all_gather``) and reads Inductor's own count of
every generated kernel's and extern call's reads and writes (``GraphLowering.count_bytes``, the
``inductor_metrics`` log; FX graph cache off, since a cache hit replays only the total).

* **codec**: the kernels and GEMMs of encode, decode, whitening, unwhitening and residuals;
* **compulsory**: what any implementation must move: each input read once (the gradient, the
  residuals), each output written once (the reduced gradient, the new residuals), and each
  message written once by its encoder and read once by its decoder (the collectives' buffers);
* the collectives' own buffer traffic is the network's, not the codec's, and is left out.

``codec / compulsory`` is how many times the codec passes over its data. ``call ms`` is the
compiled call's median time on this machine (collective included, one thread per rank). A per-tensor scale
needs the whole encoded tensor before its first value is written (one more read of it), and the
low-rank whitening ``G T = G s + ((G V) c) V^T`` reads its input once for ``G V`` and once for
the rest: those passes are inherent to the algorithm. ``--kernels`` lists every kernel.

    python benchmarks/codec_traffic.py            # 2048 x 2048, rank 32
    python benchmarks/codec_traffic.py --kernels  # and each path's kernels
    python benchmarks/codec_traffic.py --shape 768 256 --world 1  # the codec's time alone
"""

from __future__ import annotations

import argparse
import functools
import logging
from dataclasses import dataclass

import torch
from tabulate import tabulate

from common import median_seconds
from gift_compile.collectives import WireFormat
from gift_compile.comm import gather_residual_shape, quantized_reduce
from gift_compile.geometry import Whitening
from gift_compile.testing.ranks import run_on_ranks

COLLECTIVES = {"all_to_all_single", "all_gather_into_tensor", "all_reduce"}
GEMMS = {"mm", "addmm", "bmm"}


@dataclass(frozen=True)
class Path:
    name: str
    whitened: bool
    error_feedback: bool
    wire: str
    collective: str = "reduce_scatter"


PATHS = [
    Path("Euclidean FP8", False, False, "fp8"),
    Path("Euclidean FP8 + EF", False, True, "fp8"),
    Path("GIFT FP8 (default)", True, True, "fp8"),
    Path("Euclidean FP8, all-reduce", False, False, "fp8", "all_reduce"),
    Path("GIFT FP8, all-reduce", True, True, "fp8", "all_reduce"),
    Path("Euclidean FP4", False, False, "fp4"),
    Path("GIFT FP4", True, True, "fp4"),
    Path("Euclidean FP4, all-reduce", False, False, "fp4", "all_reduce"),
    Path("GIFT FP4, all-reduce", True, True, "fp4", "all_reduce"),
]
"""Each route's paths side by side; the all-reduce rows are what ``benchmarks/projection.py``'s ring all-reduce moves."""


def kind(node) -> str:
    """collective / wait / gemm / kernel, from the ATen ops an Inductor scheduler node was lowered from."""
    origins = {str(o.target).split(".")[-2] if str(o.target).count(".") >= 2 else str(o.target)
               for sub in node.get_nodes() if sub.node is not None for o in getattr(sub.node, "origins", ())}
    if node.is_extern() and origins & COLLECTIVES:
        return "collective"
    if node.is_extern() and "wait_tensor" in origins:
        return "wait"  # a wait touches the received buffer only to hand it on
    if origins & GEMMS and node.is_extern():
        return "gemm"
    return "kernel"


def whitening(d_in: int, rank: int) -> Whitening:
    """A low-rank ``T`` as a layer's step hands it to the codec (``layer_step.prepare_reduction``: unit-scaled)."""
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d_in, rank, generator=generator))[0]
    coef = torch.rand(rank, generator=generator)
    return Whitening("lowrank", {"basis": basis, "coef": coef, "coef_inv": 1 / (2 + coef) - 0.5,
                                 "scale": torch.tensor(2.0), "scale_inv": torch.tensor(0.5)}).unit_scaled()


def count_path(path: Path, shape: tuple[int, int], low_rank: int) -> dict:
    """Compile one path and return its traffic, split by kind, plus the compulsory bytes."""
    from torch._inductor import metrics

    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    residual = torch.zeros(shape) if path.error_feedback else None
    gather_residual = torch.zeros(gather_residual_shape(shape, None)) if path.error_feedback and path.collective == "all_reduce" else None
    factors = whitening(shape[1], low_rank) if path.whitened else None
    torch._dynamo.reset()
    metrics.reset()
    fn = torch.compile(quantized_reduce, fullgraph=True, dynamic=False)
    call = functools.partial(fn, g, factors, residual, gather_residual, op="avg", group=None, wire=WireFormat(path.wire),
                             collective=path.collective)
    with torch._inductor.config.patch(force_disable_caches=True):
        out = call()
    seconds = median_seconds(call, repeats=9)
    split = {"kernel": 0, "gemm": 0, "collective": 0, "wait": 0}
    kernels = []
    for node, quarter_bytes in metrics.nodes_num_elem:  # Inductor stores bytes // 4
        nbytes = 4 * quarter_bytes
        split[kind(node)] += nbytes
        if nbytes >= g.numel() // 16:
            kernels.append((kind(node), nbytes / g.numel(), node.get_name()))
    inputs = sum(t.numel() * t.element_size() for t in (g, residual, gather_residual) if t is not None)
    outputs = sum(t.numel() * t.element_size() for t in out if t is not None)
    return {"split": split, "compulsory": inputs + outputs + split["collective"], "numel": g.numel(), "kernels": kernels,
            "seconds": seconds}


def count_all(rank: int, world: int, shape, low_rank: int, paths=tuple(PATHS)) -> list[dict]:
    metrics_log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")
    level, propagate = metrics_log.level, metrics_log.propagate
    metrics_log.setLevel(logging.INFO)  # what makes Inductor count (compile_fx: isEnabledFor(INFO))
    metrics_log.propagate = False  # counted, not printed
    rows = []
    try:
        for path in paths:
            rows.append(count_path(path, shape, low_rank))
            if rank == 0:
                print(f"  counted {path.name}", flush=True)
    finally:
        metrics_log.setLevel(level)
        metrics_log.propagate = propagate
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=(2048, 2048), metavar=("D_OUT", "D_IN"))
    parser.add_argument("--rank", type=int, default=32, help="the whitening's rank (low_rank)")
    parser.add_argument("--kernels", action="store_true", help="list each path's kernels (those over 1/16 B per element)")
    parser.add_argument("--world", type=int, default=2,
                        help="gloo ranks (1: the codec alone, no peer to wait for: the steadiest call ms)")
    args = parser.parse_args()
    print(f"compiling {len(PATHS)} codec paths for a {args.shape[0]} x {args.shape[1]} gradient on {args.world} gloo ranks ...",
          flush=True)
    rows = run_on_ranks(count_all, args.world, tuple(args.shape), args.rank)[0]
    table = []
    for path, row in zip(PATHS, rows):
        per = {k: v / row["numel"] for k, v in row["split"].items()}
        codec = per["kernel"] + per["gemm"]
        compulsory = row["compulsory"] / row["numel"]
        table.append((path.name, path.collective.replace("_", "-"), f"{per['kernel']:.2f}", f"{per['gemm']:.2f}",
                      f"{codec:.2f}", f"{compulsory:.2f}", f"{codec / compulsory:.2f}x", f"{row['seconds'] * 1e3:.1f}"))
        if args.kernels:
            print(f"\n{path.name} ({path.collective}):")
            print(tabulate([(k, f"{b:.2f}", name) for k, b, name in row["kernels"]], headers=["kind", "B/element", "Inductor node"]))
    print()
    print(tabulate(table, headers=["path", "collective", "kernels B/elem", "GEMMs B/elem", "codec B/elem",
                                   "compulsory B/elem", "codec / compulsory", "call ms"]))


if __name__ == "__main__":
    main()
