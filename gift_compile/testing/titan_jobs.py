"""Run a gift-titan job and read back what it wrote (tests and benchmarks).

:func:`run_job` runs ``gift-titan`` on a job file plus overrides, with its own dump folder,
and returns a :class:`JobResult`: the exit code, the log, and the records of
``gift_metrics.jsonl`` / ``gift_counters_rank*.json``. :func:`run_nodes` runs the job as the
nodes of a multi-node job, all on this machine; :func:`concurrently` runs independent jobs at once.

The job is checked in this process by ``gift-titan``'s own :func:`launcher.plan` (this process
has imported torchtitan already; a launcher process would spend ~7 s of CPU importing it
again), and the torchrun command it returns runs as a subprocess, as ``gift-titan`` runs it.
A refused job comes back with exit code 2 and ``gift-titan``'s message, having started nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gift_compile.testing.ranks import free_port
from gift_compile.titan_integration import launcher
from gift_compile.titan_integration.session import METRICS_FILE


@dataclass
class JobResult:
    returncode: int
    log: str
    dump_folder: Path
    wall_s: float
    records: list[dict[str, Any]] = field(default_factory=list)
    rank_counters: dict[int, dict[str, Any]] = field(default_factory=dict)
    """``gift_counters_rank<r>.json`` as the job left them (a later run in the folder rewrites them)."""

    def series(self, key: str) -> dict[int, float]:
        return {r["step"]: r[key] for r in self.records if r.get(key) is not None}

    def losses(self) -> list[float]:
        return [v for _, v in sorted(self.series("loss").items())]

    def last(self, key: str):
        values = [r[key] for r in self.records if r.get(key) is not None]
        return values[-1] if values else None

    def counters(self, rank: int = 0) -> dict[str, Any]:
        if rank not in self.rank_counters:
            raise KeyError(f"the job wrote no gift_counters_rank{rank}.json in {self.dump_folder}")
        return self.rank_counters[rank]

    def applied_passes(self) -> list[str]:
        """The graph passes graph_trainer logged as applied (its numbered list), in order."""
        return re.findall(r"\b\d+\. (\w+_pass)\b", self.log)

    def check(self) -> JobResult:
        if self.returncode != 0:
            raise RuntimeError(f"gift-titan job failed (exit {self.returncode}); log tail:\n{self.log[-6000:]}")
        return self


def check_time_meter(job: JobResult, steps: int) -> None:
    """Assert that the time meter (``timing.py``) reported every step after the first with parts
    that add up: codec + wait <= the step, itself at most the wall time from one step's record
    to the next; and, over the run from step 2 (step 1 compiles), on the last line of rank 0's
    counters table (the metrics are rank 0's), the same seconds."""
    times = {r["step"]: r["time"] for r in job.records if "loss" in r}
    for step in range(2, steps + 1):
        codec, wait = job.series("gift/codec_s")[step], job.series("gift/comm_wait_s")[step]
        share = job.series("gift/comm_share")[step]
        assert codec > 0 and wait >= 0 and 0 < share <= 1, (step, codec, wait, share)
        assert codec + wait <= times[step] - times[step - 1], (step, codec, wait)
    rank0 = job.log.partition("per-layer counters (rank 0)")[2]  # each rank logs its table in one message
    line = re.search(r"time meter, (\d+) steps after the first: ([\d.]+) s/step = codec ([\d.]+) \+ waiting for gradient communication "
                     r"([\d.]+) \+ other compute ([\d.]+); codec and waiting (\d+)% of the step", rank0)
    assert line, job.log[-3000:]
    counted, step_s, codec, wait, compute, share = (float(x) for x in line.groups())
    assert counted == steps - 1
    assert abs(codec + wait + compute - step_s) <= 0.002  # printed to 3 decimals
    for printed, name in ((codec, "codec_s"), (wait, "comm_wait_s")):  # one record per step: the run's mean is theirs
        series = job.series(f"gift/{name}")
        assert abs(printed - sum(series[step] for step in range(2, steps + 1)) / (steps - 1)) <= 0.0006
    assert abs(share - 100 * (codec + wait) / step_s) <= 1


def write_job(path: Path, config: str, *, steps: int, gift: dict[str, Any], nproc: int = 2, checkpoint_every: int | None = None) -> Path:
    """A job file for ``config`` on the bundled corpus: ``steps`` steps, seed 0, metrics every step."""
    lines = ["[launch]", f"nproc = {nproc}", f'config = "{config}"', "", "[training]", f"steps = {steps}", "",
             "[metrics]", "log_freq = 1", "", "[debug]", "seed = 0", ""]
    if checkpoint_every:
        lines += ["[checkpoint]", "enable = true", f"interval = {checkpoint_every}", "last_save_model_only = false", ""]
    lines += ["[gift]", *(f"{key} = {json.dumps(value)}" for key, value in gift.items()), ""]
    path.write_text("\n".join(lines))
    return path


def resume(first: JobResult, job: Path, folder: Path, step: int, *overrides: str, nodes: int = 1) -> JobResult:
    """Run ``job`` again in ``folder`` from ``first``'s step-``step`` checkpoint (as ``nodes``
    nodes of a multi-node job with :func:`run_nodes` when ``nodes > 1``)."""
    shutil.copytree(first.dump_folder / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")
    overrides = ("--checkpoint.load_step", str(step), *overrides)
    return (run_nodes(job, folder, nodes, free_port(), *overrides) if nodes > 1 else run_job(job, folder, *overrides)).check()


_PLANNING = threading.Lock()  # torchtitan's config parser is not known to be thread-safe; a plan takes ~0.5 s


def _launch(job: str | Path | None, dump_folder: Path, overrides: tuple[str, ...]) -> launcher.Launch | launcher.JobError:
    argv = ([str(job)] if job is not None else []) + ["--dump_folder", str(dump_folder), *overrides]
    with _PLANNING:
        try:
            return launcher.plan(argv)
        except launcher.JobError as error:
            return error


def run_job(job: str | Path | None, dump_folder: str | Path, *overrides: str, timeout: float = 900) -> JobResult:
    return run_nodes(job, dump_folder, 1, None, *overrides, timeout=timeout)


def run_nodes(job: str | Path | None, dump_folder: str | Path, nnodes: int, port: int | None, *overrides: str, timeout: float = 900) -> JobResult:
    """``job`` as one job of ``nnodes`` nodes, all on this machine: one torchrun per node, as
    ``gift-titan --nnodes N --node-rank r`` would start it, rendezvous at 127.0.0.1:``port``,
    one dump folder. The result's exit code is the first failing node's (0 if none); its log is
    every node's log in node order. With several nodes every rank gets one thread
    (``OMP_NUM_THREADS=1``, what torchrun sets for several ranks per node): the nodes share this
    machine's cores, and a 20-step two-node run took 59 s with torch's default thread count, 28 s with one."""
    dump_folder = Path(dump_folder).resolve()
    start = time.perf_counter()
    node_flags = [("--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port))
                  for node in range(nnodes)] if nnodes > 1 else [()]
    launches = [_launch(job, dump_folder, (*flags, *overrides)) for flags in node_flags]
    refused = next((launch for launch in launches if isinstance(launch, launcher.JobError)), None)
    if refused is not None:
        return _result(2, refused.refusal() + "\n", dump_folder, start)
    threads = {"OMP_NUM_THREADS": "1"} if nnodes > 1 else {}
    nodes = [subprocess.Popen(launch.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(launch.env, PYTHONUNBUFFERED="1", **threads))
             for launch in launches]
    try:
        logs = [launch.describe() + "\n" + node.communicate(timeout=timeout)[0] for launch, node in zip(launches, nodes)]
    finally:
        for node in nodes:
            node.kill()
    returncode = next((node.returncode for node in nodes if node.returncode != 0), 0)
    log = logs[0] if nnodes == 1 else "".join(f"== node {i} ==\n{text}" for i, text in enumerate(logs))
    return _result(returncode, log, dump_folder, start)


def concurrently(*jobs: Callable[[], JobResult]) -> list[JobResult]:
    """Run independent jobs (``lambda: run_job(...)``) at the same time; results in call order.
    A job leaves cores idle for seconds at a time (the launcher's single-threaded check,
    torchtitan's closing sleep, ranks waiting on each other): another job's ranks use them."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [future.result() for future in [pool.submit(job) for job in jobs]]


def _result(returncode: int, log: str, dump_folder: Path, start: float) -> JobResult:
    """What a finished job left: its exit code and log, and the files it wrote, read now."""
    return JobResult(returncode, log, dump_folder, time.perf_counter() - start, read_records(dump_folder), read_counters(dump_folder))


def read_records(dump_folder: Path) -> list[dict[str, Any]]:
    """The per-step records a job wrote to ``<dump_folder>/gift_metrics.jsonl`` (rank 0)."""
    metrics = dump_folder / METRICS_FILE
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def read_counters(dump_folder: Path) -> dict[int, dict[str, Any]]:
    """Every rank's ``gift_counters_rank<r>.json`` in ``dump_folder``, by rank."""
    files = dump_folder.glob("gift_counters_rank*.json")
    return {int(f.stem.removeprefix("gift_counters_rank")): json.loads(f.read_text()) for f in files}


__all__ = ["check_time_meter", "JobResult", "concurrently", "read_counters", "read_records", "resume", "run_job", "run_nodes", "write_job"]
