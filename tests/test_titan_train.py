"""2-rank CPU torchtitan (graph_trainer) runs of the Llama-3 debug model, GIFT on.

One module-scoped 10-step run from a TOML job file with ``[gift] enabled = true`` and
``layers = "auto"`` (2 profiling steps in Euclidean FP8, then the chosen layers whitened;
a checkpoint every 5 steps) on the bundled corpus and tokenizer. Then three resumes from its
step-5 checkpoint: with the chosen layers in the same dump folder (steps 6-10 again), with
other layers, and with ``"auto"`` again; ``gift-titan`` must refuse the last two before any
rank starts.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from dataclasses import dataclass

import pytest

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow  # gift-titan jobs: ~1.5 minutes for the module

from gift_compile.testing.titan_jobs import JobResult, check_time_meter, concurrently, run_job, write_job  # noqa: E402
from gift_compile.titan_integration.cpu_support import FSDP_BUCKETING_PASS  # noqa: E402

STEPS, CHECKPOINT, PROFILE = 10, 5, 2
GIFT = {"enabled": True, "layers": "auto", "auto_profile_steps": PROFILE, "meter_interval": 5}
CODEC = re.compile(r"GIFT pass: .*; codec (eager|compiled)")  # how each rank's pass ran the codec
REGIONS = re.compile(r"GIFT codec regions: (\d+), (\d+) distinct graphs")


@dataclass
class Runs:
    first: JobResult
    chosen: list[str]
    resumed: JobResult
    other_layers: JobResult
    auto_again: JobResult


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("titan")
    job = write_job(tmp / "job.toml", "llama3_debug", steps=STEPS, checkpoint_every=CHECKPOINT, gift=GIFT)
    first = run_job(job, tmp / "first").check()
    chosen = tomllib.loads((first.dump_folder / "gift_layers.toml").read_text())["gift"]["layers"]
    for name in ("other", "again"):
        shutil.copytree(first.dump_folder / "checkpoint" / f"step-{CHECKPOINT}", tmp / name / "checkpoint" / f"step-{CHECKPOINT}")
    load = ("--checkpoint.load_step", str(CHECKPOINT))
    resumed, other, again = concurrently(
        # (with the parameter all-gathers in pieces: the same bytes, so the same losses)
        lambda: run_job(job, first.dump_folder, *load, "--gift.layers", ",".join(chosen), "--gift.parameter_piece_kib", "64").check(),
        lambda: run_job(job, tmp / "other", *load, "--gift.layers", "wo"),
        lambda: run_job(job, tmp / "again", *load),
    )
    return Runs(first, chosen, resumed, other, again)


def test_loss_decreases(runs):
    losses = runs.first.losses()
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def test_auto_profiles_then_whitens_the_chosen_layers(runs):
    first, chosen = runs.first, runs.chosen
    assert chosen, first.log[-3000:]
    assert first.series("gift/profiling") == {step: int(step <= PROFILE) for step in range(1, STEPS + 1)}
    assert first.series("gift/layers") == {step: 0 if step <= PROFILE else len(chosen) for step in range(1, STEPS + 1)}
    for rank in (0, 1):
        counters = first.counters(rank)
        assert counters["chosen"] == chosen and counters["switched_at"] == PROFILE + 1
        assert {fqn for fqn, c in counters["layers"].items() if c["path"] == "gift"} == set(chosen)
        for fqn in chosen:  # counted since the switch (the profile's counters are cleared)
            c = counters["layers"][fqn]
            assert c["steps"] == STEPS - PROFILE and c["bytes_sent"] > 0 and c["stats_bytes"] > 0
            assert c["last_rel_error"] < 0.05  # e4m3 mantissa floor is ~2.6e-2
            assert c["error_vs_fp8"] is not None  # the live meter read at the first whitened step
        others = {c["path"] for fqn, c in counters["layers"].items() if fqn not in chosen}
        assert others == {"fp8"}  # every other Linear (and the embedding) as Euclidean FP8
    assert first.last("gift/bytes_per_step/gift") > 0
    assert first.last("gift/error_vs_fp8") is not None and first.last("gift/stats_bytes_per_step") > 0
    # The profile's graph runs its 2 steps with the codec eager (compiling its regions would cost
    # more than it saves); the graph traced after the switch compiles the codec, on both ranks.
    assert CODEC.findall(first.log) == ["eager"] * 2 + ["compiled"] * 2
    assert CODEC.findall(runs.resumed.log) == ["compiled"] * 2
    # The debug model's 6 blocks are alike, so their codec regions are one compile per shape
    # and path: measured 106 regions, 16 distinct graphs (design record §10). At most a third
    # distinct still fails if each block's regions were compiled apart (then all are distinct).
    for regions, distinct in REGIONS.findall(first.log):
        assert 0 < 3 * int(distinct) <= int(regions), (regions, distinct)
    assert len(REGIONS.findall(first.log)) == 2  # the chosen layers' graph, on both ranks


def test_cuda_graph_pass_is_kept_away_from_the_gift_ops(runs):
    # graph_trainer's default pipeline ends with cudagraph_pass (it only skips itself at run
    # time when every op is a CPU op); its replays would skip the gift:: ops' Python.
    applied = set(runs.first.applied_passes())
    assert "gift_joint_graph_pass" in applied
    assert "cudagraph_pass" not in applied


def test_overlap_and_the_time_meter_reach_the_final_graph_and_the_metrics(runs):
    first = runs.first
    # the overlap pass ran last, on the graph graph_trainer executes (after torchtitan's passes)
    applied = first.applied_passes()
    assert applied[-1] == "gift_overlap_pass" and "regional_inductor_pass" in applied
    moved = [int(m) for m in re.findall(r"GIFT overlap: (\d+) gradient waits now come after", first.log)]
    assert moved and min(moved) > 0
    # torchtitan's FSDP bucketing/prefetch pass runs on CPU too (cpu_support's roofline shim),
    # and its prefetch survives the GIFT rewrite and the overlap scheduling
    assert FSDP_BUCKETING_PASS in applied
    prefetched = [int(m) for m in re.findall(r"(\d+) parameter all-gathers prefetched", first.log)]
    assert prefetched and min(prefetched) > 0
    # parameter_piece_kib = "auto" (the default) timed the FSDP group's link at start-up and said
    # what it chose (on loopback, several Gbit/s: one call each; tests/test_shaped_link.py has both)
    assert re.search(r"GIFT: one 1 MiB all_to_all on the FSDP group moved at \d+ Mbit/s per direction: "
                     r"parameter all-gathers (in one call each|in 128 KiB pieces)", first.log)
    # the whitened layers' statistics are summed on a group of their own ([gift] stats_group = "own"),
    # never queued with the all-gathers and gradients: every one, in the graph after the switch
    own, statistics = map(int, re.findall(r"(\d+) of (\d+) statistics all-reduces on a group of their own", first.log)[-1])
    assert statistics > 0 and own == statistics
    check_time_meter(first, STEPS)
    assert first.last("gift/collectives_per_step") > 0 and first.last("gift/collectives_per_step_traced") > 0


def test_gradient_bytes_at_most_026x_fp32(runs):
    first = runs.first
    total, fp32 = first.last("gift/bytes_per_step"), first.last("gift/bytes_per_step_fp32")
    # fp32 baseline: what the same job's gradient collectives send in fp32 (ring bytes per rank)
    assert fp32 == pytest.approx(6_160_000 * 4 / 2, rel=0.02)
    assert total / fp32 <= 0.26, (total, fp32)  # gradient payload; the statistics are counted apart
    assert first.last("gift/total_bytes_ratio_vs_fp32") > total / fp32
    # the Linear weights alone: every one on a 1-byte wire (GIFT or Euclidean FP8), 4 bytes in fp32
    assert first.last("gift/linear_bytes_ratio_vs_fp32") == pytest.approx(0.25, abs=0.005)


def test_checkpoint_restores_gift_state(runs):
    # The resume ran steps 6-10 again in the first run's folder, whitening the layers the
    # first run chose: its own log shows just those steps, the metrics file holds every step
    # once, and steps 6-10 reproduce the first run's losses and final GIFT state.
    first, resumed = runs.first, runs.resumed
    assert sorted({int(s) for s in re.findall(r"step:\s+(\d+)", resumed.log)}) == list(range(CHECKPOINT + 1, STEPS + 1))
    assert [r["step"] for r in resumed.records if "loss" in r] == list(range(1, STEPS + 1))
    a, b = first.series("loss"), resumed.series("loss")
    for step in range(CHECKPOINT + 1, STEPS + 1):
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-4), (step, a[step], b[step])
    # The resume sent FSDP's parameter all-gathers in 64 KiB pieces ([gift] parameter_piece_kib):
    # more calls a step, the prefetch kept, and (above) the same losses, so the same parameters.
    assert re.search(r"GIFT pieces: \d+ more collectives per step, .* each parameter all-gather at most 64 KiB per rank", resumed.log)
    assert resumed.last("gift/collectives_per_step") > first.last("gift/collectives_per_step")
    assert min(int(m) for m in re.findall(r"(\d+) parameter all-gathers prefetched", resumed.log)) > 0
    for rank in (0, 1):
        ca, cb = first.counters(rank), resumed.counters(rank)
        assert cb["state_steps"] == ca["state_steps"] == {fqn: STEPS - PROFILE for fqn in runs.chosen}
        assert cb["state_checksum"] == pytest.approx(ca["state_checksum"], rel=1e-6)
        assert cb["residual_norm"] == pytest.approx(ca["residual_norm"], rel=1e-4)


def test_resuming_with_other_layers_says_which(runs):
    other = runs.other_layers
    assert other.returncode == 2 and other.log.startswith("gift-titan: error: ")  # refused, nothing started
    assert f"the checkpoint holds state for the whitened layers {runs.chosen}" in other.log
    assert "but this run whitens ['layers.0.attention.wo'" in other.log


def test_resuming_an_auto_run_needs_its_chosen_layers(runs):
    # Step 5 is past profiling: "auto" again would choose nothing and run without the saved
    # state. It must fail and say how to resume (the explicit resume above is the way).
    again = runs.auto_again
    assert again.returncode == 2 and again.log.startswith("gift-titan: error: ")
    assert f"the checkpoint holds state for the whitened layers {runs.chosen}, but this run whitens []" in again.log
    assert "layers_file" in again.log
