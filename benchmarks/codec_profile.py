"""Where GIFT's extra codec time goes in the main job: the host time of every ``gift::`` op.

    python benchmarks/codec_profile.py                  # replicate mode, FP8 and GIFT, 40 steps
    python benchmarks/codec_profile.py --modes fsdp --variants fp8 gift gift_fp4

Runs the main job (``examples/llama3_debug_cpu.toml``: graph_trainer, 2 ranks on this machine's
loopback) once per variant, side by side, with a host timer around the body of every ``gift::``
custom op. The timers come from a ``sitecustomize`` put on the ranks' ``PYTHONPATH``, which wraps
each function registered under ``gift::`` before it is registered: the library runs unchanged.
For each op it prints calls per step, the median time per call (wall, and the calling thread's
CPU time: equal when the rank is not preempted) and milliseconds per step, beside GIFT's time
meter (``gift/codec_s``: every segment of the step that GIFT added, the compiled codec included).

Then the two costliest ops alone, on the job's shapes (``d_in`` 256, rank 32, 512 tokens per
rank), warm (called back to back) and each time right after a GEMM the size of one in the
model's backward, where each layer's ops follow its weight-gradient GEMM. On this machine a core
runs everything more slowly for a while after a long GEMM (wall time and CPU time alike), so an
op's cost inside training is not its cost in a loop; that is why the pass runs a step's
factorizations back to back (``gift_collectives.gather_factorizations``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import median_seconds
from shaped_link import JOB, LOCAL_BATCH, MODES, RESULTS, SEQ_LEN, VARIANTS, launcher, meter, records, timing

WARMUP_STEPS = 10
"""Steps left out of every figure: the first compiles, and the meter's first readings start its windows."""

OP_TIMER = '''\
"""Written by benchmarks/codec_profile.py: a host timer around every gift:: op of this process."""
import os

if os.environ.get("GIFT_OP_TIMES"):
    import functools
    import json
    import time

    import torch

    import atexit

    _register = torch.library.custom_op
    _records = []  # (step, op, wall s, thread CPU s)
    _step = [0]

    def _write():
        if not _records:  # a process that ran no gift:: op (the launcher, torchrun's agent) writes nothing
            return
        path = os.path.join(os.environ["GIFT_OP_TIMES"], "rank%s.json" % os.environ.get("RANK", "0"))
        with open(path, "w") as out:
            json.dump(_records, out)

    atexit.register(_write)  # a torchtitan rank ends without atexit (entry.exit_now): it writes as its last step starts

    def _timed(name, fn):
        @functools.wraps(fn)  # keeps the signature the op's schema is inferred from
        def run(*args, **kwargs):
            if name == "gift::agree":  # the first op of every graph: once per step
                _step[0] += 1
                if _step[0] == int(os.environ.get("GIFT_OP_TIMES_STEPS", 0)):  # its last step starts: write the rest
                    _write()
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                _records.append((_step[0], name, time.perf_counter() - wall, time.thread_time() - cpu))
        return run

    def _custom_op(name, fn=None, /, **kwargs):
        def register(f):
            return _register(name, _timed(name, f) if name.startswith("gift::") else f, **kwargs)
        return register if fn is None else register(fn)

    torch.library.custom_op = _custom_op
'''


def op_table(records_: list, first_step: int) -> tuple[int, dict[str, dict[str, float]]]:
    """Per op, from one rank's ``(step, op, wall, cpu)`` records of steps ``>= first_step``:
    calls per step, median wall and CPU microseconds per call, wall milliseconds per step."""
    kept = [r for r in records_ if r[0] >= first_step]
    steps = len({r[0] for r in kept})
    table = {}
    for name in sorted({r[1] for r in kept}):
        walls = [r[2] for r in kept if r[1] == name]
        cpus = [r[3] for r in kept if r[1] == name]
        table[name] = {"calls_per_step": len(walls) / steps, "median_us": statistics.median(walls) * 1e6,
                       "median_cpu_us": statistics.median(cpus) * 1e6, "ms_per_step": sum(walls) / steps * 1e3}
    return steps, table


