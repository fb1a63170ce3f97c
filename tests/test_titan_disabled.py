"""``[gift] enabled = false`` leaves torchtitan's graph unchanged; ``layers = "auto"`` switches.

Three short 2-rank CPU runs of the debug model on the bundled corpus (no ../shared needed):
the op counts of the graph graph_trainer runs with ``enabled = false`` equal those of the
stock ``default`` pass pipeline; an ``auto`` run profiles 2 steps, writes the chosen layers
and retraces with them whitened. About 1.5 minutes on 2 shared cores.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from gift_compile.titan_integration.jobs import run_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "llama3_debug_cpu.toml"


def test_disabled_gift_leaves_the_graph_unchanged(tmp_path):
    common = ["--training.steps", "1", "--metrics.log_freq", "1"]
    off = run_job(JOB, tmp_path / "off", *common, "--gift.no-enabled").check()
    stock = run_job(JOB, tmp_path / "stock", *common, "--gift.no-enabled", "--compile.pass_pipeline", "default").check()
    ops = off.graph_ops()
    assert ops == stock.graph_ops()
    assert not any(op.startswith("gift.") for op in ops)
    assert ops["_c10d_functional.reduce_scatter_tensor.default"] == 45  # one per parameter (SimpleFSDP)
    assert "gift_joint_graph_pass" not in off.log


def test_auto_profiles_then_whitens_the_chosen_layers(tmp_path):
    run = run_job(
        JOB, tmp_path / "auto", "--training.steps", "4", "--metrics.log_freq", "1",
        "--gift.layers", "auto", "--gift.auto_profile_steps", "2",
    ).check()
    chosen = tomllib.loads((run.dump_folder / "gift_layers.toml").read_text())["gift"]["layers"]
    assert chosen, run.log[-3000:]
    counters = run.counters(0)
    assert counters["chosen"] == chosen and counters["switched_at"] == 3
    assert {fqn for fqn, c in counters["layers"].items() if c["path"] == "gift"} == set(chosen)
    assert run.series("gift/layers") == {1: 0, 2: 0, 3: len(chosen), 4: len(chosen)}
    assert run.series("gift/profiling") == {1: 1, 2: 1, 3: 0, 4: 0}
    ops = run.graph_ops()
    assert ops.get("gift.begin_step.default", 0) == 0  # the op counts are the first (profiling) graph's
