"""2-rank CPU torchtitan (graph_trainer) runs of the Llama-3 debug model, GIFT on.

One module-scoped 20-step run from a TOML job file with ``[gift] enabled = true`` (checkpoint
every 10 steps) on the bundled corpus and tokenizer, and one run that resumes from its
step-10 checkpoint in the same dump folder. About 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import re
import shutil

import pytest

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow  # each test runs gift-titan jobs: ~30-90 s

from gift_compile.testing.titan_jobs import run_job, write_job  # noqa: E402

STEPS = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("titan")
    job = write_job(tmp / "job.toml", "llama3_debug", steps=STEPS, checkpoint_every=10,
                    gift={"enabled": True, "layers": ["w2"], "meter_interval": 5})
    first = run_job(job, tmp / "first").check()
    return first, run_job(job, first.dump_folder, "--checkpoint.load_step", "10").check(), job


def test_loss_decreases(runs):
    first, *_ = runs
    losses = first.losses()
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def test_gift_path_is_active_on_the_selected_layers(runs):
    first, *_ = runs
    expected = [f"layers.{i}.feed_forward.w2" for i in range(6)]
    for rank in (0, 1):
        counters = first.counters(rank)
        assert sorted(counters["chosen"]) == expected
        gift = {fqn for fqn, c in counters["layers"].items() if c["path"] == "gift"}
        assert gift == set(expected)
        for fqn in expected:
            c = counters["layers"][fqn]
            assert c["steps"] == STEPS and c["bytes_sent"] > 0 and c["stats_bytes"] > 0
            assert c["last_rel_error"] < 0.05  # e4m3 mantissa floor is ~2.6e-2
            assert c["error_vs_fp8"] is not None  # the live meter read at steps 0, 5, 10, 15
        others = {c["path"] for fqn, c in counters["layers"].items() if fqn not in expected}
        assert others == {"fp8"}  # every other Linear (and the embedding) as Euclidean FP8
    assert first.last("gift/layers") == 6
    assert first.last("gift/bytes_per_step/gift") > 0
    assert first.last("gift/error_vs_fp8") is not None and first.last("gift/stats_bytes_per_step") > 0


def test_cuda_graph_pass_is_kept_away_from_the_gift_ops(runs):
    # graph_trainer's default pipeline ends with cudagraph_pass (it only skips itself at run
    # time when every op is a CPU op); its replays would skip the gift:: ops' Python.
    first, *_ = runs
    applied = set(re.findall(r"\b\d+\. (\w+_pass)\b", first.log))
    assert "gift_joint_graph_pass" in applied
    assert "cudagraph_pass" not in applied


def test_gradient_bytes_at_most_026x_fp32(runs):
    first, *_ = runs
    total, fp32 = first.last("gift/bytes_per_step"), first.last("gift/bytes_per_step_fp32")
    # fp32 baseline: what the same job's gradient collectives send in fp32 (ring bytes per rank)
    assert fp32 == pytest.approx(6_160_000 * 4 / 2, rel=0.02)
    assert total / fp32 <= 0.26, (total, fp32)  # gradient payload; the statistics are counted apart
    assert first.last("gift/total_bytes_ratio_vs_fp32") > total / fp32


def test_checkpoint_restores_gift_state(runs):
    # The resume ran steps 11-20 again in the first run's folder: its own log shows just those,
    # the metrics file holds every step once, and steps 11-20 reproduce the first run's losses.
    first, resumed, _ = runs
    assert "Loading the checkpoint from" in resumed.log or "load" in resumed.log.lower()
    assert sorted({int(s) for s in re.findall(r"step:\s+(\d+)", resumed.log)}) == list(range(11, STEPS + 1))
    assert [r["step"] for r in resumed.records if "loss" in r] == list(range(1, STEPS + 1))
    a, b = first.series("loss"), resumed.series("loss")
    for step in range(11, STEPS + 1):
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-4), (step, a[step], b[step])
    for rank in (0, 1):
        ca, cb = first.counters(rank), resumed.counters(rank)
        assert cb["state_steps"] == ca["state_steps"] == {f"layers.{i}.feed_forward.w2": STEPS for i in range(6)}
        assert cb["state_checksum"] == pytest.approx(ca["state_checksum"], rel=1e-6)
        assert cb["residual_norm"] == pytest.approx(ca["residual_norm"], rel=1e-4)


def test_resuming_with_other_layers_says_which(runs, tmp_path):
    first, _, job = runs
    shutil.copytree(first.dump_folder / "checkpoint" / "step-10", tmp_path / "other" / "checkpoint" / "step-10")
    other = run_job(job, tmp_path / "other", "--checkpoint.load_step", "10", "--gift.layers", "wo")
    assert other.returncode != 0
    assert "the checkpoint holds state for the whitened layers ['layers.0.feed_forward.w2'" in other.log
    assert "but this run whitens ['layers.0.attention.wo'" in other.log
