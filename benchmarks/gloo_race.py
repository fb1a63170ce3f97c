"""Does gloo survive many collectives in flight? (``python benchmarks/gloo_race.py``)

torch 2.13's ``ProcessGroupGloo`` runs a group's collectives on two worker threads, and each
thread, after finishing one, writes its op name into one ``std::string`` of the group's status
without taking the group's lock. A name of up to 15 characters stays inside the string object;
a longer one (a functional ``all_gather_into_tensor`` finishes as ``ALLGATHER_COALESCED``) is
kept on the heap, so two collectives finishing together can free it twice or write into it
after it is freed, and glibc aborts the process later ("malloc(): unaligned tcache chunk
detected"). ``collectives.all_gather`` therefore sends GIFT's all-gathers as ``all_to_all``
calls on gloo (docs/design.md §10).

This plays that pattern without the rest of the job: 2 ranks on loopback issue rounds of
functional collectives, ``--in-flight`` at a time, then wait for them, and each variant runs
``--runs`` times in fresh processes. A run that ends by a signal is reported with it. The table
goes to stdout and to ``benchmarks/results/gloo_race.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from gloo_link import publish

from gift_compile.testing.ranks import free_port

VARIANTS = {
    "all_gather": "all_gather_into_tensor only (finishes as ALLGATHER_COALESCED)",
    "mixed": "all_to_all_single and all_gather_into_tensor alternating (the all-reduce route's two phases)",
    "all_to_all": "all_to_all_single only (finishes as ALLTOALL_BASE)",
    "all_gather_out": "all_gather_into_tensor_out only (into a buffer of the caller's)",
    "reduce_scatter": "reduce_scatter_tensor only (torchtitan's norm-weight gradients in FSDP mode)",
}


def worker(rank: int, port: int, variant: str, rounds: int, in_flight: int, kib: int) -> None:
    import torch
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    group = dist.group.WORLD.group_name
    half = kib * 1024 // 2
    message = torch.ones(2 * half, dtype=torch.uint8)
    for _ in range(rounds):
        sent = []
        for i in range(in_flight):
            if variant == "all_gather_out":
                sent.append(c10d.all_gather_into_tensor_out(message, 2, group, out=torch.empty(2 * message.numel(), dtype=message.dtype)))
            elif variant == "reduce_scatter":
                sent.append(c10d.reduce_scatter_tensor(message, "sum", 2, group))
            elif variant == "all_gather" or (variant == "mixed" and i % 2):
                sent.append(c10d.all_gather_into_tensor(message, 2, group))
            else:
                sent.append(c10d.all_to_all_single(message, [half, half], [half, half], group))
        for s in sent:
            c10d.wait_tensor(s)
    dist.destroy_process_group()


def run(variant: str, rounds: int, in_flight: int, kib: int) -> tuple[str, float]:
    """One run of ``variant`` on 2 fresh processes: how it ended, and its seconds."""
    port, start = free_port(), time.perf_counter()
    command = [sys.executable, __file__, "--worker", variant, str(port), "--rounds", str(rounds), "--in-flight", str(in_flight),
               "--kib", str(kib)]
    procs = [subprocess.Popen([*command, str(rank)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for rank in (0, 1)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    codes = [p.returncode for p in procs]
    seconds = time.perf_counter() - start
    signals = [signal.Signals(-c).name for c in codes if c < 0]
    if signals:
        return "killed by " + ", ".join(signals), seconds
    if any(codes):  # a Python error (the peer's death, or a setup problem): its last line says which
        last = next((e.strip().splitlines()[-1] for e, c in zip(errors, codes) if c and e.strip()), "no message")
        return f"exit {max(codes)}: {last}", seconds
    return "finished", seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per variant")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=16, help="collectives issued before the round's waits")
    parser.add_argument("--kib", type=int, default=128, help="KiB per message (GIFT's pieces: up to 128 per destination)")
    parser.add_argument("--results", default="gloo_race", help="stem of the result file in benchmarks/results")
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "PORT"), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        worker(int(rest[0]), int(args.worker[1]), args.worker[0], args.rounds, args.in_flight, args.kib)
        return 0
    lines = ["# Many gloo collectives in flight (`python benchmarks/gloo_race.py`)", "",
             f"2 ranks on loopback, torch {__import__('torch').__version__}; each run: {args.rounds} rounds of "
             f"{args.in_flight} functional collectives of {args.kib} KiB issued, then waited.", "",
             "| variant | runs finished | how the others ended | seconds per run |", "|---|---|---|---|"]
    for variant in args.variants:
        ends = []
        for i in range(args.runs):
            ends.append(run(variant, args.rounds, args.in_flight, args.kib))
            print(f"  {variant} run {i + 1}: {ends[-1][0]} ({ends[-1][1]:.1f} s)", flush=True)
        finished = sum(end == "finished" for end, _ in ends)
        others = "; ".join(sorted({end for end, _ in ends if end != "finished"})) or "-"
        lines.append(f"| {VARIANTS[variant]} | {finished} of {args.runs} | {others} | "
                     f"{', '.join(f'{s:.1f}' for _, s in ends)} |")
    publish("\n".join(lines) + "\n", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
