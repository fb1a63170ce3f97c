"""What gloo moves over a shaped link, collective by collective (``sudo python benchmarks/gloo_link.py``).

The link of ``shaped_link.py`` (two network namespaces, a veth pair, a token bucket on both
ends), one process per namespace. Each row moves the same bytes per direction several times and
reports the rate per direction: raw TCP (both directions at once, as a baseline for the link
itself), gloo's all-reduce, gloo's all-gather and all-to-all in one call, and both in pieces
(issued one after another, or all at once and then waited). ``shaped_link.py``'s limit divides
the bytes by the link's rate; this says which collectives can reach it. A table goes to stdout
and to ``benchmarks/results/gloo_link.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from shaped_link import RESULTS, ShapedLink, missing_requirements

REPEATS = 3  # transfers per row (after one untimed)


def tcp_duplex(rank: int, address: str, port: int, nbytes: int) -> float:
    """Seconds to send ``nbytes`` each way at once over one TCP connection."""
    chunk = b"x" * (1 << 20)
    if rank == 0:
        server = socket.create_server((address, port))
        conn, _ = server.accept()
    else:
        for _ in range(100):
            try:
                conn = socket.create_connection((address, port))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)

    def receive():
        left = nbytes
        while left > 0:
            left -= len(conn.recv(min(left, 1 << 20)))

    start = time.perf_counter()
    reader = threading.Thread(target=receive)
    reader.start()
    sent = 0
    while sent < nbytes:
        conn.sendall(chunk[: min(len(chunk), nbytes - sent)])
        sent += min(len(chunk), nbytes - sent)
    reader.join()
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed


def busy_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent not idle since boot (``/proc/stat``: user,
    nice, system, irq, softirq, steal): both ranks, their gloo threads and the kernel's network
    stack, which all run on this machine."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def worker(rank: int, address: str, port: int, device: str, sizes_mib: list[float], piece_kib: int) -> list[dict]:
    """Both ranks run this; rank 0 returns the rows (``op``, ``mib``: per direction, ``mbit_s``,
    ``cpu_ms_per_mib``)."""
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = device
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
    rows = []

    def timed(op: str, mib: float, run) -> None:
        run()  # untimed: connections and buffers warm
        dist.barrier()
        start, busy = time.perf_counter(), busy_cpu_s()
        for _ in range(REPEATS):
            run()
        elapsed = time.perf_counter() - start
        dist.barrier()  # both ranks done: the CPU of both and of the kernel's network stack
        rows.append({"op": op, "mib": mib, "mbit_s": REPEATS * mib * 2**20 * 8 / elapsed / 1e6,
                     "cpu_ms_per_mib": (busy_cpu_s() - busy) * 1e3 / (REPEATS * mib)})

    for mib in sizes_mib:
        numel = int(mib * 2**20) // 4
        own = torch.randn(numel)
        gathered = torch.empty(2 * numel)
        both_halves, exchanged = torch.randn(2 * numel), torch.empty(2 * numel)
        pieces = own.split(max(1, piece_kib * 1024 // 4))
        piece_outputs = [torch.empty(2 * p.numel()) for p in pieces]
        dist.barrier()
        busy = busy_cpu_s()
        elapsed = tcp_duplex(rank, address, port + 1, int(mib * 2**20))
        dist.barrier()
        rows.append({"op": "raw TCP, both directions at once", "mib": mib, "mbit_s": mib * 2**20 * 8 / elapsed / 1e6,
                     "cpu_ms_per_mib": (busy_cpu_s() - busy) * 1e3 / mib})
        # a 2-rank ring all-reduce sends each rank's half twice: the tensor's bytes per direction
        timed("gloo all-reduce", mib, lambda: dist.all_reduce(own))
        timed("gloo all-gather, one call", mib, lambda: dist.all_gather_into_tensor(gathered, own))
        # the quantized reductions' first phase: each rank keeps one half and sends the other
        timed("gloo all-to-all, one call", mib, lambda: dist.all_to_all_single(exchanged, both_halves))

        def one_by_one():
            for out, piece in zip(piece_outputs, pieces):
                dist.all_gather_into_tensor(out, piece)

        def all_at_once():
            for work in [dist.all_gather_into_tensor(out, piece, async_op=True) for out, piece in zip(piece_outputs, pieces)]:
                work.wait()

        def two_in_flight():  # FSDP's prefetch: each call issued before the previous one is waited on
            pending = None
            for out, piece in zip(piece_outputs, pieces):
                work = dist.all_gather_into_tensor(out, piece, async_op=True)
                if pending is not None:
                    pending.wait()
                pending = work
            pending.wait()

        timed(f"gloo all-gather, {piece_kib} KiB pieces one by one", mib, one_by_one)
        timed(f"gloo all-gather, {piece_kib} KiB pieces two in flight (FSDP's prefetch)", mib, two_in_flight)
        timed(f"gloo all-gather, {piece_kib} KiB pieces all issued, then waited", mib, all_at_once)
        a2a_in = [torch.randn(2 * p.numel()) for p in pieces]
        a2a_out = [torch.empty(2 * p.numel()) for p in pieces]

        def a2a_at_once():
            for work in [dist.all_to_all_single(o, i, async_op=True) for o, i in zip(a2a_out, a2a_in)]:
                work.wait()

        def a2a_one_by_one():
            for o, i in zip(a2a_out, a2a_in):
                dist.all_to_all_single(o, i)

        timed(f"gloo all-to-all, {piece_kib} KiB pieces one by one", mib, a2a_one_by_one)
        timed(f"gloo all-to-all, {piece_kib} KiB pieces all issued, then waited", mib, a2a_at_once)
    dist.destroy_process_group()
    return rows


def table(rows: list[dict], rate: float | None) -> str:
    link = f"{rate:g} Mbit/s" if rate else "unshaped"
    lines = [f"# What gloo moves over the shaped link ({link}; `sudo python benchmarks/gloo_link.py`)", "",
             f"Each row: the mean rate per direction over {REPEATS} transfers after one untimed; 2 ranks, one per network namespace. "
             "'CPU ms per MiB': the machine's busy CPU time (both ranks, gloo's threads and the kernel's network stack; `/proc/stat`) "
             "over the transfers, per MiB carried in each direction: what moving the bytes costs the cores that also compute.", "",
             "| MiB per direction | op | Mbit/s per direction | of raw TCP | CPU ms per MiB |", "|---|---|---|---|---|"]
    for row in rows:
        raw = next(r["mbit_s"] for r in rows if r["mib"] == row["mib"] and r["op"].startswith("raw TCP"))
        lines.append(f"| {row['mib']:g} | {row['op']} | {row['mbit_s']:.0f} | {row['mbit_s'] / raw:.2f} | {row['cpu_ms_per_mib']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="link rate in Mbit/s (0: unshaped)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.0, 8.0], help="MiB per direction")
    parser.add_argument("--piece-kib", type=int, default=256)
    parser.add_argument("--results", default="gloo_link", help="stem of the result file in benchmarks/results")
    parser.add_argument("--port", type=int, default=29911, help="gloo's rendezvous port (the TCP row uses the next one)")
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "ADDRESS", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, address, device = args.worker
        rows = worker(int(rank), address, args.port, device, args.sizes, args.piece_kib)
        if int(rank) == 0:
            print(json.dumps(rows))
        return 0
    missing = missing_requirements()
    if missing:
        print("gloo_link.py cannot run here; it needs:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    with ShapedLink() as link:
        link.shape(args.rate or None)
        common = ["--sizes", *map(str, args.sizes), "--piece-kib", str(args.piece_kib), "--port", str(args.port)]
        procs = [subprocess.Popen(link.command(side, [sys.executable, __file__, *common, "--worker", str(side), link.addresses[0],
                                                      link.devices[side]]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for side in (0, 1)]
        outputs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs):
        print("\n".join(err[-3000:] for _, err in outputs), file=sys.stderr)
        return 1
    publish(table(json.loads(outputs[0][0].strip().splitlines()[-1]), args.rate), args.results)
    return 0


def publish(text: str, stem: str) -> None:
    """Print a result table and write it to ``benchmarks/results/<stem>.md``."""
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
