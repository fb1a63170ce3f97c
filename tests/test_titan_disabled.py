"""``[gift] enabled = false`` leaves torchtitan's graph unchanged; ``layers = "auto"`` switches.

Short 2-rank CPU runs of the debug model on the bundled corpus: with ``enabled = false`` the
passes graph_trainer applies, and what each one changes in the graph (its own
``debug_graph_passes`` op-count log), equal those of the stock ``default`` pipeline; an
``auto`` run profiles 2 steps, writes the chosen layers and retraces with them whitened.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow  # each test runs gift-titan jobs: ~30-90 s

from gift_compile.testing.titan_jobs import concurrently, run_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "llama3_debug_cpu.toml"


def pass_reports(log: str) -> list[str]:
    """graph_trainer's per-pass reports (``debug_graph_passes``): each pass's op-count changes."""
    return re.findall(r"\[(\w+)\] (graph unchanged|graph diff:\n(?:\s{2,}.*\n)+)", log)


def test_disabled_gift_leaves_the_graph_unchanged(tmp_path):
    common = ["--training.steps", "1", "--metrics.log_freq", "1", "--compile.debug_graph_passes"]
    off, stock = concurrently(lambda: run_job(JOB, tmp_path / "off", *common, "--gift.no-enabled").check(),
                              lambda: run_job(JOB, tmp_path / "stock", *common, "--gift.no-enabled", "--compile.pass_pipeline", "default").check())
    assert off.applied_passes() == stock.applied_passes() and off.applied_passes()
    assert "gift_joint_graph_pass" not in off.applied_passes()
    reports = pass_reports(off.log)  # both ranks report: their lines interleave differently per run
    assert reports and sorted(reports) == sorted(pass_reports(stock.log))  # every pass changed the graph alike
    assert "gift" not in "".join(report for _, report in reports)


CHECKPOINT = ["--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.no-last-save-model-only"]
AUTO = [*CHECKPOINT, "--gift.layers", "auto", "--gift.auto_profile_steps", "2"]


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    return run_job(JOB, tmp_path_factory.mktemp("auto") / "run", "--training.steps", "4", *AUTO).check()


def test_auto_profiles_then_whitens_the_chosen_layers(auto_run):
    run = auto_run
    chosen = tomllib.loads((run.dump_folder / "gift_layers.toml").read_text())["gift"]["layers"]
    assert chosen, run.log[-3000:]
    counters = run.counters(0)
    assert counters["chosen"] == chosen and counters["switched_at"] == 3
    assert {fqn for fqn, c in counters["layers"].items() if c["path"] == "gift"} == set(chosen)
    assert run.series("gift/layers") == {1: 0, 2: 0, 3: len(chosen), 4: len(chosen)}
    assert run.series("gift/profiling") == {1: 1, 2: 1, 3: 0, 4: 0}


def test_resuming_an_auto_run_needs_its_chosen_layers(auto_run, tmp_path):
    """The step-3 checkpoint holds GIFT state for the layers chosen at step 3. Resuming with
    layers = "auto" again would profile nothing (step 3 is past profiling) and run without that
    state: it must fail and say how to resume; resuming with the written layers must work."""
    chosen = tomllib.loads((auto_run.dump_folder / "gift_layers.toml").read_text())["gift"]["layers"]
    for name in ("again_auto", "explicit"):
        shutil.copytree(auto_run.dump_folder / "checkpoint" / "step-3", tmp_path / name / "checkpoint" / "step-3")
    resume = ["--training.steps", "4", "--checkpoint.load_step", "3"]
    again, explicit = concurrently(lambda: run_job(JOB, tmp_path / "again_auto", *resume, *AUTO),
                                   lambda: run_job(JOB, tmp_path / "explicit", *resume, *CHECKPOINT, "--gift.layers", ",".join(chosen)))
    assert again.returncode != 0
    assert "checkpoint holds state for the whitened layers" in again.log and "layers_file" in again.log
    explicit.check()
    assert explicit.series("loss").keys() == {4}
    assert explicit.series("loss")[4] == pytest.approx(auto_run.series("loss")[4], rel=1e-4)


def test_one_rank_runs_and_equals_the_plain_run(tmp_path):
    # One rank has nothing to communicate: GIFT says so once and changes nothing.
    common = ["--nproc", "1", "--training.steps", "2", "--metrics.log_freq", "1", "--debug.seed", "0"]
    gift, plain = concurrently(lambda: run_job(JOB, tmp_path / "gift", *common).check(),
                               lambda: run_job(JOB, tmp_path / "plain", *common, "--gift.no-enabled").check())
    assert gift.losses() == plain.losses() and len(gift.losses()) == 2
    assert gift.log.count("one rank has nothing to communicate") == 1


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


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_dead_or_hung_rank_ends_the_job(tmp_path, fault):
    # A rank that dies must not leave its peer waiting in a collective until a 10-minute
    # timeout; a rank that hangs (SIGSTOP: alive, silent) must end the job at torchtitan's
    # train timeout (set to 8 s here), with an error that says so.
    timeout_s = 8
    command = [sys.executable, "-m", "gift_compile.titan_integration.launcher", str(JOB), "--dump_folder", str(tmp_path / "run"),
               "--training.steps", "200", "--metrics.log_freq", "1", "--comm.train_timeout_seconds", str(timeout_s)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = tmp_path / "run" / "gift_metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
            time.sleep(1)
        assert metrics.exists(), "the job did not start training"
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
        assert job.returncode != 0 and time.time() - struck_at < (60 if fault == "killed" else timeout_s + 120), log[-2000:]
        if fault == "hung":
            assert re.search(r"[Tt]imed out|[Tt]imeout", log), log[-2000:]
        assert not descendants(job.pid)
    finally:
        kill_tree(job.pid)
