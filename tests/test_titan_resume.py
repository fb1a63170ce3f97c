"""A resume must whiten the layers its checkpoint holds GIFT state for.

``gift-titan`` refuses a mismatched resume before any rank starts, reading only the DCP
checkpoint's metadata, and every rank still refuses one when DCP loads it (a job started with
``torchrun`` directly). The checkpoints here are real DCP checkpoints of GIFT's state, written
in this process; the torchtitan jobs that refuse a real resume are in test_titan_train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

pytest.importorskip("torchtitan")

from gift_compile.config import GiftConfig  # noqa: E402
from gift_compile.runtime import GiftRuntime  # noqa: E402
from gift_compile.titan_integration import launcher  # noqa: E402
from gift_compile.titan_integration.checkpoint import KEY, GiftCheckpointState, explain_failed_loads  # noqa: E402

DIM = 256  # the debug model's width: its attention's wo is a DIM x DIM Linear
WO = [f"layers.{i}.attention.wo" for i in range(6)]


def gift_state(layers: list[str]) -> GiftCheckpointState:
    runtime = GiftRuntime(GiftConfig(enabled=True, layers=("wo",)))
    for fqn in layers:
        runtime.state.layer(fqn, DIM, DIM)
    return GiftCheckpointState(runtime)


def save(folder: Path, step: int, layers: list[str]) -> Path:
    """A checkpoint as torchtitan's checkpointer lays it out: ``<folder>/step-<N>``, GIFT's state under its key."""
    checkpoint = folder / f"step-{step}"
    dcp.save({KEY: gift_state(layers)}, checkpoint_id=str(checkpoint), no_dist=True)
    return checkpoint


def launch(tmp_path: Path, capsys, *flags: str) -> tuple[int, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    job = tmp_path / "job.toml"
    job.write_text(f'dump_folder = "{tmp_path}"\n[checkpoint]\nenable = true\n[gift]\nenabled = true\n')
    code = launcher.main([str(job), "--dry-run", *flags])
    return code, capsys.readouterr().err


def test_gift_titan_refuses_a_resume_that_whitens_other_layers(tmp_path, capsys):
    save(tmp_path / "checkpoint", 5, WO)
    code, err = launch(tmp_path, capsys, "--gift.layers", "wqkv")
    assert code == 2
    assert f"the checkpoint holds state for the whitened layers {WO}, but this run whitens ['layers.0.attention.qkv_linear.wqkv'" in err
    # "auto" whitens nothing until it has profiled: it cannot take the saved state either
    code, err = launch(tmp_path, capsys, "--gift.layers", "auto")
    assert code == 2 and f"holds state for the whitened layers {WO}, but this run whitens []" in err
    assert "layers_file" in err  # says how to resume an "auto" run
    assert launch(tmp_path, capsys, "--gift.layers", "wo") == (0, "")


def test_the_checkpoint_checked_is_the_one_torchtitan_loads(tmp_path, capsys):
    # torchtitan loads --checkpoint.load_step, else the latest step-N with DCP metadata
    save(tmp_path / "checkpoint", 5, WO)
    save(tmp_path / "checkpoint", 10, WO[:2])
    (tmp_path / "checkpoint" / "step-15").mkdir()  # no .metadata: an unfinished save, not loaded
    assert launch(tmp_path, capsys, "--gift.layers", "layers.0.attention.wo,layers.1.attention.wo")[0] == 0
    assert launch(tmp_path, capsys, "--gift.layers", "wo")[0] == 2
    assert launch(tmp_path, capsys, "--gift.layers", "wo", "--checkpoint.load_step", "5")[0] == 0
    # nothing to resume: a fresh start with any layers, and "auto" after a profile-time checkpoint
    assert launch(tmp_path / "fresh", capsys, "--gift.layers", "wqkv")[0] == 0
    save(tmp_path / "profiled" / "checkpoint", 1, [])
    assert launch(tmp_path / "profiled", capsys, "--gift.layers", "auto")[0] == 0


class Checkpointer:
    """What ``explain_failed_loads`` wraps: torchtitan's checkpointer loads through ``dcp_load``."""

    def dcp_load(self, state_dict, checkpoint_id):
        dcp.load(state_dict, checkpoint_id=checkpoint_id, no_dist=True)


@pytest.mark.parametrize("current", [["layers.0.attention.qkv_linear.wqkv"], WO[:1]], ids=["missing-in-checkpoint", "fewer"])
def test_each_rank_explains_a_mismatched_resume_it_was_started_with(tmp_path, current):
    # A layer the checkpoint lacks fails inside DCP ("Missing key"), explained by the wrapper;
    # fewer layers than saved load, and the state's own load refuses them.
    checkpoint = save(tmp_path, 5, WO)
    checkpointer, state = Checkpointer(), gift_state(current)
    explain_failed_loads(checkpointer, state.runtime)
    with pytest.raises(ValueError, match=rf"holds state for the whitened layers \[.*'layers.5.attention.wo'\], "
                                         rf"but this run whitens \['{current[0]}'\]"):
        checkpointer.dcp_load({KEY: state}, str(checkpoint))


def test_a_resume_with_the_same_layers_loads_their_state(tmp_path):
    checkpointer, saved, fresh = Checkpointer(), gift_state(WO), gift_state(WO)
    explain_failed_loads(checkpointer, fresh.runtime)
    for layer in saved.runtime.state.layers.values():
        for tensor in layer.geometry_tensors():  # the basis and factors the checksum reads
            tensor.normal_()
    dcp.save({KEY: saved}, checkpoint_id=str(tmp_path / "same"), no_dist=True)
    assert float(fresh.runtime.state.checksum()) != pytest.approx(float(saved.runtime.state.checksum()), rel=1e-3)
    checkpointer.dcp_load({KEY: fresh}, str(tmp_path / "same"))
    assert float(fresh.runtime.state.checksum()) == pytest.approx(float(saved.runtime.state.checksum()), rel=1e-12)
