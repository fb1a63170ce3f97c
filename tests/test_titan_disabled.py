"""``[gift] enabled = false`` leaves torchtitan's graph unchanged; one rank runs unchanged;
a finished rank exits without the interpreter's teardown; a dead or hung rank ends the job.

Short CPU runs of the debug model on graph_trainer with the bundled corpus: with
``enabled = false`` the passes graph_trainer applies, and what each one changes in the graph
(its own ``debug_graph_passes`` op-count log), equal those of the stock ``default`` pipeline.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow  # each test runs gift-titan jobs: ~30-90 s

from gift_compile.testing.titan_jobs import JobResult, concurrently, run_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "llama3_debug_cpu.toml"


def pass_reports(log: str) -> list[str]:
    """graph_trainer's per-pass reports (``debug_graph_passes``): each pass's op-count changes."""
    return re.findall(r"\[(\w+)\] (graph unchanged|graph diff:\n(?:\s{2,}.*\n)+)", log)


# Loaded by every process these jobs start (PYTHONPATH): each rank (torchrun sets RANK) leaves a
# mark when it starts and another if its interpreter is finalized (atexit).
EXIT_PROBE = """import atexit, os, pathlib
if "RANK" in os.environ:
    mark = pathlib.Path(os.environ["GIFT_TEST_EXIT_MARKS"]) / f"rank{os.environ['RANK']}-{os.getpid()}"
    mark.with_suffix(".started").touch()
    atexit.register(mark.with_suffix(".finalized").touch)
"""


@dataclass
class ShortRuns:
    jobs: dict[str, JobResult]
    exit_marks: Path


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory) -> ShortRuns:
    """Four short graph_trainer jobs side by side: GIFT off with the gift pipeline and with the
    stock one (2 ranks, 1 step, each pass's graph changes logged), and GIFT on and off on one
    rank; each rank marks its start and its interpreter's teardown (``EXIT_PROBE``)."""
    tmp = tmp_path_factory.mktemp("short")
    probe, marks = tmp / "probe", tmp / "exit_marks"
    probe.mkdir()
    marks.mkdir()
    (probe / "sitecustomize.py").write_text(EXIT_PROBE)
    passes = ["--training.steps", "1", "--metrics.log_freq", "1", "--compile.debug_graph_passes", "--gift.no-enabled"]
    one_rank = ["--nproc", "1", "--training.steps", "2", "--metrics.log_freq", "1", "--debug.seed", "0"]
    jobs = {
        "off": passes,
        "stock": [*passes, "--compile.pass_pipeline", "default"],
        "one_rank_gift": one_rank,
        "one_rank_plain": [*one_rank, "--gift.no-enabled"],
    }
    with pytest.MonkeyPatch.context() as patch:  # the jobs' environment is this process's
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")])))
        patch.setenv("GIFT_TEST_EXIT_MARKS", str(marks))
        results = concurrently(*[lambda name=name, flags=flags: run_job(JOB, tmp / name, *flags).check() for name, flags in jobs.items()])
    return ShortRuns(dict(zip(jobs, results)), marks)


def test_disabled_gift_leaves_the_graph_unchanged(short_runs):
    off, stock = short_runs.jobs["off"], short_runs.jobs["stock"]
    assert off.applied_passes() == stock.applied_passes() and off.applied_passes()
    assert "gift_joint_graph_pass" not in off.applied_passes()
    reports = pass_reports(off.log)  # both ranks report: their lines interleave differently per run
    assert reports and sorted(reports) == sorted(pass_reports(stock.log))  # every pass changed the graph alike
    assert "gift" not in "".join(report for _, report in reports)


COLLECTIVE_COUNT = re.compile(r"^\s+(all_gather_into_tensor(?:_out)?|reduce_scatter_tensor|all_reduce|all_to_all_single|wait_tensor)"
                              r"\.default: \d+ -> (\d+)", re.MULTILINE)


def test_disabled_runs_report_their_collectives_per_step(short_runs):
    # fp32 beside FP8 and GIFT (benchmarks/shaped_link.py): a run with GIFT off records how many
    # collectives its final graph issues per step. The truth here is graph_trainer's own
    # per-pass op counts (debug_graph_passes): each collective's count after the last pass that
    # changed it, and the waits, one per collective.
    off = short_runs.jobs["off"]
    final: dict[str, int] = {}
    for op, after in COLLECTIVE_COUNT.findall(off.log):  # in pass order; both ranks log the same counts
        final[op] = int(after)
    waits = final.pop("wait_tensor")
    assert off.last("gift/collectives_per_step") == sum(final.values()) == waits > 0, (final, waits)
    assert short_runs.jobs["stock"].last("gift/collectives_per_step") == waits


def test_one_rank_runs_and_equals_the_plain_run(short_runs):
    # One rank has nothing to communicate: GIFT says so once and changes nothing.
    gift, plain = short_runs.jobs["one_rank_gift"], short_runs.jobs["one_rank_plain"]
    assert gift.losses() == plain.losses() and len(gift.losses()) == 2
    assert gift.log.count("one rank has nothing to communicate") == 1


def test_finished_ranks_exit_without_interpreter_teardown(short_runs):
    # The teardown after torchtitan's own shutdown now and then aborted a finished rank
    # (entry.exit_now): no rank's atexit handlers run, and all six ranks started with the probe.
    started = sorted(p.stem for p in short_runs.exit_marks.glob("*.started"))
    assert [name.partition("-")[0] for name in started] == ["rank0"] * 4 + ["rank1"] * 2, started
    assert not list(short_runs.exit_marks.glob("*.finalized"))
    assert all(job.returncode == 0 for job in short_runs.jobs.values())


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def descendants(pid: int) -> list[int]:
    return [d for c in children(pid) for d in (c, *descendants(c))]


def kill_tree(pid: int) -> None:
    for process in [*descendants(pid), pid]:
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_dead_or_hung_rank_ends_the_job(tmp_path):
    # A rank that dies must not leave its peer waiting in a collective until a 10-minute
    # timeout; a rank that hangs (SIGSTOP: alive, silent) must end the job at torchtitan's
    # train timeout (set to 8 s here), with an error that says so. Both jobs run side by side.
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(strike_a_rank, tmp_path / fault, fault) for fault in ("killed", "hung")]:
            done.result()


