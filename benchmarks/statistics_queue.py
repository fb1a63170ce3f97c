"""Why GIFT's statistics have a process group of their own: FSDP's forward over a shaped link.

Two gloo ranks in two network namespaces joined by a shaped veth (``shaped_link.ShapedLink``)
play FSDP's forward with the debug job's sizes: per block, the next block's parameter all-gather
is issued (prefetched) and the previous one waited for, then 20 ms of compute with a
statistics-sized all-reduce issued in the middle of it (GIFT sums each block's input sketches
during the forward). The all-reduce goes nowhere (``none``), on the all-gathers' group
(``shared``), or on a group of its own with the same ranks (``own``, ``[gift] stats_group``'s
default). Modes alternate over rounds, so the machine's drift hits each alike. Needs root and
iproute2, as shaped_link.py.

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

BLOCKS, COMPUTE_S = 6, 0.020
PARAMETERS = 850_000  # one block of the debug job (fp32): each rank holds and sends half
SKETCH = 2 * (256 * 32 + 2)  # a block's two input sketches (wqkv's and wo's inputs), fp32
MODES = ("none", "shared", "own")


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rank_main(rank: int, address: str, port: int, rounds: int, forwards: int) -> None:
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
        print(f"\n| statistics all-reduce | ms per forward (median of {len(seconds['none'])}) | vs none |\n|---|---|---|")
        for mode in MODES:
            ms = statistics.median(seconds[mode])
            print(f"| {mode} | {ms * 1e3:.1f} | {ms / none:.2f}x |")
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
    print(f"{BLOCKS} blocks: a {PARAMETERS * 4 / 2**20:.1f} MiB all-gather each, a {SKETCH * 4 / 1024:.0f} KiB all-reduce, "
          f"{COMPUTE_S * 1e3:.0f} ms compute; {args.rate:g} Mbit/s", flush=True)
    with shaped_link.ShapedLink() as link:
        link.shape(args.rate)
        procs = [subprocess.Popen(link.command(side, [sys.executable, __file__, "--rank", str(side), link.addresses[0],
                                                      str(args.rounds), str(args.forwards)]),
                                  env={**os.environ, "GLOO_SOCKET_IFNAME": link.devices[side], "OMP_NUM_THREADS": "1"})
                 for side in (0, 1)]
        codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], 29931, int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main())
