"""Where a step's link time goes (``sudo python benchmarks/link_trace.py``).

``shaped_link.py``'s limit divides the bytes a step carries by the link's rate; a step that
takes longer left the link unused for the difference. This benchmark runs one cell of that
grid (the same two network namespaces, shaped veth and torchtitan job) with a sampler in each
namespace reading the veth's transmit counter every ``--sample-ms``, and splits each timed
step's unused link time, per direction, into

* **idle**: time bins in which the direction carried (nearly) nothing: no collective had bytes
  to send, because what it sends had not been computed yet or a dependency held it back;
* **slow**: time bins in which bytes moved, but below the link's rate: a collective was in
  flight and did not fill the link (gloo's per-call rate, TCP, a round trip).

The two need different fixes (schedule vs transport), so the split says which to work on. It
prints each variant's per-step split, a strip of the first timed steps (one character per bin:
``#`` the link full, ``+`` partly used, ``.`` idle; ``|`` where a step ends), and writes the
same to ``benchmarks/results/<--results>.md`` with a plot of the rate over time (``.png``).

    sudo python benchmarks/link_trace.py                              # FSDP, 200 Mbit/s, fp8 and gift
    sudo python benchmarks/link_trace.py --mode replicate --rate 50 --variants fp8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from shaped_link import MODES, RESULTS, VARIANTS, ShapedLink, missing_requirements, records, run_pair

# Runs in each namespace: the device's transmit counter (sysfs re-reads it on every read at
# offset 0) with the wall clock the job's step records use, until the benchmark kills it.
SAMPLER = """
import sys, time
period = float(sys.argv[2])
with open(sys.argv[1], "rb", buffering=0) as counter, open(sys.argv[3], "w") as out:
    while True:
        counter.seek(0)
        out.write(f"{time.time():.6f} {int(counter.read())}\\n")
        out.flush()
        time.sleep(period)
"""

FULL = 0.9  # a bin that carried at least this share of the link's rate counts as full
IDLE = 0.05  # ... at most this share, as idle


@dataclass
class StepSplit:
    """One timed step of one direction: seconds of the step, bytes carried, and the unused link
    time (step minus bytes / rate) split by the kind of bin it fell in."""

    step_s: float
    wire_s: float
    idle_s: float
    slow_s: float


def start_sampler(link: ShapedLink, side: int, out: Path, period_s: float) -> subprocess.Popen:
    counter = f"/sys/class/net/{link.devices[side]}/statistics/tx_bytes"
    return subprocess.Popen(link.command(side, [sys.executable, "-c", SAMPLER, counter, str(period_s), str(out)]))


def load(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rows = [line.split() for line in path.read_text().splitlines() if len(line.split()) == 2]
    data = np.array(rows, dtype=np.float64)
    return data[:, 0], data[:, 1]


def bin_rates(times: np.ndarray, carried: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bytes per second in each bin between ``edges``, from the cumulative counter interpolated
    at the edges (a sample lands a few ms late now and then; interpolation spreads it)."""
    at_edges = np.interp(edges, times, carried)
    return np.diff(at_edges) / np.diff(edges)


def split_step(rates: np.ndarray, bin_s: float, link_bytes_s: float) -> StepSplit:
    share = np.clip(rates / link_bytes_s, 0.0, 1.0)
    idle = share <= IDLE
    full = share >= FULL
    slow = ~idle & ~full
    return StepSplit(
        step_s=len(rates) * bin_s,
        wire_s=float(rates.sum() * bin_s / link_bytes_s),
        idle_s=float(idle.sum() * bin_s),
        slow_s=float(((1.0 - share) * slow).sum() * bin_s),
    )


def strip(rates: np.ndarray, link_bytes_s: float) -> str:
    share = rates / link_bytes_s
    return "".join("#" if s >= FULL else "." if s <= IDLE else "+" for s in share)


KIND_MARKS = {"compute": "=", "codec": "c", "wait": "w", "end": " "}


def kind_strip(path: Path, edges: np.ndarray) -> str:
    """What a rank's time meter said it was doing at each bin's middle (``timing.py``'s trace:
    ``=`` compute, other collectives' waits included; ``c`` GIFT's codec; ``w`` waiting for a
    gradient collective; blank: between steps, the optimizer and logging)."""
    rows = [row for row in (line.split() for line in path.read_text().splitlines()) if row[1] in KIND_MARKS]  # not the marks
    times = np.array([float(t) for t, _ in rows])
    kinds = [kind for _, kind in rows]
    middles = (edges[:-1] + edges[1:]) / 2
    at = np.searchsorted(times, middles, side="right") - 1
    return "".join(KIND_MARKS[kinds[i]] if i >= 0 else " " for i in at)