def strike_a_rank(folder: Path, fault: str) -> None:
    timeout_s = 8
    # The standard FSDP2 trainer with its codec eager: GIFT's reduce-scatters in every step and
    # training within seconds (graph_trainer would spend a minute compiling before the fault).
    command = [sys.executable, "-m", "gift_compile.titan_integration.launcher", str(JOB), "--dump_folder", str(folder),
               "--launch.config", "llama3_debug_standard", "--gift.no-compile_codec",
               "--training.steps", "200", "--metrics.log_freq", "1", "--comm.train_timeout_seconds", str(timeout_s)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = folder / "gift_metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
            time.sleep(1)
        assert metrics.exists(), f"the {fault} job did not start training"
        (torchrun,) = children(job.pid)
        ranks = children(torchrun)
        assert len(ranks) == 2, ranks
        struck_at = time.time()
        os.kill(ranks[-1], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        lines = []
        watchdog = threading.Timer(240, kill_tree, [job.pid])  # a job that never ends fails the test, not hangs it
        watchdog.start()
        for line in job.stdout:  # until the job's output ends
            lines.append(line)
            if fault == "hung" and "closing signal SIGTERM" in line:
                # A rank hung in a collective still takes signals; a stopped one holds SIGTERM
                # until continued (torchrun would SIGKILL it 30 s later): let it land.
                os.kill(ranks[-1], signal.SIGCONT)
        job.wait(timeout=60)
        watchdog.cancel()
        log = "".join(lines)
        assert job.returncode != 0 and time.time() - struck_at < (60 if fault == "killed" else timeout_s + 120), (fault, log[-2000:])
        if fault == "hung":
            assert re.search(r"[Tt]imed out|[Tt]imeout", log), log[-2000:]
        assert not descendants(job.pid), fault
    finally:
        kill_tree(job.pid)
