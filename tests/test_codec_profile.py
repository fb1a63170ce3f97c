"""benchmarks/codec_profile.py: its per-op host timers see every gift:: op call, and only those;
its floor counts every GEMM of GIFT's reduction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from codec_profile import OP_TIMER, op_table, reduction_gemms

from gift_compile.testing.ranks import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]

CALLS = """
import torch
from gift_compile.geometry import initial_basis, input_sketch

@torch.library.custom_op("profiletest::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2

x, basis = torch.randn(64, 16), initial_basis(16, 4)
for _ in range(3):
    input_sketch(x, basis, torch.ones(()), None)
    double(x)
"""


def test_the_timers_record_each_gift_op_call_and_no_other(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(OP_TIMER)
    env = dict(os.environ, GIFT_OP_TIMES=str(tmp_path), PYTHONPATH=os.pathsep.join([str(probe), str(ROOT)]))
    subprocess.run([sys.executable, "-c", CALLS], env=env, check=True, timeout=300)
    records = json.loads((tmp_path / "rank0.json").read_text())
    # three calls of the one gift:: op the script makes (its own op is not GIFT's: not timed),
    # before any gift::agree, so all in step 0; each a positive time
    assert [name for _, name, _, _ in records] == ["gift::input_sketch"] * 3
    assert all(step == 0 and wall > 0 and cpu >= 0 for step, _, wall, cpu in records)


def test_op_table_counts_calls_per_step_from_the_first_counted_step():
    # step 1 is left out; steps 2 and 3 each call "a" twice (1 and 3 ms) and "b" once (10 ms)
    records = [(1, "a", 1.0, 1.0)] + [(step, name, wall, wall) for step in (2, 3)
                                      for name, wall in (("a", 0.001), ("a", 0.003), ("b", 0.010))]
    steps, table = op_table(records, first_step=2)
    assert steps == 2
    assert table["a"]["calls_per_step"] == 2 and table["b"]["calls_per_step"] == 1
    assert abs(table["a"]["median_us"] - 2000) < 1e-6  # median of 1, 3, 1, 3 ms
    assert abs(table["a"]["ms_per_step"] - 4.0) < 1e-9 and abs(table["b"]["ms_per_step"] - 10.0) < 1e-9


def test_the_floor_counts_every_gemm_of_the_reduction_on_both_routes():
    # Derived from the algorithm (comm.py's docstring), 2 ranks, G 96 x 64, T of rank r = 32 (B: 64 x 32),
    # each whitening G T = s G + ((G B) c) B^T and unwhitening two GEMMs, a shard half the rows:
    # the residual guard projects G and R (G B, R B), the whitening of G + R reuses their sum (one
    # more GEMM), and R' = (U - deq U) T^-1 is unwhitened whole (two). Then reduce-scatter: this
    # rank's rows unwhitened (two, 48 rows). All-reduce: the owner whitens its gather residual
    # and unwhitens the new one (two each, 48 rows), and every rank unwhitens the whole sum (two).
    project, expand = (96, 64, 32), (96, 32, 64)
    half_project, half_expand = (48, 64, 32), (48, 32, 64)
    expected = {
        "reduce_scatter": Counter({project: 3, expand: 2, half_project: 1, half_expand: 1}),
        "all_reduce": Counter({project: 4, expand: 3, half_project: 2, half_expand: 2}),
    }
    for collective, gemms in expected.items():
        for rank_gemms in run_on_ranks(reduction_gemms, 2, [(96, 64)], collective):
            assert Counter(rank_gemms[0]) == gemms, collective