def profile(mode: str, variant: str, steps: int, workdir: Path) -> dict:
    """One job of ``variant`` with the op timers; rank 0's table and the time meter's means."""
    probe, times, dump = workdir / "probe", workdir / f"{mode}-{variant}-times", workdir / f"{mode}-{variant}"
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_text(OP_TIMER)
    times.mkdir()
    env = dict(os.environ, GIFT_OP_TIMES=str(times), GIFT_OP_TIMES_STEPS=str(steps), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")])))
    job = subprocess.run(launcher(JOB, dump, steps, ["--nproc", "2", *MODES[mode], *VARIANTS[variant]]), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if job.returncode:
        raise RuntimeError(f"{mode}/{variant} failed (exit {job.returncode}):\n{job.stdout[-3000:]}")
    measured, ops = op_table(json.loads((times / "rank0.json").read_text()), WARMUP_STEPS)
    if not measured:
        raise RuntimeError(f"{mode}/{variant}: rank 0 timed no gift:: op after step {WARMUP_STEPS}")
    codec_s, wait_s, _ = meter(records(dump), warmup=WARMUP_STEPS)
    step_s = timing(records(dump), warmup=WARMUP_STEPS)[0]
    return {"mode": mode, "variant": variant, "steps": measured, "step_s": step_s, "codec_s": codec_s, "wait_s": wait_s, "ops": ops}


TOKENS_PER_RANK = LOCAL_BATCH * SEQ_LEN
"""The job's tokens per rank and step (``examples/llama3_debug_cpu.toml``)."""


def statistics_ops(d_out: int, d_in: int):
    """The default config's per-step statistics of one whitened layer, as ``{op name: call}`` on
    the job's sizes: the sketch (of the ``d_out x d_in`` gradient, or with input statistics of
    the layer's input) and the factorization from it (Nystrom for gradient statistics)."""
    import torch

    from gift_compile.config import GiftConfig
    from gift_compile.geometry import initial_basis, input_sketch, whitening_from_sketch

    config = GiftConfig()
    gradients = config.statistics == "gradients"
    rows = torch.randn(d_out if gradients else TOKENS_PER_RANK, d_in) @ torch.randn(d_in, d_in)
    basis, scale, damping = initial_basis(d_in, config.factor_rank(d_in)), torch.ones(()), torch.tensor(config.damping)
    sketch = input_sketch(rows, basis, scale, None)
    return {"gift::input_sketch": lambda: input_sketch(rows, basis, scale, None),
            "gift::whitening_from_sketches": lambda: whitening_from_sketch(sketch, basis, scale, damping, nystrom=gradients)}


def alone(repeats: int = 200) -> tuple[dict[str, float], list[tuple[str, float, dict[str, float]]]]:
    """The factorization and the sketch on the job's largest whitened layer (wqkv, 768 x 256):
    median microseconds warm (called back to back), and per GEMM shape, the GEMM's milliseconds
    and the ops' medians right after it."""
    import torch

    torch.set_num_threads(1)
    d, tokens = 256, TOKENS_PER_RANK
    ops = statistics_ops(3 * d, d)
    warm = {name: median_seconds(op, repeats) * 1e6 for name, op in ops.items()}
    rows = []
    # weight-gradient GEMMs of the backward (dY^T X): the debug model's wqkv, and one 2x longer
    for m, k, n in ((768, tokens, d), (2048, tokens, d)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        gemm_ms = median_seconds(lambda: a @ b, repeats=1) * 1e3
        after = {}
        for name, op in ops.items():
            times = []
            for _ in range(repeats):
                a @ b
                start = time.perf_counter()
                op()
                times.append(time.perf_counter() - start)
            after[name] = statistics.median(times) * 1e6
        rows.append((f"{m}x{k} @ {k}x{n}", gemm_ms, after))
    return warm, rows


def whitened_shapes() -> list[tuple[int, int]]:
    """``(d_out, d_in)`` of every layer the main job whitens: its model built on the meta device,
    its job file's ``[gift] layers``."""
    import tomllib

    import torch

    from gift_compile.selection import linear_weight_shapes, select_layers
    from gift_compile.titan_integration.job_configs import llama3_debug

    patterns = tomllib.loads(JOB.read_text())["gift"]["layers"]
    if patterns == "auto":
        raise ValueError(f"{JOB} picks its layers by profiling ('auto'); the floor needs them named")
    with torch.device("meta"):
        shapes = linear_weight_shapes(llama3_debug().model_spec.model.build())
    return [shapes[fqn] for fqn in select_layers(shapes, patterns)]


def reduction_gemms(rank: int, world: int, shapes: list[tuple[int, int]], collective: str) -> list[list[tuple[int, int, int]]]:
    """On each of ``world`` ranks: the ``(m, k, n)`` of every GEMM in GIFT's reduction of one
    gradient of each shape (``comm.quantized_reduce``, the default config's plan on ``collective``:
    error feedback, the all-reduce's second stage), recorded by a dispatch mode as they run."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from gift_compile.comm import gather_residual_shape, quantized_reduce
    from gift_compile.config import GiftConfig
    from gift_compile.geometry import identity_whitening
    from gift_compile.layer_step import LayerPlan

    class GemmLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.gemms = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                self.gemms.append((args[0].shape[0], args[0].shape[1], args[1].shape[1]))
            elif func in (torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
                raise RuntimeError(f"reduction_gemms counts aten.mm only, the reduction ran {func}")
            return func(*args, **(kwargs or {}))

    config, group = GiftConfig(layers=["x"]), dist.group.WORLD
    logged = []
    for d_out, d_in in shapes:
        plan = LayerPlan.of("x", d_out, d_in, config, whitened=True, collective=collective, op="avg", group_name=group.group_name)
        whitening = identity_whitening(config.whitening_layout, d_in, plan.low_rank)  # the GEMMs' shapes do not depend on T's values
        residual = torch.zeros(d_out, d_in) if plan.plan.error_feedback else None
        gather = torch.zeros(gather_residual_shape((d_out, d_in), group)) if plan.plan.gather_error_feedback else None
        with GemmLog() as log:
            quantized_reduce(torch.randn(d_out, d_in), whitening, residual, gather, **plan.reduction)
        logged.append(log.gemms)
    return logged


def floor(mode: str, repeats: int = 50) -> list[dict]:
    """What GIFT computes per step beyond FP8's codec in the main job, each part timed warm on one
    thread (the lower bound on GIFT's codec over FP8's: no state op, memory pass or collective
    counted): per whitened layer shape, the GEMMs of its reduction (:func:`reduction_gemms`, run
    on 2 gloo ranks) and its statistics (:func:`statistics_ops`)."""
    from collections import Counter

    import torch

    from gift_compile.config import GiftConfig
    from gift_compile.testing.ranks import run_on_ranks

    collective = "all_reduce" if mode == "replicate" else "reduce_scatter"
    counts = Counter(whitened_shapes())
    gemms = run_on_ranks(reduction_gemms, 2, list(counts), collective)[0]
    torch.set_num_threads(1)
    rows = []
    for (d_out, d_in), layer_gemms in zip(counts, gemms):
        gemm_ms = 0.0
        for m, k, n in layer_gemms:
            a, b = torch.randn(m, k), torch.randn(k, n)
            gemm_ms += median_seconds(lambda: a @ b, repeats) * 1e3
        statistics_ms = sum(median_seconds(op, repeats) for op in statistics_ops(d_out, d_in).values()) * 1e3
        rank = GiftConfig().factor_rank(d_in)
        rows.append({"shape": (d_out, d_in), "layers": counts[(d_out, d_in)], "gemms": len(layer_gemms),
                     "rank": rank, "macs_units": sum(m * k * n for m, k, n in layer_gemms) / (d_out * d_in * rank),
                     "gemm_ms": gemm_ms, "statistics_ms": statistics_ms})
    return rows


def gift_ops_ms(run: dict) -> float:
    """Milliseconds per step in ``gift::`` ops, all of them."""
    return sum(o["ms_per_step"] for o in run["ops"].values())


def floor_lines(mode: str, rows: list[dict], fp8: dict | None) -> list[str]:
    """The floor's table for ``mode`` and what it means against FP8's step of this run."""
    lines = [f"## {mode}: GIFT's arithmetic beyond FP8's codec, warm (one thread; a floor)", "",
             "| whitened layer (d_out x d_in) | layers | GEMMs in its reduction | their MACs / (d_out d_in r) "
             "| GEMMs ms | sketch + factorization ms | ms per step |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        per_step = row["layers"] * (row["gemm_ms"] + row["statistics_ms"])
        lines.append(f"| {row['shape'][0]} x {row['shape'][1]} | {row['layers']} | {row['gemms']} | {row['macs_units']:.1f} "
                     f"| {row['gemm_ms']:.2f} | {row['statistics_ms']:.2f} | {per_step:.1f} |")
    total_ms = sum(row["layers"] * (row["gemm_ms"] + row["statistics_ms"]) for row in rows)
    units, rank = rows[0]["macs_units"] + 2, rows[0]["rank"]  # + the sketch's two products: G Q, then G^T (G Q)
    lines.append("")
    if fp8 is not None:
        lines.append(f"* {total_ms:.1f} ms/step: {total_ms / 1e3 / fp8['step_s']:.1%} of FP8's step in this run "
                     f"({fp8['step_s']:.3f} s). Whatever its state ops and memory passes cost, GIFT's step cannot come "
                     "closer to FP8's than that on this CPU at this batch.")
    lines.append(f"* Per whitened layer its GEMMs and sketch are {units:.0f} d_out d_in r multiply-adds a step, the layer's own "
                 f"forward and backward 3 x tokens x d_out d_in: {units:.0f} r / (3 x {TOKENS_PER_RANK}) = "
                 f"{units * rank / (3 * TOKENS_PER_RANK):.0%} of them at r = {rank} and this job's {TOKENS_PER_RANK} tokens per rank. "
                 "GIFT's arithmetic is the same at any batch; the model's grows with the tokens.")
    return lines + [""]


def report(runs: list[dict], warm: dict[str, float], after_gemm: list, floors: dict[str, list[dict]]) -> str:
    lines = [f"# GIFT's codec, op by op (`python benchmarks/codec_profile.py`)", "",
             f"The main job, 2 ranks on this machine's loopback, each variant one job of {runs[0]['steps'] + WARMUP_STEPS} steps "
             f"(figures over its last {runs[0]['steps']}, rank 0). `median us`: one call's host time (wall; `cpu`: the "
             "calling thread's CPU time); `ms/step`: all calls of a step. `codec s` and `wait s` are GIFT's time meter "
             "(`gift/codec_s`, `gift/comm_wait_s`), `step s` the mean step.", ""]
    for run in runs:
        lines += [f"## {run['mode']}, {run['variant']}: step {run['step_s']:.3f} s, codec {run['codec_s']:.3f} s, "
                  f"wait {run['wait_s']:.3f} s; gift:: ops {gift_ops_ms(run):.1f} ms/step", "",
                  "| op | calls/step | median us | cpu us | ms/step |", "|---|---|---|---|---|"]
        for name, o in sorted(run["ops"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
            lines.append(f"| `{name}` | {o['calls_per_step']:.1f} | {o['median_us']:.0f} | {o['median_cpu_us']:.0f} | {o['ms_per_step']:.2f} |")
        lines.append("")
    by = {(r["mode"], r["variant"]): r for r in runs}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        base = by.get((mode, "fp8"))
        if base is None:
            continue
        for run in (r for r in runs if r["mode"] == mode and r["variant"] != "fp8"):
            extra = (run["codec_s"] - base["codec_s"]) * 1e3
            lines.append(f"* {mode}: {run['variant']}'s codec takes {extra:+.1f} ms/step over FP8's (time meter); its gift:: ops "
                         f"{gift_ops_ms(run) - gift_ops_ms(base):+.1f} ms of it, the rest is the compiled codec and the collectives' issue. "
                         f"Step {run['step_s'] / base['step_s'] - 1:+.1%} over FP8's.")
    lines.append("")
    for mode, rows in floors.items():
        lines += floor_lines(mode, rows, by.get((mode, "fp8")))
    lines += ["## The two costliest ops alone (one thread; median of 200 calls, microseconds; the largest whitened layer)", "",
              "| op | warm | " + " | ".join(f"after a GEMM of {label}" for label, _, _ in after_gemm) + " |",
              "|---|---|" + "---|" * len(after_gemm)]
    for name, us in warm.items():
        lines.append(f"| `{name}` | {us:.0f} | " + " | ".join(f"{after[name]:.0f}" for _, _, after in after_gemm) + " |")
    lines += ["", "(The GEMMs took " + ", ".join(f"{ms:.1f} ms" for _, ms, _ in after_gemm) + ".)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=["replicate", "fsdp"], default=["replicate"])
    parser.add_argument("--variants", nargs="+", choices=[v for v in VARIANTS if not v.startswith("fp32")],  # fp32: no gift:: op
                        default=["fp8", "gift"])
    parser.add_argument("--steps", type=int, default=40, help=f"steps per job (the first {WARMUP_STEPS} are not counted)")
    parser.add_argument("--results", default="codec_profile", help="stem of the result file in benchmarks/results")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS + 1:
        parser.error(f"--steps must be more than {WARMUP_STEPS + 1}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for variant in args.variants:
                print(f"{mode}/{variant}: {args.steps} steps ...", flush=True)
                runs.append(profile(mode, variant, args.steps, Path(tmp)))
    print("GIFT's arithmetic alone ...", flush=True)
    floors = {mode: floor(mode) for mode in args.modes}
    print("ops alone ...", flush=True)
    text = report(runs, *alone(), floors)
    print(text)
    (RESULTS / f"{args.results}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