def backward_marks(paths: list[Path]) -> np.ndarray:
    """The wall times at which any rank's graph reached its first backward node, sorted
    (``timing.mark``; graph_trainer's joint graph with GIFT's passes)."""
    rows = [line.split() for path in paths for line in path.read_text().splitlines()]
    return np.sort(np.array([float(t) for t, label in rows if label == "backward"]))


def phases(times: np.ndarray, carried: np.ndarray, start: float, end: float, backward: np.ndarray, link_bytes_s: float) -> tuple | None:
    """``(forward s, its wire s, backward s, its wire s)`` of one step: the backward (and the
    optimizer after it) starts at the step's first backward mark; None without one (fp32 runs
    no GIFT pass, so no marks)."""
    inside = backward[(backward >= start) & (backward < end)]
    if not len(inside):
        return None
    at = np.interp([start, inside[0], end], times, carried)
    return inside[0] - start, (at[1] - at[0]) / link_bytes_s, end - inside[0], (at[2] - at[1]) / link_bytes_s


def trace(link: ShapedLink, mode: str, variant: str, rate_mbit: float, steps: int, workdir: Path, port: int,
          bin_ms: float, sample_ms: float) -> dict:
    samples = [workdir / f"{mode}-{variant}-side{side}.txt" for side in (0, 1)]
    ticks = workdir / f"{mode}-{variant}-ticks"
    samplers = [start_sampler(link, side, path, sample_ms / 1000) for side, path in enumerate(samples)]
    os.environ["GIFT_TIME_TRACE"] = str(ticks)
    try:
        step_s, *_ = run_pair(link, mode, variant, steps, workdir, port)
    finally:
        del os.environ["GIFT_TIME_TRACE"]
        for sampler in samplers:
            sampler.kill()
            sampler.wait()
    ends = [r["time"] for r in records(workdir / f"{mode}-{variant}-{port}") if "loss" in r]
    timed = ends[2:]  # the first two steps compile
    link_bytes_s = rate_mbit * 1e6 / 8
    bin_s = bin_ms / 1000
    tick_files = sorted(ticks.parent.glob(ticks.name + ".*"))
    backward = backward_marks(tick_files)
    directions = {}
    for side, path in enumerate(samples):
        times, carried = load(path)
        splits, strips, step_phases = [], [], []
        for start, end in zip(timed, timed[1:]):
            edges = np.arange(start, end + bin_s / 2, bin_s)
            rates = bin_rates(times, carried, edges)
            splits.append(split_step(rates, bin_s, link_bytes_s))
            strips.append(strip(rates, link_bytes_s))
            step_phases.append(phases(times, carried, start, end, backward, link_bytes_s))
        window = np.arange(timed[0], timed[-1], bin_s)
        directions[f"node {side} -> {1 - side}"] = {
            "splits": splits,
            "phases": [p for p in step_phases if p is not None],
            "strip": "|".join(strips[:2]) + "|",
            "curve": (window[:-1] - timed[0], bin_rates(times, carried, window) / link_bytes_s),
        }
    kinds = {f"rank pid {path.suffix[1:]}": "|".join(kind_strip(path, np.arange(a, b + bin_s / 2, bin_s)) for a, b in zip(timed[:2], timed[1:3])) + "|"
             for path in tick_files}
    return {"step_s": step_s, "ends": [t - timed[0] for t in timed], "directions": directions, "kinds": kinds}


def mean_split(splits: list[StepSplit]) -> StepSplit:
    return StepSplit(*(statistics.fmean(getattr(s, name) for s in splits) for name in ("step_s", "wire_s", "idle_s", "slow_s")))


