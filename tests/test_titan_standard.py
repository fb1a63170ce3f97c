"""torchtitan's standard trainer (FSDP2 ``fully_shard`` per block) with ``[gift] enabled = true``.

2-rank CPU runs of the Llama-3 debug model on the bundled corpus: a 20-step GIFT run (a
checkpoint at step 10), the same job with GIFT off (fp32 gradients), a resume of the GIFT run
from its checkpoint, and the job launched as two one-rank "nodes" of a multi-node job.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow  # each test runs gift-titan jobs: ~30-90 s

from gift_compile.testing.ranks import free_port  # noqa: E402
from gift_compile.testing.titan_jobs import read_records, resume, run_job, write_job  # noqa: E402

STEPS = 20
GIFT = {"enabled": True, "meter_interval": 5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("standard")
    job = write_job(tmp / "job.toml", "llama3_debug_standard", steps=STEPS, gift=GIFT, checkpoint_every=10)
    gift = run_job(job, tmp / "gift").check()
    fp32 = run_job(job, tmp / "fp32", "--gift.no-enabled", "--checkpoint.no-enable").check()
    return gift, fp32, resume(gift, job, tmp / "resumed", 10)


def test_loss_decreases_like_the_fp32_run(runs):
    gift, fp32, _ = runs
    ours, theirs = gift.losses(), fp32.losses()
    assert len(ours) == len(theirs) == STEPS
    assert sum(ours[-5:]) / 5 < sum(ours[:5]) / 5 - 0.5, ours
    # FP8 rounding (0.25x the bytes) perturbs each step's gradient by ~1-2% of its norm: after
    # 20 steps the loss stays within 2% of the fp32 run's, step by step.
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= 0.02 * b, (step, a, b)


def test_selected_layers_take_the_gift_path_and_bytes_drop_to_a_quarter(runs):
    gift, _, _ = runs
    attention = {f"layers.{i}.attention.{name}" for i in range(6) for name in ("qkv_linear.wqkv", "wo")}
    for rank in (0, 1):
        counters = gift.counters(rank)
        assert set(counters["chosen"]) == attention
        assert {fqn for fqn, c in counters["layers"].items() if c["path"] == "gift"} == attention
        for fqn in attention:
            c = counters["layers"][fqn]
            assert c["steps"] == STEPS and c["stats_bytes"] > 0 and c["error_vs_fp8"] is not None
        assert {c["path"] for fqn, c in counters["layers"].items() if fqn not in attention} == {"fp8"}
    assert gift.last("gift/bytes_ratio_vs_fp32") <= 0.26  # gradient payload; the statistics are counted apart
    assert gift.last("gift/stats_bytes_per_step") > 0


def test_checkpoint_restores_the_gift_state(runs):
    gift, _, resumed = runs
    a, b = gift.series("loss"), resumed.series("loss")
    assert sorted(b) == list(range(11, STEPS + 1))
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-4), (step, a[step], b[step])
    for rank in (0, 1):
        assert resumed.counters(rank)["state_checksum"] == pytest.approx(gift.counters(rank)["state_checksum"], rel=1e-6)
        assert resumed.counters(rank)["residual_norm"] == pytest.approx(gift.counters(rank)["residual_norm"], rel=1e-4)


def test_two_nodes_run_the_job_to_the_end(tmp_path):
    job = write_job(tmp_path / "job.toml", "llama3_debug_standard", steps=3, gift=GIFT, nproc=1)
    port = free_port()
    dump = tmp_path / "two_nodes"
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "gift_compile.titan_integration.launcher", str(job), "--nnodes", "2", "--node-rank", str(node),
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--dump_folder", str(dump)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    records = read_records(Path(dump))
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all("--node_rank=%d" % node in log for node, log in enumerate(logs))


def test_auto_selection_works_on_the_standard_trainer(tmp_path):
    job = write_job(tmp_path / "job.toml", "llama3_debug_standard", steps=4,
                    gift={"enabled": True, "layers": "auto", "auto_profile_steps": 2})
    run = run_job(job, tmp_path / "auto").check()
    counters = run.counters(0)
    assert counters["chosen"] and counters["switched_at"] == 3
    assert {fqn for fqn, c in counters["layers"].items() if c["path"] == "gift"} == set(counters["chosen"])
    assert all(counters["layers"][fqn]["steps"] == 2 for fqn in counters["chosen"])  # whitened from step 3 on
    assert run.series("gift/profiling") == {1: 1, 2: 1, 3: 0, 4: 0}
