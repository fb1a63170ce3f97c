"""Training over a bandwidth-limited link: two "nodes" joined by a shaped veth pair.

Loopback makes fp32 traffic nearly free, so every loopback timing shows FP8 and GIFT only as
extra codec work. Here the two ranks of a torchtitan job live in two Linux network namespaces
joined by a veth pair whose both ends are shaped with ``tc`` (token bucket: rate, burst,
latency; cells with an added round trip go through a delay line instead, ``DelayedLink``), and
the job is launched as a 2-node torchrun job (one rank per "node", gloo over the link). The Llama-3 debug job (6.2M parameters, graph_trainer) runs

* in replicate mode (pure data parallel: the gradient all-reduces are all the traffic) and
* in FSDP mode (the parameter all-gathers travel too, so only part of the traffic shrinks),
  and, with ``--modes standard``, on torchtitan's standard trainer (FSDP2 ``fully_shard`` per
  block, GIFT's custom reduce-scatter: ``gift_compile/fsdp.py``),

under fp32, bf16, Euclidean FP8 and GIFT gradients, at several link rates, with the same seed
and data, all in one invocation. For every run it reports the per-step time (mean over the
timed steps, which include the live meter's steps, and spread), tokens/s, the bytes the link carried per step (kernel counters), the share of the
step spent beyond the compute (a 1-rank run of the same per-rank batch is the compute time)
and the loss after a fixed wall-clock budget; then the link rate below which FP8 and GIFT
beat fp32 and GIFT's cost over FP8 at each rate. A table goes to stdout and
benchmarks/results/shaped_link.md, the plots to shaped_link.png.

It needs root and iproute2 (``ip``, ``tc``); without them it stops with a message saying what
is missing. The namespaces it creates are always removed, also on Ctrl-C or a crash.

    sudo python benchmarks/shaped_link.py                      # 50, 200, 1000 Mbit/s, unshaped, 200 Mbit/s + 2 ms RTT
    sudo python benchmarks/shaped_link.py --rates 100 --modes replicate --steps 8
    sudo python benchmarks/shaped_link.py --variants fp8 gift fp4 gift_fp4 --rates 50 200
    sudo python benchmarks/shaped_link.py --variants fp4 gift_fp4 --rates 50 --merge   # add cells to the saved table
    sudo python benchmarks/shaped_link.py --rates 200 --results shaped_link_200          # a table of its own
    sudo python benchmarks/shaped_link.py --rates 200 --modes replicate --variants fp8 gift gift_no_statistics gift_no_ef
    sudo python benchmarks/shaped_link.py --rates 200 200+10ms --modes standard --variants fp8 fp8_per_gradient gift gift_per_gradient
    python benchmarks/shaped_link.py --render benchmarks/results/shaped_link.json    # the table again
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
JOB = ROOT / "examples" / "llama3_debug_cpu.toml"
SUBNET = "10.77.{}.{}"
LOCAL_BATCH = 2
"""Sequences per rank and step in the job (``examples/llama3_debug_cpu.toml``); ``--local-batch-size`` changes it."""
SEQ_LEN = 256
RANKS = 2
WARMUP = 2
"""Steps not timed: the compiles."""


def tokens_per_step(local_batch: int) -> int:
    """Tokens of one step over both ranks."""
    return RANKS * local_batch * SEQ_LEN

MODES = {
    "replicate": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "fsdp": [],
    # torchtitan's standard trainer: FSDP2 fully_shard per block, GIFT's custom reduce-scatter
    "standard": ["--launch.config", "llama3_debug_standard"],
}
VARIANTS = {
    "fp32": ["--gift.no-enabled"],
    "bf16": ["--gift.layers=", "--gift.euclidean_dtype", "bf16", "--gift.embedding_dtype", "bf16"],
    "fp8": ["--gift.layers="],
    "gift": [],
    "fp4": ["--gift.layers=", "--gift.euclidean_dtype", "fp4", "--gift.embedding_dtype", "fp4"],
    "gift_fp4": ["--gift.gift_dtype", "fp4", "--gift.euclidean_dtype", "fp4", "--gift.embedding_dtype", "fp4"],
}
# graph_trainer's FSDP bucketing/prefetch pass switched off (as it was on CPU before the
# ``cpu_roofline`` shim): all-gathers one per parameter, each waited where it is issued.
# (Names spelled out: this file runs without torch until it launches a job; they are
# cpu_support.cpu_disabled_graph_passes() plus cpu_support.FSDP_BUCKETING_PASS.)
UNBUCKETED = ["--compile.disable_passes", "selective_activation_remat_pass,joint_transformer_block_bucketing_reordering_pass"]
VARIANTS.update({f"{name}_unbucketed": [*VARIANTS[name], *UNBUCKETED] for name in ("fp32", "fp8", "gift")})
# each quantized message in one gloo call, as before passes/pieces.py; or in pieces of another size
VARIANTS.update({f"{name}_whole": [*VARIANTS[name], "--gift.wire_piece_kib", "0"] for name in ("fp8", "gift")})
VARIANTS.update({f"{name}_piece{kib}": [*VARIANTS[name], "--gift.wire_piece_kib", str(kib)]
                 for name in ("fp8", "gift") for kib in (128, 512, 2048)})
# graph_trainer's FSDP parameter all-gathers in 128 KiB pieces, or in one call each (config.parameter_piece_kib;
# the default, "auto", probes the link at start-up)
VARIANTS.update({f"{name}_params{kib}": [*VARIANTS[name], "--gift.parameter_piece_kib", str(kib)] for name in ("fp8", "gift") for kib in (0, 128)})
VARIANTS["gift_bf16_stats"] = [*VARIANTS["gift"], "--gift.stats_dtype", "bf16"]
VARIANTS["gift_fp4_bf16_stats"] = [*VARIANTS["gift_fp4"], "--gift.stats_dtype", "bf16"]
# GIFT with a part switched off, to see what each costs: no per-step statistics (the sketch, its
# all-reduce and the factorization: periodic factors, computed at the first step and never
# again, so the codec does all its other work with them; the interval is config.MAX_INT, spelled
# out as above), and no error feedback.
VARIANTS["gift_no_statistics"] = [*VARIANTS["gift"], "--gift.factor_source", "periodic", "--gift.refresh_interval", "2147483647"]
VARIANTS["gift_no_ef"] = [*VARIANTS["gift"], "--gift.no-error_feedback"]
# The statistics summed on the gradients' group, as before they had one of their own (config.stats_group).
VARIANTS["gift_shared_stats_group"] = [*VARIANTS["gift"], "--gift.stats_group", "shared"]
# Whitening by the layer inputs' statistics (config.stats_source; the default is the gradients'
# own, sketched where each gradient exists and waited on before its encoding): sketched after
# the forward, one all-reduce per block, shared by the layers that read one input.
VARIANTS["gift_input_stats"] = [*VARIANTS["gift"], "--gift.stats_source", "inputs"]
VARIANTS["gift_fp4_input_stats"] = [*VARIANTS["gift_fp4"], "--gift.stats_source", "inputs"]
# One quantized all_to_all / all_gather per gradient instead of one per block (config.bucket).
VARIANTS.update({f"{name}_per_gradient": [*VARIANTS[name], "--gift.no-bucket"] for name in ("fp8", "gift")})
DEFAULT_VARIANTS = ["fp32", "bf16", "fp8", "gift"]


def missing_requirements() -> list[str]:
    """What this machine lacks to run the benchmark (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root: network namespaces and tc need CAP_NET_ADMIN (run it with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (Debian/Ubuntu package iproute2)")
    return missing


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


class ShapedLink:
    """Two network namespaces joined by a veth pair (``a`` <-> ``b``), removed on exit.

    ``shape(rate_mbit)`` puts a token bucket on both ends (egress: each direction is shaped
    once); ``None`` leaves the link unshaped.
    """

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.tag = tag
        self.namespaces = (f"gift{tag}a", f"gift{tag}b")
        self.devices = (f"gv{tag}a"[-15:], f"gv{tag}b"[-15:])  # interface names: 15 characters at most
        subnet = int(tag) % 250 + 1 if tag.isdigit() else 1
        self.addresses = (SUBNET.format(subnet, 1), SUBNET.format(subnet, 2))
        self._created = False

    def __enter__(self) -> ShapedLink:
        atexit.register(self.remove)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def on_signal(sig, frame):
            self.remove()
            signal.signal(sig, previous[sig])
            os.kill(os.getpid(), sig)

        for sig in previous:
            signal.signal(sig, on_signal)
        self._created = True
        try:
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            self._join()
        except BaseException:
            self.remove()
            raise
        return self

    def _join(self) -> None:
        """Create the two devices, one in each namespace, addressed and up."""
        _run("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
        for ns, device, address in zip(self.namespaces, self.devices, self.addresses):
            _run("ip", "link", "set", device, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", device)
            _run("ip", "-n", ns, "link", "set", device, "up")

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Delete both namespaces (which deletes the devices in them); safe to call twice."""
        if not self._created:
            return
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created = False

    def shape(self, rate_mbit: float | None) -> None:
        for ns, device in zip(self.namespaces, self.devices):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
            if rate_mbit is not None:
                burst = max(int(rate_mbit * 1e6 / 8 / 100), 32 * 1024)  # 10 ms of traffic, at least 32 KiB
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
                     "burst", str(burst), "latency", "100ms")

    def tx_bytes(self, side: int) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[side], "cat", f"/sys/class/net/{self.devices[side]}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True).stdout
        return int(out)

    def command(self, side: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[side], *argv]


TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


class DelayedLink(ShapedLink):
    """Two namespaces joined through a delay line: a TUN device in each, and a forwarder process
    that holds every packet for ``one_way_ms`` before passing it to the other side.

    netem would do this in the kernel, but kernels without ``sch_netem`` (this machine's) are
    common in containers, and TUN is nearly always there. The token bucket of ``shape`` still
    shapes each TUN device's egress, that is the packets on their way into the delay line.
    The forwarder runs at a raised priority (it stands in for the network, not for the job) and
    its own cost adds a fraction of a millisecond to the round trip: ``round_trip_ms`` measures
    what the link really has.
    """

    MTU = 9000  # jumbo frames: a TUN device has no segmentation offload, and fewer packets keep the forwarder cheap

    def __init__(self, tag: str | None = None, one_way_ms: float = 1.0) -> None:
        super().__init__(tag)
        self.devices = (f"gt{self.tag}a"[-15:], f"gt{self.tag}b"[-15:])
        self.one_way_ms = one_way_ms
        self._forwarder: subprocess.Popen | None = None

    def _join(self) -> None:
        import fcntl
        import struct

        fds = []
        try:
            for ns, device, address, peer in zip(self.namespaces, self.devices, self.addresses, reversed(self.addresses)):
                fd = os.open("/dev/net/tun", os.O_RDWR)
                fds.append(fd)
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
                _run("ip", "link", "set", device, "netns", ns)  # the open descriptor stays attached to the device
                _run("ip", "-n", ns, "addr", "add", address, "peer", peer, "dev", device)
                _run("ip", "-n", ns, "link", "set", device, "mtu", str(self.MTU), "up")
            self._forwarder = subprocess.Popen(
                [sys.executable, __file__, "--forward", *map(str, fds), str(self.one_way_ms)], pass_fds=fds)
        finally:
            for fd in fds:  # the forwarder holds its own copies
                os.close(fd)

    def remove(self) -> None:
        if self._forwarder is not None:
            self._forwarder.kill()
            self._forwarder.wait()
            self._forwarder = None
        super().remove()


def forward(fds: tuple[int, int], one_way_ms: float) -> None:
    """The delay line's forwarder: each packet read from one TUN device is written to the other
    ``one_way_ms`` after it arrived, in order. Runs until killed."""
    import collections
    import select

    try:
        os.nice(-10)
    except PermissionError:
        pass
    delay = one_way_ms / 1000
    queues = (collections.deque(), collections.deque())  # (due time, packet) per direction
    while True:
        now = time.monotonic()
        for side, queue in enumerate(queues):
            while queue and queue[0][0] <= now:
                os.write(fds[1 - side], queue.popleft()[1])
        due = [queue[0][0] for queue in queues if queue]
        ready, _, _ = select.select(fds, [], [], max(0.0, min(due) - time.monotonic()) if due else None)
        arrived = time.monotonic()
        for fd in ready:
            queues[fds.index(fd)].append((arrived + delay, os.read(fd, 65536)))


def round_trip_ms(link: ShapedLink, port: int, pings: int = 50) -> float:
    """The median TCP round trip between the two namespaces (1 byte there and back, Nagle off)."""
    address = link.addresses[1]
    echo = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('{address}', {port})); s.listen(1); c, _ = s.accept(); "
            "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\nwhile (b := c.recv(1)): c.sendall(b)")
    ping = ("import socket, statistics, time\nfor _ in range(100):\n    try: c = socket.create_connection"
            f"(('{address}', {port})); break\n    except OSError: time.sleep(0.05)\n"
            "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []\n"
            f"for _ in range({pings}):\n    t = time.perf_counter(); c.sendall(b'p'); c.recv(1); times.append(time.perf_counter() - t)\n"
            "print(statistics.median(times) * 1000)")
    server = subprocess.Popen(link.command(1, [sys.executable, "-c", echo]))
    try:
        out = subprocess.run(link.command(0, [sys.executable, "-c", ping]), check=True, capture_output=True, text=True, timeout=60)
    finally:
        server.kill()
        server.wait()
    return float(out.stdout)


@dataclass
class Result:
    mode: str
    variant: str
    rate: str
    step_s: float
    step_spread: float
    tokens_s: float
    bytes_per_step: float
    losses: list[list[float]]  # [seconds since the first timed step, loss]
    codec_s: float = 0.0
    """GIFT's time meter: the codec's seconds per step (0 for fp32, which runs no codec)."""
    wait_s: float = 0.0
    collectives: int | None = None
    """Collectives the final graph issues per step (GIFT off: the stock graph's; None: not recorded)."""
    retried: int = 0
    """Runs of this cell whose job failed before the one measured (both nodes' logs kept in ``CRASH_LOGS``)."""


def launcher(job: Path, dump: Path, steps: int, extra: list[str], local_batch: int = LOCAL_BATCH) -> list[str]:
    return [sys.executable, "-m", "gift_compile.titan_integration.launcher", str(job), "--dump_folder", str(dump),
            "--training.steps", str(steps), "--training.local_batch_size", str(local_batch), "--metrics.log_freq", "1",
            "--debug.seed", "0", *extra]


def records(dump: Path) -> list[dict]:
    path = dump / "gift_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def meter(recs: list[dict], warmup: int) -> tuple[float, float, int | None]:
    """Mean codec and wait seconds per step from GIFT's time meter, and the collective calls."""
    steps = [r for r in recs if "loss" in r][warmup:]
    codec = [r["gift/codec_s"] for r in steps if r.get("gift/codec_s") is not None]
    wait = [r["gift/comm_wait_s"] for r in steps if r.get("gift/comm_wait_s") is not None]
    calls = steps[-1].get("gift/collectives_per_step") if steps else None
    return (statistics.fmean(codec) if codec else 0.0), (statistics.fmean(wait) if wait else 0.0), calls


def timing(recs: list[dict], warmup: int) -> tuple[float, float, list[tuple[float, float]]]:
    """Mean step time after ``warmup`` steps (a mean, not a median: one step in ten is a meter
    reading with its shadow steps before it, and a median would leave that cost out), the half
    range of the step times, and the loss curve against the time since the first timed step."""
    steps = [r for r in recs if "loss" in r]
    times = [r["time"] for r in steps]
    durations = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :])]
    spread = (max(durations) - min(durations)) / 2 if durations else float("nan")
    curve = [[r["time"] - times[warmup], r["loss"]] for r in steps[warmup:]]
    return (statistics.fmean(durations) if durations else float("nan")), spread, curve


CRASH_LOGS = Path(tempfile.gettempdir()) / "shaped_link_crashes"
ATTEMPTS = 2
"""Runs of a cell before the benchmark gives up: a rank crashes rarely (a ``malloc()`` abort mid-run,
not understood: the README's suite-time paragraph), and one crash should not end a 30-cell run."""


class CellFailed(RuntimeError):
    """A cell's job failed; the message names the file holding both nodes' whole logs."""


def run_pair(link: ShapedLink, mode: str, variant: str, steps: int, workdir: Path, port: int,
             local_batch: int = LOCAL_BATCH) -> tuple[float, float, list, float, tuple]:
    dump = workdir / f"{mode}-{variant}-{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")
    before = link.tx_bytes(0) + link.tx_bytes(1)
    procs = []
    for side in (0, 1):
        flags = ["--nnodes", "2", "--node-rank", str(side), "--master-addr", link.addresses[0], "--master-port", str(port),
                 "--nproc", "1", *MODES[mode], *VARIANTS[variant]]
        procs.append(subprocess.Popen(link.command(side, launcher(JOB, dump, steps, flags, local_batch)), env={**env, "GLOO_SOCKET_IFNAME": link.devices[side]},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        CRASH_LOGS.mkdir(parents=True, exist_ok=True)
        saved = CRASH_LOGS / f"{dump.name}.log"  # whole: a crashed rank's stacks come before torchrun's summary
        saved.write_text("".join(f"===== node {side} (exit {p.returncode})\n{log}" for side, (p, log) in enumerate(zip(procs, logs))))
        raise CellFailed(f"{mode}/{variant} failed (exit codes {[p.returncode for p in procs]}); both nodes' logs: {saved}")
    carried = link.tx_bytes(0) + link.tx_bytes(1) - before
    step_s, spread, curve = timing(records(dump), WARMUP)
    return step_s, spread, curve, carried / 2 / steps, meter(records(dump), WARMUP)


def compute_only(steps: int, workdir: Path, local_batch: int = LOCAL_BATCH) -> float:
    """Per-step time of one rank with the same per-rank batch and no communication."""
    dump = workdir / "compute"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    subprocess.run(launcher(JOB, dump, steps, ["--nproc", "1", "--gift.no-enabled"], local_batch), env=env, check=True, capture_output=True)
    return timing(records(dump), WARMUP)[0]


def find(results: list[Result], mode: str, rate: str, variant: str) -> Result | None:
    return next((r for r in results if (r.mode, r.rate, r.variant) == (mode, rate, variant)), None)


def crossover(results: list[Result], mode: str, variant: str) -> str | None:
    """The highest rate at which ``variant`` beats fp32 in tokens/s (shaped cells without added
    delay); None when no such cell ran beside fp32."""
    compared = [(r, fp32) for r in results if r.mode == mode and r.variant == variant and link_settings(r.rate)[0] is not None
                and not on_delay_line(r.rate) and (fp32 := find(results, mode, r.rate, "fp32")) is not None]
    if not compared:
        return None
    wins = [r.rate for r, fp32 in compared if r.tokens_s > fp32.tokens_s]
    return max(wins, key=float) + " Mbit/s" if wins else "none of the rates measured"


def link_settings(cell: str) -> tuple[float | None, float]:
    """A cell ``"200"``, ``"unshaped"`` or ``"200+2ms"`` (2 ms of added round trip) as
    ``(rate Mbit/s or None, delay each way in ms)``."""
    rate, _, rtt = cell.partition("+")
    return (None if rate == "unshaped" else float(rate)), (float(rtt.removesuffix("ms")) / 2 if rtt else 0.0)


def on_delay_line(cell: str) -> bool:
    """Cells with a '+' (``"200+2ms"``, also ``"200+0ms"``: the delay line's own baseline) run on a
    DelayedLink, the others on the veth."""
    return "+" in cell


def rate_label(rate: str) -> str:
    mbit, delay = link_settings(rate)
    base = "unshaped" if mbit is None else f"{mbit:g} Mbit/s"
    return base + (f" + {2 * delay:g} ms RTT" if on_delay_line(rate) else "")


def wire_s(result: Result) -> float:
    """Seconds the bytes carried per step and direction take at the link's rate (0 unshaped)."""
    mbit, _ = link_settings(result.rate)
    return result.bytes_per_step * 8 / (mbit * 1e6) if mbit else 0.0


def limit_s(result: Result, compute_s: float) -> float:
    """What the link and the CPU allow: the compute with the codec, or the wire, whichever is longer."""
    return max(compute_s + result.codec_s, wire_s(result))


def report(results: list[Result], compute_s: float, tokens_per_step: int, round_trips: dict[str, float]) -> str:
    from tabulate import tabulate

    rows = []
    for r in results:
        fp32 = find(results, r.mode, r.rate, "fp32")
        if fp32 is None:  # no fp32 run at this rate (a --variants subset): nothing to compare with
            vs_fp32 = predicted = bytes_vs_fp32 = "-"
        else:
            # What the bytes alone predict: the compute stays, the rest scales with the bytes carried.
            ratio = r.bytes_per_step / fp32.bytes_per_step
            vs_fp32 = f"{r.tokens_s / fp32.tokens_s:.2f}x"
            predicted = f"{fp32.step_s / (compute_s + (fp32.step_s - compute_s) * ratio):.2f}x"
            bytes_vs_fp32 = f"{ratio:.2f}"
        limit = limit_s(r, compute_s)
        rows.append([r.mode, rate_label(r.rate), r.variant, f"{r.step_s:.2f} ± {r.step_spread:.2f}", f"{limit:.2f}",
                     f"{r.step_s / limit:.2f}x", f"{r.tokens_s:.0f}", vs_fp32, predicted,
                     f"{max(0.0, 1 - compute_s / r.step_s):.0%}", f"{r.codec_s:.3f}", f"{r.wait_s:.3f}",
                     "-" if r.collectives is None else r.collectives, f"{r.bytes_per_step / 2**20:.1f}", bytes_vs_fp32])
    headers = ["mode", "link", "gradients", "step s (mean ± half range)", "limit s", "step / limit", "tokens/s", "vs fp32",
               "vs fp32 predicted by bytes", "beyond compute", "codec s", "wait s", "collectives/step", "MiB/step/direction",
               "bytes vs fp32"]
    lines = [tabulate(rows, headers=headers, tablefmt="github"), "",
             f"Compute alone (1 rank, same per-rank batch): {compute_s:.2f} s/step; {tokens_per_step} tokens per step in all. "
             "'Beyond compute' is the share of the step not explained by that compute (communication, codec, waiting). "
             "'Limit' is what the link and the CPU allow: max(compute alone + the codec's seconds from GIFT's time meter, "
             "the bytes the link carried per step and direction / the link rate); 'codec s' and 'wait s' are GIFT's time "
             "meter (gift/codec_s, gift/comm_wait_s: means over the timed steps; fp32 runs no codec); 'collectives/step' "
             "counts the collectives of the final graph, the same way for every variant (fp32: the stock graph's).", ""]
    if round_trips:
        lines[-1:-1] = ["Idle TCP round trip between the two nodes (median of 50 1-byte pings): " + "; ".join(
            f"{rate_label(cell)} {ms:.2f} ms" for cell, ms in round_trips.items()) + ". Cells with an added round trip run "
            "on a delay line (`DelayedLink`: a TUN device per node, MTU 9000, and a forwarder process that holds each packet; "
            "this kernel has no netem), the others on the veth.", ""]
    retried = [f"{r.mode} {rate_label(r.rate)} {r.variant} ({r.retried} failed run{'s' * (r.retried > 1)})" for r in results if r.retried]
    if retried:
        lines[-1:-1] = ["Measured after a failed run of the same cell (both nodes' logs kept in " + str(CRASH_LOGS) + "): " + "; ".join(retried) + ".", ""]
    for mode in sorted({r.mode for r in results}):
        if any(r.mode == mode and r.variant == "fp32" for r in results):
            fp8, gift = crossover(results, mode, "fp8"), crossover(results, mode, "gift")
            lines.append(f"**{mode}**: " + ("no shaped cell without added delay ran beside fp32: the table compares them."
                                            if fp8 is None and gift is None else
                                            f"FP8 beats fp32 up to {fp8 or 'no cell run'}; GIFT up to {gift or 'no cell run'}."))
        else:
            lines.append(f"**{mode}** (no fp32 run):")
        for rate in dict.fromkeys(r.rate for r in results if r.mode == mode):
            at_rate = [r for r in results if r.mode == mode and r.rate == rate]
            fp8, gift = find(results, mode, rate, "fp8"), find(results, mode, rate, "gift")
            budget = (gift or at_rate[0]).losses[-1][0]
            losses = ", ".join(f"{r.variant} {_loss_at(r.losses, budget):.3f}" for r in at_rate)
            overhead = "".join(
                f"{r.variant} {r.tokens_s / fp8.tokens_s:.2f}x FP8's tokens/s ({r.bytes_per_step / fp8.bytes_per_step:.2f}x its bytes); "
                if "fp4" in r.variant else
                f"{r.variant}'s step {r.step_s / fp8.step_s - 1:+.0%} over FP8's ({r.step_s - fp8.step_s:+.2f} s, "
                f"{r.bytes_per_step / fp8.bytes_per_step:.2f}x its bytes); "
                for r in at_rate if fp8 and r.variant.startswith("gift"))
            excess = {r.variant: reading_step_excess(r.losses) for r in at_rate}
            readings = ", ".join(f"{v} {e:+.3f} s" for v, e in excess.items() if e is not None)
            readings = f"steps with a meter reading against the others' median: {readings}; " if readings else ""
            lines.append(f"- {rate_label(rate)}: {overhead}{readings}loss after {budget:.1f} s of training (GIFT's time for its steps): {losses}")
        lines.append("")
    return "\n".join(lines)


def reading_step_excess(curve: list[list[float]]) -> float | None:
    """How much longer the timed steps on which GIFT's live meter reads (the job's steps
    ``1 + k * meter_interval``, 1-based) take than the others: their mean minus the others'
    median, from a cell's loss curve (one point per step from the first timed one). On an FP8
    cell the same steps are the control. None if no such step was timed."""
    from gift_compile.config import GiftConfig  # after the preflight: this script starts on the standard library alone

    interval = GiftConfig().meter_interval
    durations = {WARMUP + 2 + k: b[0] - a[0] for k, (a, b) in enumerate(zip(curve, curve[1:]))}
    reading = [d for step, d in durations.items() if (step - 1) % interval == 0]
    others = [d for step, d in durations.items() if (step - 1) % interval]
    return statistics.fmean(reading) - statistics.median(others) if reading and others else None


def _loss_at(curve: list[tuple[float, float]], seconds: float) -> float:
    reached = [loss for t, loss in curve if t <= seconds]
    return reached[-1] if reached else curve[0][1]


def plot(results: list[Result], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r.mode for r in results})
    variants = list(dict.fromkeys(r.variant for r in results))
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 8), squeeze=False)
    for col, mode in enumerate(modes):
        ax = axes[0][col]
        for variant in variants:
            runs = [r for r in results if r.mode == mode and r.variant == variant]
            runs = [r for r in runs if not on_delay_line(r.rate)]  # the delay cells are in the table
            xs = [link_settings(r.rate)[0] or 10000.0 for r in runs]
            ax.plot(xs, [r.tokens_s for r in runs], marker="o", label=variant)
        ax.set_xscale("log")
        ax.set_xlabel("link rate, Mbit/s (10000 = unshaped veth)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{mode}: throughput")
        ax.legend()
        ax = axes[1][col]
        shaped = [r for r in results if r.mode == mode and link_settings(r.rate)[0] is not None] or [r for r in results if r.mode == mode]
        slowest = min(shaped, key=lambda r: link_settings(r.rate)[0] or float("inf"))
        for variant in variants:
            run = find(results, mode, slowest.rate, variant)
            if run is None:
                continue
            ax.plot([t for t, _ in run.losses], [loss for _, loss in run.losses], marker=".", label=variant)
        ax.set_xlabel("seconds of training")
        ax.set_ylabel("loss")
        ax.set_title(f"{mode}: loss vs wall-clock at {slowest.rate} Mbit/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["50", "200", "1000", "unshaped", "200+2ms"],
                        help="link cells: a rate in Mbit/s, 'unshaped', or a rate with added round-trip delay ('200+2ms')")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["replicate", "fsdp"])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--steps", type=int, default=12, help="steps per run (the first 2 are compile warm-up, not timed)")
    parser.add_argument("--local-batch-size", type=int, default=LOCAL_BATCH,
                        help=f"sequences of {SEQ_LEN} tokens per rank and step (default {LOCAL_BATCH}, the job's): GIFT's codec "
                             "costs the same per step at any batch, the compute grows with it")
    parser.add_argument("--render", type=Path, help="re-render the table and plots from a saved shaped_link.json")
    parser.add_argument("--results", default="shaped_link",
                        help="stem of the result files in benchmarks/results (default: shaped_link; --merge adds to it)")
    parser.add_argument("--merge", action="store_true",
                        help="add this run's cells to benchmarks/results/shaped_link.json (replacing cells measured again) "
                             "instead of starting a new table")
    args = parser.parse_args()
    if args.render:
        render(json.loads(args.render.read_text()), args.render.stem)
        return 0
    saved = RESULTS / f"{args.results}.json"
    try:
        previous = table_to_merge(saved, args.local_batch_size) if args.merge else None
    except ValueError as error:
        parser.error(str(error))
    missing = missing_requirements()
    if missing:
        print("shaped_link.py cannot run here; it needs:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    results: list[Result] = []
    raw: dict = {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    round_trips: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        links: dict[float | None, ShapedLink] = {None: stack.enter_context(ShapedLink())}  # one-way delay (None: veth) -> link

        def link_for(cell: str) -> ShapedLink:
            """The veth for plain cells; a delay line (one per delay) for cells with '+'."""
            one_way = link_settings(cell)[1] if "+" in cell else None
            if one_way not in links:
                links[one_way] = stack.enter_context(DelayedLink(f"{os.getpid()}{len(links)}", one_way))
            return links[one_way]

        workdir = Path(tmp)
        compute_s = compute_only(args.steps, workdir, args.local_batch_size)
        print(f"compute alone: {compute_s:.2f} s/step", flush=True)
        port = 29700
        for rate in args.rates:
            link = link_for(rate)
            link.shape(link_settings(rate)[0])
            port += 1
            round_trips[rate] = round_trip_ms(link, port)
            print(f"{rate_label(rate)}: idle round trip {round_trips[rate]:.2f} ms", flush=True)
            for mode in args.modes:
                for variant in args.variants:
                    started = time.time()
                    for attempt in range(ATTEMPTS):
                        port += 1
                        try:
                            step_s, spread, curve, per_step, (codec_s, wait_s, calls) = run_pair(link, mode, variant, args.steps, workdir, port, args.local_batch_size)
                            break
                        except CellFailed as failure:
                            if attempt + 1 == ATTEMPTS:
                                raise
                            print(f"  {mode:9s} {rate:>8s} {variant:5s}: {failure}; running it again", flush=True)
                    tokens = tokens_per_step(args.local_batch_size)
                    results.append(Result(mode, variant, rate, step_s, spread, tokens / step_s, per_step, curve, codec_s, wait_s, calls,
                                          retried=attempt))
                    print(f"  {mode:9s} {rate:>8s} {variant:5s}: {step_s:.2f} s/step, {tokens / step_s:.0f} tokens/s, "
                          f"{per_step / 2**20:.1f} MiB/step/direction ({time.time() - started:.0f} s)", flush=True)
                    # saved after every run: a crash or Ctrl-C keeps what was measured
                    raw = {"compute_s": compute_s, "local_batch_size": args.local_batch_size, "round_trip_ms": round_trips,
                           "results": [dataclasses.asdict(r) for r in results]}
                    raw = merged(previous, raw) if previous else raw
                    saved.write_text(json.dumps(raw))
    if raw:
        render(raw, args.results)
    return 0


def table_to_merge(saved: Path, local_batch: int) -> dict | None:
    """The saved table ``--merge`` adds to (None: there is none yet). Its cells and limits hold for
    one per-rank batch (tables saved before ``--local-batch-size`` existed ran the job's), so a
    run with another batch is refused: ``ValueError``."""
    if not saved.exists():
        return None
    previous = json.loads(saved.read_text())
    measured = previous.get("local_batch_size", LOCAL_BATCH)
    if measured != local_batch:
        raise ValueError(f"--merge: {saved} was measured with --local-batch-size {measured}, this run asks for {local_batch}; "
                         "one table holds one batch (name another with --results)")
    return previous


def merged(old: dict, new: dict) -> dict:
    """``new``'s cells added to ``old``'s; a cell measured in both keeps ``new``'s figures. The
    compute-only time is ``old``'s, so that every limit in one table uses one baseline."""
    key = lambda r: (r["mode"], r["rate"], r["variant"])
    fresh = {key(r) for r in new["results"]}
    return {"compute_s": old["compute_s"], "local_batch_size": new["local_batch_size"], "round_trip_ms": {**old.get("round_trip_ms", {}), **new["round_trip_ms"]},
            "results": [r for r in old["results"] if key(r) not in fresh] + new["results"]}


def render(raw: dict, stem: str = "shaped_link") -> None:
    results = [Result(**r) for r in raw["results"]]
    text = report(results, raw["compute_s"], tokens_per_step(raw.get("local_batch_size", LOCAL_BATCH)), raw.get("round_trip_ms", {}))
    print("\n" + text)
    (RESULTS / f"{stem}.md").write_text("# Training over a shaped link (`sudo python benchmarks/shaped_link.py`)\n\n" + text + "\n")
    plot(results, RESULTS / f"{stem}.png")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--forward"]:  # the forwarder process of a DelayedLink
        forward((int(sys.argv[2]), int(sys.argv[3])), float(sys.argv[4]))
    sys.exit(main())