def report(traces: dict[str, dict], mode: str, rate_mbit: float, bin_ms: float) -> str:
    lines = [f"# Where the link time goes: {mode}, {rate_mbit:g} Mbit/s (`sudo python benchmarks/link_trace.py`)", "",
             "Per timed step and direction (means): the step, the bytes carried / the link's rate ('wire'), and the link "
             f"time left unused (step - wire), split into idle bins (<= {IDLE:.0%} of the rate: nothing to send) and the "
             f"shortfall of slow bins (between {IDLE:.0%} and {FULL:.0%}: bytes in flight below the rate); full bins "
             f"(>= {FULL:.0%}) contribute their small shortfall to neither. Bins of {bin_ms:g} ms.", "",
             "| variant | direction | step s | wire s | unused s | idle s | slow s | idle share of unused |",
             "|---|---|---|---|---|---|---|---|"]
    for variant, traced in traces.items():
        for direction, data in traced["directions"].items():
            m = mean_split(data["splits"])
            unused = m.step_s - m.wire_s
            lines.append(f"| {variant} | {direction} | {m.step_s:.2f} | {m.wire_s:.2f} | {unused:.2f} | {m.idle_s:.2f} | "
                         f"{m.slow_s:.2f} | {m.idle_s / unused:.0%} |" if unused > 0 else
                         f"| {variant} | {direction} | {m.step_s:.2f} | {m.wire_s:.2f} | {unused:.2f} | - | - | - |")
    lines += ["", "Forward and backward (means): the backward, with the optimizer after it, starts where the first rank "
              "reached its graph's first backward node (fp32 runs no GIFT pass: not split); each phase's wire is the bytes "
              "it carried / the link's rate. A phase whose wire is close to its length waits on the link; one whose wire "
              "is far below it waits on compute.", "",
              "| variant | direction | forward s | its wire s | backward s | its wire s |", "|---|---|---|---|---|---|"]
    for variant, traced in traces.items():
        for direction, data in traced["directions"].items():
            if data["phases"]:
                f, fw, b, bw = (statistics.fmean(p[i] for p in data["phases"]) for i in range(4))
                lines.append(f"| {variant} | {direction} | {f:.2f} | {fw:.2f} | {b:.2f} | {bw:.2f} |")
    lines += ["", f"The first two timed steps, one character per {bin_ms:g} ms bin (`#` full, `+` partly used, `.` idle; "
              "`|` a step's end, when rank 0 logged it):", ""]
    lines += [f"Below each, what each rank's time meter said it was doing (`=` compute, the parameter all-gathers' waits "
              "included; `c` GIFT's codec; `w` waiting for a gradient collective; blank: between steps):", ""]
    for variant, traced in traces.items():
        lines += [f"{variant}:", "", "```"]
        lines += [f"{direction:13s} {data['strip']}" for direction, data in traced["directions"].items()]
        lines += [f"{rank:13s} {strip_}" for rank, strip_ in traced["kinds"].items()]
        lines += ["```", ""]
    return "\n".join(lines) + "\n"


def plot(traces: dict[str, dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 3 * len(traces)), squeeze=False)
    for ax, (variant, traced) in zip(axes[:, 0], traces.items()):
        for direction, data in traced["directions"].items():
            t, share = data["curve"]
            ax.plot(t, share, lw=0.8, label=direction)
        for end in traced["ends"]:
            ax.axvline(end, color="k", lw=0.5, ls=":")
        ax.set_xlim(0, traced["ends"][min(3, len(traced["ends"]) - 1)])
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("share of link rate")
        ax.set_title(f"{title}: {variant} (dotted: step ends)")
        ax.legend(loc="lower right")
    axes[-1, 0].set_xlabel("seconds since the first timed step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=list(MODES), default="fsdp")
    parser.add_argument("--rate", type=float, default=200.0, help="link rate, Mbit/s")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["fp8", "gift"])
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first 2 are compile warm-up, not timed)")
    parser.add_argument("--bin-ms", type=float, default=10.0)
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--results", default="link_trace", help="stem of the result files in benchmarks/results")
    args = parser.parse_args()
    if args.steps < 5:
        parser.error("--steps must be at least 5: two compile, and a split needs two timed steps")
    missing = missing_requirements()
    if missing:
        print("link_trace.py cannot run here; it needs:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    traces = {}
    with tempfile.TemporaryDirectory() as tmp, ShapedLink() as link:
        link.shape(args.rate)
        for number, variant in enumerate(args.variants):
            started = time.time()
            traces[variant] = trace(link, args.mode, variant, args.rate, args.steps, Path(tmp), 29800 + number,
                                    args.bin_ms, args.sample_ms)
            print(f"{variant}: {traces[variant]['step_s']:.2f} s/step ({time.time() - started:.0f} s)", flush=True)
    text = report(traces, args.mode, args.rate, args.bin_ms)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.results}.md").write_text(text)
    plot(traces, RESULTS / f"{args.results}.png", f"{args.mode}, {args.rate:g} Mbit/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
