"""torchtitan's standard trainer (FSDP2 ``fully_shard`` per block) with ``[gift] enabled = true``.

CPU runs of the Llama-3 debug model on the bundled corpus: a 10-step GIFT run (a checkpoint
at step 5, the codec compiled) launched as a two-node job (two ``gift-titan --nnodes 2
--node-rank {0,1}`` processes, one rank each, sharing a master address) beside the same job
on one node with GIFT off (fp32 gradients); then, side by side, a two-node resume of the GIFT
run from its checkpoint and a 4-rank HSDP run (2 replicas x 2 shards) with ``layers = "auto"``,
both with the codec eager (``compile_codec = false``: the same bits, no compile per shape).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow  # each test runs gift-titan jobs: ~30-90 s

from gift_compile.testing.ranks import free_port  # noqa: E402
from gift_compile.testing.titan_jobs import JobResult, check_time_meter, concurrently, resume, run_job, run_nodes, write_job  # noqa: E402

STEPS, CHECKPOINT = 10, 5
GIFT = {"enabled": True, "layers": ["wqkv", "wo"], "meter_interval": 5}


@dataclass
class Runs:
    gift: JobResult
    fp32: JobResult
    resumed: JobResult
    hsdp: JobResult


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("standard")
    job = write_job(tmp / "job.toml", "llama3_debug_standard", steps=STEPS, gift=GIFT, nproc=1, checkpoint_every=CHECKPOINT)
    gift, fp32 = concurrently(lambda: run_nodes(job, tmp / "gift", 2, free_port()).check(),
                              lambda: run_job(job, tmp / "fp32", "--nproc", "2", "--gift.no-enabled", "--checkpoint.no-enable").check())
    # The resume runs as two nodes too: the same layout and thread count (run_nodes), so the
    # same reduction order and the state's last bits. Its codec runs eagerly: the compiled
    # one must have computed the very same bits, so the resumed steps still match.
    hsdp_job = write_job(tmp / "hsdp.toml", "llama3_debug_standard", steps=4, nproc=4,
                         gift={"enabled": True, "layers": "auto", "auto_profile_steps": 2, "compile_codec": False})
    resumed, hsdp = concurrently(lambda: resume(gift, job, tmp / "resumed", CHECKPOINT, "--gift.no-compile_codec", nodes=2),
                                 lambda: run_job(hsdp_job, tmp / "hsdp", "--parallelism.data_parallel_replicate_degree", "2").check())
    return Runs(gift, fp32, resumed, hsdp)


def test_two_nodes_run_the_job_to_the_end(runs):
    gift = runs.gift
    assert [r["step"] for r in gift.records if "loss" in r] == list(range(1, STEPS + 1))
    for node in (0, 1):
        assert f"--nnodes=2 --node_rank={node} --master_addr=127.0.0.1" in gift.log
        assert gift.counters(node)["layers"]  # rank r is node r's only rank: both ran GIFT


def test_fsdp_all_gathers_are_prefetched_asynchronously_on_gloo(runs):
    # cpu_support.overlap_fsdp_all_gathers, GIFT on or off: every rank chains the root,
    # tok_embeddings, each block and [norm, lm_head] (tests/test_fsdp_overlap.py checks the order).
    blocks = {name.split(".")[1] for name in runs.gift.counters(0)["layers"] if name.startswith("layers.")}
    for result, ranks in ((runs.gift, 2), (runs.fp32, 2), (runs.hsdp, 4)):
        chained = re.findall(r"FSDP2 all-gathers asynchronous on gloo, forward prefetch chained over (\d+) units", result.log)
        assert chained == [str(len(blocks) + 3)] * ranks


def test_loss_decreases_like_the_fp32_run(runs):
    gift, fp32 = runs.gift, runs.fp32
    ours, theirs = gift.losses(), fp32.losses()
    assert len(ours) == len(theirs) == STEPS
    assert sum(ours[-5:]) / 5 < sum(ours[:5]) / 5 - 0.5, ours
    # FP8 rounding (0.25x the bytes) perturbs each step's gradient by ~1-2% of its norm: over
    # these steps the loss stays within 2% of the fp32 run's, step by step.
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= 0.02 * b, (step, a, b)


def test_the_time_meter_reports_codec_and_waiting(runs):
    # No graph of ours runs on this trainer: the step is the trainer's forward-backward, the
    # codec its hooks (the forward statistics, the reduce-scatter), the waits gift::timed_wait
    # inside the compiled codec (timing.py). Two nodes always wait for each other a little.
    check_time_meter(runs.gift, STEPS)
    assert all(runs.gift.series("gift/comm_wait_s")[step] > 0 for step in range(2, STEPS + 1))


def test_selected_layers_take_the_gift_path_and_bytes_drop_to_a_quarter(runs):
    gift = runs.gift
    assert "GIFT enabled (fsdp2 route)" in gift.log  # the codec compiled (the default)
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
    # The first run compiled its codec, the resume runs it eagerly (same bits, a fresh process
    # with no compiled graph): steps 6-10 and the final GIFT state must still agree.
    gift, resumed = runs.gift, runs.resumed
    assert "GIFT enabled (fsdp2 route, eager codec)" in resumed.log
    a, b = gift.series("loss"), resumed.series("loss")
    assert sorted(b) == list(range(CHECKPOINT + 1, STEPS + 1))
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-4), (step, a[step], b[step])
    for rank in (0, 1):
        assert resumed.counters(rank)["state_checksum"] == pytest.approx(gift.counters(rank)["state_checksum"], rel=1e-6)
        assert resumed.counters(rank)["residual_norm"] == pytest.approx(gift.counters(rank)["residual_norm"], rel=1e-4)


def test_auto_selection_and_hsdp_on_the_standard_trainer(runs):
    # 4 ranks as HSDP (2 replicas x 2 shards): FSDP2 shards over dp_shard, GIFT's all-reduce
    # hook reduces each shard across the replicas in FP8 (unit-tested in test_fsdp.py).
    run = runs.hsdp
    assert "GIFT enabled (fsdp2 route, eager codec)" in run.log
    assert "dp_replicate=2, dp_shard=2" in run.log
    for rank in range(4):
        counters = run.counters(rank)
        assert counters["chosen"] and counters["switched_at"] == 3
        assert {fqn for fqn, c in counters["layers"].items() if c["path"] == "gift"} == set(counters["chosen"])
        assert all(counters["layers"][fqn]["steps"] == 2 for fqn in counters["chosen"])  # whitened from step 3 on
        replicas = {fqn.removesuffix("@replicate"): c for fqn, c in counters["layers"].items() if fqn.endswith("@replicate")}
        assert set(replicas) == {fqn for fqn in counters["layers"] if not fqn.endswith("@replicate")}  # every 2-D gradient
        # Counted since the switch at step 3, as every layer (the profile's counters are cleared).
        assert all(c["path"] == "fp8" and c["steps"] == 2 and c["bytes_sent"] > 0 for c in replicas.values())
    assert run.series("gift/profiling") == {1: 1, 2: 1, 3: 0, 4: 0}
    # Both dimensions in FP8: a quarter of what fp32 sends over the shards and the replicas.
    assert run.last("gift/bytes_ratio_vs_fp32") <= 0.26
