"""Why GIFT's statistics have a process group of their own: FSDP's forward over a shaped link.

Two gloo ranks in two network namespaces joined by a shaped veth (``shaped_link.ShapedLink``)
play FSDP's forward with the debug job's sizes: per block, the next block's parameter all-gather
is issued (prefetched) and the previous one waited for, then 20 ms of compute with a
statistics-sized all-reduce issued in the middle of it (GIFT sums each block's input sketches
during the forward). The all-reduce goes nowhere (``none``), on the all-gathers' group
(``shared``), or on a group of its own with the same ranks (``own``, ``[gift] stats_group``'s
default). Modes alternate over rounds, so the machine's drift hits each alike. The table goes to
stdout and benchmarks/results/statistics_queue.md. Needs root and iproute2, as shaped_link.py.

    sudo python benchmarks/statistics_queue.py                 # 200 Mbit/s
    sudo python benchmarks/statistics_queue.py --rate 50 --rounds 3
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
MODES = ("none", "shared", "own")
RESULTS = Path(__file__).resolve().parent / "results"


def setting() -> str:
    return (f"{BLOCKS} blocks, each a {PARAMETERS * 4 / 2**20:.1f} MiB all-gather ({PARAMETERS * 2 / 2**20:.1f} MiB from each rank), "
            f"a {SKETCH * 4 / 1024:.0f} KiB all-reduce and {COMPUTE_S * 1e3:.0f} ms of compute")


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rank_main(rank: int, address: str, port: int, rounds: int, forwards: int, rate: float) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
    own = dist.new_group([0, 1])
    shard = torch.randn(PARAMETERS // 2)
    sketch = torch.randn(SKETCH)
    groups = {"shared": None, "own": own}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            for forward in range(forwards + 1):  # the first warms the connections up
                dist.barrier()
                start, sums = time.perf_counter(), []
                gathered = dist.all_gather_into_tensor(torch.empty(PARAMETERS), shard, async_op=True)
                for _block in range(BLOCKS):
                    prefetched = dist.all_gather_into_tensor(torch.empty(PARAMETERS), shard, async_op=True)
                    gathered.wait()
                    gathered = prefetched
                    busy(COMPUTE_S / 2)
                    if mode != "none":
                        sums.append(dist.all_reduce(sketch.clone(), async_op=True, group=groups[mode]))
                    busy(COMPUTE_S / 2)
                gathered.wait()
                for work in sums:
                    work.wait()
                if forward:
                    seconds[mode].append(time.perf_counter() - start)
            if rank == 0:
                print(f"  {mode:6s} {statistics.median(seconds[mode][-forwards:]) * 1e3:6.1f} ms per forward", flush=True)
    if rank == 0:
        none = statistics.median(seconds["none"])
        lines = [f"| statistics all-reduce | ms per forward (median of {len(seconds['none'])}) | vs none |", "|---|---|---|"]
        lines += [f"| {mode} | {statistics.median(seconds[mode]) * 1e3:.1f} | {statistics.median(seconds[mode]) / none:.2f}x |"
                  for mode in MODES]
        print("\n" + "\n".join(lines))
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "statistics_queue.md").write_text(f"# {__doc__.splitlines()[0]}\n\n`benchmarks/statistics_queue.py --rate {rate:g}`: {setting()}, "
                                                     f"{rate:g} Mbit/s, two gloo ranks\n\n"
                                                     + "\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="link rate in Mbit/s")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the three modes")
    parser.add_argument("--forwards", type=int, default=4, help="timed forwards per mode and round")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import shaped_link

    missing = shaped_link.missing_requirements()
    if missing:
        print("statistics_queue.py cannot run here; it needs:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    print(f"{setting()}; {args.rate:g} Mbit/s", flush=True)
    with shaped_link.ShapedLink() as link:
        link.shape(args.rate)
        procs = [subprocess.Popen(link.command(side, [sys.executable, __file__, "--rank", str(side), link.addresses[0],
                                                      str(args.rounds), str(args.forwards), str(args.rate)]),
                                  env={**os.environ, "GLOO_SOCKET_IFNAME": link.devices[side], "OMP_NUM_THREADS": "1"})
                 for side in (0, 1)]
        codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], 29931, int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
    else:
        sys.exit(main())
