"""Why GIFT's statistics have a process group of their own, and what a live meter reading costs, over a shaped link.

Two gloo ranks in two network namespaces joined by a shaped veth (``shaped_link.ShapedLink``).

``--phase forward`` (the default) plays FSDP's forward with the debug job's sizes: per block, the
next block's parameter all-gather is issued (prefetched) and the previous one waited for, then
20 ms of compute with a statistics-sized all-reduce issued in the middle of it (GIFT sums each
block's input sketches during the forward). The all-reduce goes nowhere (``none``), on the
all-gathers' group (``shared``), or on a group of its own with the same ranks (``own``,
``[gift] stats_group``'s default).

``--phase backward`` plays a replicate backward on a live meter's reading step: per whitened
layer 20 ms of compute, then its FP8 gradient message (512 KiB, in 128 KiB ``all_to_all``
pieces, issued and left in flight), then the reading's sum (``meter.DeliveredMeter.after``: 4 x
32 x 64 fp32, 32 KiB) all-reduced: not at all (``none``), blocking on the gradients' group as
the meter does (``shared``), blocking on a group of its own (``own``), or issued and waited at
the end of the backward (``async``).

Modes alternate over rounds, so the machine's drift hits each alike. The table goes to stdout and
benchmarks/results/statistics_queue.md (``_backward.md``). Needs root and iproute2, as
shaped_link.py.

    sudo python benchmarks/statistics_queue.py                 # 200 Mbit/s
    sudo python benchmarks/statistics_queue.py --rate 50 --rounds 3
    sudo python benchmarks/statistics_queue.py --phase backward --rate 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BLOCKS, COMPUTE_S = 6, 0.020
PARAMETERS = 850_000  # one block of the debug job (fp32): each rank holds and sends half
SKETCH = 2 * (256 * 32 + 2)  # a block's two input sketches (wqkv's and wo's inputs), fp32
LAYERS, MESSAGE_BYTES, PIECE_BYTES = 12, 512 * 1024, 128 * 1024  # the debug job's whitened layers, FP8
READING = 4 * 32 * (32 + 32)  # a reading's compressed sums (meter.py): 4 x SKETCH_ROWS x (rank + SKETCH_COLUMNS)
MODES = {"forward": ("none", "shared", "own"), "backward": ("none", "shared", "own", "async")}
RESULTS = Path(__file__).resolve().parent / "results"


def setting(phase: str) -> str:
    if phase == "backward":
        return (f"{LAYERS} layers, each {COMPUTE_S * 1e3:.0f} ms of compute, a {MESSAGE_BYTES // 1024} KiB gradient message in "
                f"{PIECE_BYTES // 1024} KiB all_to_all pieces and a {READING * 4 // 1024} KiB reading all-reduce")
    return (f"{BLOCKS} blocks, each a {PARAMETERS * 4 / 2**20:.1f} MiB all-gather ({PARAMETERS * 2 / 2**20:.1f} MiB from each rank), "
            f"a {SKETCH * 4 / 1024:.0f} KiB all-reduce and {COMPUTE_S * 1e3:.0f} ms of compute")


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def forward(mode: str, group) -> None:
    """One FSDP forward: prefetched parameter all-gathers, a statistics all-reduce per block."""
    import torch
    import torch.distributed as dist

    shard, sketch, sums = torch.randn(PARAMETERS // 2), torch.randn(SKETCH), []
    gathered = dist.all_gather_into_tensor(torch.empty(PARAMETERS), shard, async_op=True)
    for _block in range(BLOCKS):
        prefetched = dist.all_gather_into_tensor(torch.empty(PARAMETERS), shard, async_op=True)
        gathered.wait()
        gathered = prefetched
        busy(COMPUTE_S / 2)
        if mode != "none":
            sums.append(dist.all_reduce(sketch.clone(), async_op=True, group=group))
        busy(COMPUTE_S / 2)
    gathered.wait()
    for work in sums:
        work.wait()


def backward(mode: str, group) -> None:
    """One replicate backward on a meter reading's step: each layer's gradient pieces left in
    flight, then its reading's sum."""
    import torch
    import torch.distributed as dist

    message, reading, works = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8), torch.randn(READING), []
    for _layer in range(LAYERS):
        busy(COMPUTE_S)
        works += [dist.all_to_all_single(torch.empty_like(piece), piece, async_op=True) for piece in message.split(PIECE_BYTES)]
        if mode == "async":
            works.append(dist.all_reduce(reading.clone(), async_op=True))
        elif mode != "none":
            dist.all_reduce(reading.clone(), group=group)
    for work in works:
        work.wait()


def rank_main(rank: int, address: str, port: int, phase: str, rounds: int, repeats: int, rate: float) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
    groups = {"own": dist.new_group([0, 1])}  # the rest: the default group (the gradients')
    play, modes = {"forward": forward, "backward": backward}[phase], MODES[phase]
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            for repeat in range(repeats + 1):  # the first warms the connections up
                dist.barrier()
                start = time.perf_counter()
                play(mode, groups.get(mode))
                if repeat:
                    seconds[mode].append(time.perf_counter() - start)
            if rank == 0:
                print(f"  {mode:6s} {statistics.median(seconds[mode][-repeats:]) * 1e3:6.1f} ms per {phase}", flush=True)
    if rank == 0:
        none = statistics.median(seconds["none"])
        what = "statistics all-reduce" if phase == "forward" else "reading all-reduce"
        lines = [f"| {what} | ms per {phase} (median of {len(seconds['none'])}) | vs none |", "|---|---|---|"]
        lines += [f"| {mode} | {statistics.median(seconds[mode]) * 1e3:.1f} | {statistics.median(seconds[mode]) / none:.2f}x |"
                  for mode in modes]
        print("\n" + "\n".join(lines))
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = "statistics_queue.md" if phase == "forward" else f"statistics_queue_{phase}.md"
        (RESULTS / name).write_text(f"# {__doc__.splitlines()[0]}\n\n`benchmarks/statistics_queue.py --phase {phase} --rate {rate:g}`: "
                                    f"{setting(phase)}, {rate:g} Mbit/s, two gloo ranks\n\n" + "\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=tuple(MODES), default="forward")
    parser.add_argument("--rate", type=float, default=200.0, help="link rate in Mbit/s")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the modes")
    parser.add_argument("--repeats", type=int, default=4, help="timed forwards (or backwards) per mode and round")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import shaped_link

    missing = shaped_link.missing_requirements()
    if missing:
        print("statistics_queue.py cannot run here; it needs:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    print(f"{setting(args.phase)}; {args.rate:g} Mbit/s", flush=True)
    with shaped_link.ShapedLink() as link:
        link.shape(args.rate)
        procs = [subprocess.Popen(link.command(side, [sys.executable, __file__, "--rank", str(side), link.addresses[0],
                                                      args.phase, str(args.rounds), str(args.repeats), str(args.rate)]),
                                  env={**os.environ, "GLOO_SOCKET_IFNAME": link.devices[side], "OMP_NUM_THREADS": "1"})
                 for side in (0, 1)]
        codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], 29931, sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]))
    else:
        sys.exit(main())
