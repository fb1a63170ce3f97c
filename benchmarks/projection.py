"""Projected step time at cluster scale: fp32 vs bf16 vs FP8 vs GIFT gradients (alpha-beta model).

A bandwidth-limited link is where low-precision gradients pay off; this machine has none at
cluster scale, so this script projects from a small cost model. Every input is printed and
labelled *measured* (on this machine, by this script) or *assumed* (a figure you can override
with a flag, e.g. for a GPU):

* data-parallel gradient traffic per GPU per step: a bandwidth-optimal ring, so an all-reduce
  sends ``2 (N-1)/N`` and a reduce-scatter ``(N-1)/N`` of the gradient bytes, plus ``alpha``
  per ring hop; FP8 bytes are 1 per element (+ scales, negligible), GIFT adds its statistics
  (``d_in x r`` fp32 per whitened layer, one all-reduce per block's child module, the default
  gradient statistics; with ``--stats-source inputs`` per whitened input, q, k and v sharing one);
* codec time: the FP8 quantize + dequantize of every gradient element at ``codec_gbps``
  (GB/s of fp32 gradient);
* GIFT's extra compute: per whitened layer and step, whitening and unwhitening plus the error
  feedback's transform (6 rank-``r`` GEMMs over ``d_out x d_in``) and the sketch (the
  gradient's ``4 d_out d_in r`` per layer, or the input's ``4 tokens d_in r`` once per input), at
  ``gemm_tflops``, or, where that takes longer, the memory those passes move at ``mem_gbps``
  (a roofline): GIFT's compiled all-reduce codec moves :data:`CODEC_BYTES` per whitened element
  beyond the Euclidean one's (``benchmarks/codec_traffic.py``), and the sketch reads its rows
  twice. A rank-32 GEMM does 64 flops per fp32 element it reads: on a GPU it is memory-bound;
* compute: ``6 P tokens`` flops at ``peak x MFU``.

Without overlap a step is compute + communication + codec; with perfect overlap
(communication hidden behind the backward) it is ``max(compute, communication) + codec``: the
codec and GIFT's GEMMs run on the compute stream. Between the two lies what the project's
scheduler achieves: the *measured overlap efficiency* ``e``, the share of
``min(compute, communication)`` actually hidden, read from benchmarks/shaped_link.py's saved
results (two CPU "nodes" on a shaped link; per FP8/GIFT cell ``e = (serial - step) / (serial -
ideal)`` with ``serial = compute + codec + wire`` and ``ideal = max(compute + codec, wire)``;
the median over the cells), gives ``serial - e * min(compute, communication)``. FP4 sends 4.5
bits a value (NVFP4) through a codec of its own rate.

    python benchmarks/projection.py                     # measures the codec and GEMM rates on this CPU
    python benchmarks/projection.py --codec-gbps 800 --gemm-tflops 400   # H100-class figures instead
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    """Total parameters."""
    linear_shapes: dict[str, tuple[int, int, int]]
    """Linear layer type -> (d_out, d_in, count)."""
    selected: tuple[str, ...]
    """Layer types GIFT whitens."""


def llama(name: str, dim: int, layers: int, ffn: int, kv_dim: int, vocab: int, selected: tuple[str, ...]) -> Model:
    shapes = {"wq": (dim, dim, layers), "wk": (kv_dim, dim, layers), "wv": (kv_dim, dim, layers), "wo": (dim, dim, layers),
              "w1": (ffn, dim, layers), "w3": (ffn, dim, layers), "w2": (dim, ffn, layers), "output": (vocab, dim, 1)}
    params = sum(o * i * n for o, i, n in shapes.values()) + vocab * dim + 2 * dim * layers
    return Model(name, params, shapes, selected)


MODELS = {
    # The paper's 600M setting: shapes assumed (a 24-block Llama of ~0.6B), its 13 whitened fc2 (w2) layers.
    "paper 600M": llama("paper 600M (dim 1280, 24 blocks, ffn 5120; w2 of 13 blocks whitened)", 1280, 24, 5120, 1280, 32000, ("w2",)),
    "llama3 8B": llama("Llama-3 8B (attention projections whitened)", 4096, 32, 14336, 1024, 128256, ("wq", "wk", "wv", "wo")),
}
INPUT_OF = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "wo", "w1": "ffn", "w3": "ffn", "w2": "w2",
            "output": "output"}
"""The input each Linear type reads: one sketch per input with input statistics (``gift_compile/layer_step.py``)."""
BUCKET_OF = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention", "w1": "feed_forward",
             "w3": "feed_forward", "w2": "feed_forward", "output": "output"}
"""The bucket (child module of a block) each Linear type travels in: one gradient-statistics all-reduce per bucket."""
PAPER_SELECTED_BLOCKS = 13  # the paper whitens w2 of 13 of the 24 blocks
SHAPED_LINK = Path(__file__).resolve().parent / "results" / "shaped_link.json"


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus: int
    gbit_per_gpu: float
    tokens_per_gpu: int
    peak_tflops: float = 989.0  # H100 SXM bf16 dense (assumed)
    mfu: float = 0.4  # assumed
    alpha_us: float = 10.0  # per ring hop (assumed)


SCENARIOS = [
    (MODELS["paper 600M"], Cluster("64 GPUs, 200 Gbit/s each (paper)", 64, 200, 16384)),
    (MODELS["llama3 8B"], Cluster("8 H100, 400 Gbit/s each", 8, 400, 8192)),
    (MODELS["llama3 8B"], Cluster("64 H100, 400 Gbit/s each", 64, 400, 8192)),
]
PATHS = ("fp32", "bf16", "FP8", "GIFT", "FP4", "GIFT-FP4")
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "FP8": 1, "GIFT": 1, "FP4": 0.5625, "GIFT-FP4": 0.5625}
CODEC_BYTES = {"FP8": 21.0, "GIFT": 109.0, "FP4": 68.38, "GIFT-FP4": 168.38}
"""Bytes the compiled all-reduce codec reads and writes per gradient element, Inductor's own count
(``python benchmarks/codec_traffic.py``: 2048 x 2048, 2 gloo ranks, stop 60; GIFT with its error
feedback, rank 32): measured, not assumed, and the same on any machine Inductor compiles for alike."""
EUCLIDEAN_OF = {"GIFT": "FP8", "GIFT-FP4": "FP4"}


def measured_overlap_efficiency(path: Path = SHAPED_LINK) -> tuple[float, str]:
    """The share of ``min(compute + codec, wire)`` that shaped_link.py's FP8 and GIFT runs hid
    (median over their shaped cells without added delay), and where it came from."""
    from shaped_link import Result, limit_s, link_settings, wire_s

    raw = json.loads(path.read_text())
    shares = []
    for r in (Result(**r) for r in raw["results"]):
        mbit, delay = link_settings(r.rate)
        if r.variant not in ("fp8", "gift") or mbit is None or delay:
            continue
        serial, ideal = raw["compute_s"] + r.codec_s + wire_s(r), limit_s(r, raw["compute_s"])
        shares.append(min(max((serial - r.step_s) / (serial - ideal), 0.0), 1.0))
    if not shares:
        raise ValueError(f"{path} has no shaped FP8/GIFT cell to measure overlap from; run benchmarks/shaped_link.py")
    return statistics.median(shares), f"measured: median of {len(shares)} FP8/GIFT cells of {path.name}"


def measure_codec_gbps(wire: str = "fp8", numel: int = 1 << 24) -> float:
    """GB/s of fp32 gradient through a compiled quantize + dequantize on this machine."""
    from gift_compile.fp4 import fp4_round_trip
    from gift_compile.numerics import dequantize, quantize

    fn = torch.compile((lambda x: dequantize(*quantize(x, "e4m3"), "e4m3")) if wire == "fp8" else (lambda x: fp4_round_trip(x, "nvfp4")))
    x = torch.randn(4096, numel // 4096)
    fn(x)
    start = time.perf_counter()
    for _ in range(3):
        fn(x)
    return 3 * numel * 4 / (time.perf_counter() - start) / 1e9


def measure_gemm_tflops(d: int = 2048, r: int = 32) -> float:
    """TFLOP/s of the rank-r GEMMs whitening uses (``d x d`` times ``d x r``) on this machine."""
    g, basis = torch.randn(d, d), torch.randn(d, r)
    g @ basis
    start = time.perf_counter()
    for _ in range(10):
        g @ basis
    return 10 * 2 * d * d * r / (time.perf_counter() - start) / 1e12


def measure_memory_gbps(numel: int = 1 << 25) -> float:
    """GB/s of memory traffic (read + write) of a large fp32 copy on this machine."""
    x, y = torch.randn(numel), torch.empty(numel)
    y.copy_(x)
    start = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    return 5 * 2 * numel * 4 / (time.perf_counter() - start) / 1e9


def project(model: Model, cluster: Cluster, path: str, codec_gbps: dict[str, float], gemm_tflops: float, rank: int = 32,
            efficiency: float = 1.0, stats_source: str = "gradients", memory_gbps: float = math.inf) -> dict:
    """Step-time components of ``path``; ``codec_gbps`` maps a wire ("fp8", "fp4") to its codec rate;
    ``stats_source``: GIFT's statistics (``GiftConfig.stats_source``, whose default is ``gradients``);
    ``memory_gbps``: the memory bandwidth GIFT's extra passes run at (the module docstring's roofline)."""
    n, bandwidth = cluster.gpus, cluster.gbit_per_gpu * 1e9 / 8
    grad_bytes = model.params * BYTES_PER_ELEMENT[path]
    comm = 2 * (n - 1) / n * grad_bytes / bandwidth + 2 * (n - 1) * cluster.alpha_us * 1e-6  # all-reduce: ring
    codec = gemms = 0.0
    if path not in ("fp32", "bf16"):
        wire = "fp4" if path.endswith("FP4") else "fp8"
        codec = 2 * model.params * 4 / (codec_gbps[wire] * 1e9)  # quantize and dequantize (both all-reduce phases)
    if path.startswith("GIFT"):
        stats = flops = moved = 0.0
        extra_per_element = CODEC_BYTES[path] - CODEC_BYTES[EUCLIDEAN_OF[path]]
        sketched = set()  # inputs: layers that read one input (q, k, v; w1, w3) send one sketch
        summed = set()  # gradients: one all-reduce per bucket (a block's child module)
        for kind in model.selected:
            d_out, d_in, count = model.linear_shapes[kind]
            if model.name.startswith("paper"):
                count = PAPER_SELECTED_BLOCKS
            flops += count * 6 * 2 * d_out * d_in * rank
            moved += count * d_out * d_in * extra_per_element
            if stats_source == "gradients":  # G^T (G Q) per layer: no sharing
                summed.add(BUCKET_OF[kind])
                stats += count * d_in * rank * 4
                flops += count * 4 * d_out * d_in * rank
                moved += count * d_out * d_in * 4 * 2  # G read twice
            elif INPUT_OF[kind] not in sketched:
                sketched.add(INPUT_OF[kind])
                stats += count * d_in * rank * 4
                flops += count * 4 * cluster.tokens_per_gpu * d_in * rank
                moved += count * cluster.tokens_per_gpu * d_in * 4 * 2  # the input rows read twice
        comm += 2 * (n - 1) / n * stats / bandwidth + 2 * (n - 1) * cluster.alpha_us * 1e-6 * len(sketched | summed)
        gemms = max(flops / (gemm_tflops * 1e12), moved / (memory_gbps * 1e9))
    compute = 6 * model.params * cluster.tokens_per_gpu / (cluster.peak_tflops * 1e12 * cluster.mfu)
    serial = compute + comm + codec + gemms
    overlapped = max(compute, comm) + codec + gemms
    measured = serial - efficiency * min(compute, comm)
    return {"compute": compute, "comm": comm, "codec": codec + gemms, "serial": serial, "overlapped": overlapped, "measured": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec-gbps", type=float, help="GB/s of fp32 gradient through FP8 quantize+dequantize (default: measured here)")
    parser.add_argument("--gemm-tflops", type=float, help="TFLOP/s of the rank-32 whitening GEMMs (default: measured here)")
    parser.add_argument("--fp4-codec-gbps", type=float, help="the same for the NVFP4 codec (default: measured here)")
    parser.add_argument("--mem-gbps", type=float, help="GB/s of memory bandwidth for GIFT's extra passes (default: measured here)")
    parser.add_argument("--rank", type=int, default=32, help="GIFT's low rank")
    parser.add_argument("--stats-source", choices=["gradients", "inputs"], default="gradients",
                        help="GIFT's statistics (GiftConfig.stats_source; default: gradients, the library's default)")
    parser.add_argument("--shaped-link", type=Path, default=SHAPED_LINK,
                        help="shaped_link.py's saved run to measure the overlap efficiency from")
    parser.add_argument("--overlap-efficiency", type=float,
                        help="share of min(compute, communication) hidden (default: measured by shaped_link.py, see the docstring)")
    args = parser.parse_args()
    codec, codec_label = (args.codec_gbps, "assumed (flag)") if args.codec_gbps else (measure_codec_gbps("fp8"), "measured on this CPU")
    fp4, fp4_label = (args.fp4_codec_gbps, "assumed (flag)") if args.fp4_codec_gbps else (measure_codec_gbps("fp4"), "measured on this CPU")
    gemm, gemm_label = (args.gemm_tflops, "assumed (flag)") if args.gemm_tflops else (measure_gemm_tflops(), "measured on this CPU")
    memory, memory_label = (args.mem_gbps, "assumed (flag)") if args.mem_gbps else (measure_memory_gbps(), "measured on this CPU")
    efficiency, efficiency_label = ((args.overlap_efficiency, "assumed (flag)") if args.overlap_efficiency is not None
                                    else measured_overlap_efficiency(args.shaped_link))
    print("inputs:")
    print(f"  FP8 codec (quantize + dequantize): {codec:.2f} GB/s of fp32 gradient  [{codec_label}]")
    print(f"  NVFP4 codec (quantize + dequantize): {fp4:.2f} GB/s of fp32 gradient  [{fp4_label}]")
    print(f"  whitening GEMMs (d x d by d x {args.rank}): {gemm:.3f} TFLOP/s  [{gemm_label}]")
    print(f"  memory: {memory:.0f} GB/s  [{memory_label}]; GIFT's codec moves {CODEC_BYTES['GIFT'] - CODEC_BYTES['FP8']:.0f} "
          f"(FP4: {CODEC_BYTES['GIFT-FP4'] - CODEC_BYTES['FP4']:.0f}) B per whitened element beyond the Euclidean codec's  "
          "[measured: benchmarks/codec_traffic.py]")
    print(f"  overlap efficiency: {efficiency:.2f} of min(compute, communication) hidden  [{efficiency_label}]")
    for model, cluster in SCENARIOS:
        print(f"\n{model.name}: {model.params / 1e9:.2f}B parameters; {cluster.name}; {cluster.tokens_per_gpu} tokens/GPU/step")
        print(f"  assumed: compute at {cluster.peak_tflops:.0f} TFLOP/s x MFU {cluster.mfu}; ring all-reduce of the gradients; "
              f"alpha {cluster.alpha_us:.0f} us per hop; GIFT statistics d_in x {args.rank} fp32 "
              + ("per whitened layer, one all-reduce per block's child module" if args.stats_source == "gradients"
                 else "per whitened input (q, k, v share one)"))
        rows, fp32 = [], None
        for path in PATHS:
            t = project(model, cluster, path, {"fp8": codec, "fp4": fp4}, gemm, args.rank, efficiency, args.stats_source, memory)
            fp32 = fp32 or t
            rows.append([path, f"{t['compute'] * 1e3:.0f}", f"{t['comm'] * 1e3:.0f}", f"{t['codec'] * 1e3:.0f}",
                         f"{t['serial'] * 1e3:.0f}", f"{t['comm'] / t['serial']:.0%}", f"{fp32['serial'] / t['serial']:.2f}x",
                         f"{t['overlapped'] * 1e3:.0f}", f"{fp32['overlapped'] / t['overlapped']:.2f}x",
                         f"{t['measured'] * 1e3:.0f}", f"{fp32['measured'] / t['measured']:.2f}x"])
        print(tabulate(rows, headers=["gradients", "compute ms", "comm ms", "codec+GEMM ms", "step ms (serial)", "comm share",
                                      "speed-up", "step ms (overlap)", "speed-up (overlap)", "step ms (measured overlap)",
                                      "speed-up (measured overlap)"]))


if __name__ == "__main__":
    main()
