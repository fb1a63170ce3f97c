"""gift-titan front-end: [gift] section <-> GiftConfig, job-file checks, flags, auto selection.

No training here (fast); the torchtitan runs are in test_titan_train.py / test_titan_disabled.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("torchtitan")

from gift_compile.config import GiftConfig  # noqa: E402
from gift_compile.runtime import LayerCounters  # noqa: E402
from gift_compile.titan_integration import autoselect, launcher  # noqa: E402
from gift_compile.titan_integration.config import (  # noqa: E402
    INTEGRATION_FIELDS, GiftSection, section_field_names, section_from_dict, to_gift_config,
)


def test_every_gift_config_field_is_a_section_field():
    assert set(section_field_names()) == set(GiftConfig.field_names()) | set(INTEGRATION_FIELDS)
    section = GiftSection()
    assert section.enabled is False
    defaults = GiftConfig()
    for name in GiftConfig.field_names():
        if name not in ("enabled", "layers"):
            assert getattr(section, name) == getattr(defaults, name), name
    assert tuple(section.layers) == defaults.layers


def test_an_empty_layer_list_survives_the_command_line(tmp_path):
    # torchtitan's command line spells lists as one comma-separated value, so the launcher
    # sends layers = [] as --gift.layers "": the rank must read it back as [] (whiten nothing).
    job = tmp_path / "job.toml"
    job.write_text("[gift]\nenabled = true\nlayers = []\n")
    settings, _, document = launcher.check_job(launcher.load_job(job))
    section = launcher.parse_with_torchtitan(launcher.titan_args(document, settings)).gift
    assert to_gift_config(section).layers == ()
    # and gift-titan's own flag for "no layers" (what the benchmarks' FP8 runs pass), planned
    # through to the torchrun command (the model check reads it as the rank will)
    settings, _, document = launcher.check_job(launcher.load_job(job, ["--gift.layers="]))
    assert document["gift"]["layers"] == []
    assert "--gift.layers " in launcher.plan([str(job), "--gift.layers=", "--dry-run"]).describe()


def test_the_launcher_prints_no_warning_of_its_own_making(tmp_path, caplog):
    # torchtitan's checkpoint config warned three times per gift-titan call (even --dry-run)
    # that its default initial_load_model_only has no effect without an initial_load_path.
    job = tmp_path / "job.toml"
    job.write_text("[gift]\nenabled = true\n")
    with caplog.at_level("INFO"):
        launcher.plan([str(job), "--dry-run"])
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


def test_the_console_line_uses_the_metric_names():
    from gift_compile.titan_integration.session import CONSOLE_METRICS, console_line

    metrics = dict.fromkeys(CONSOLE_METRICS, None) | {"gift/bytes_ratio_vs_fp32": 0.25, "gift/layers": 12}
    line = console_line(metrics)
    assert "gift/bytes_ratio_vs_fp32=0.25 " in line and "gift/layers=12 " in line and "gift/error_vs_fp8=- " in line
    assert line.count("gift/") == len(CONSOLE_METRICS)


def test_section_converts_to_gift_config():
    assert to_gift_config(GiftSection(enabled=True, layers=["auto"])).layers == "auto"
    assert to_gift_config(GiftSection(layers=["w2", "wo"], low_rank=None)).layers == ("w2", "wo")
    with pytest.raises(ValueError, match="'auto' must be the only entry"):
        to_gift_config(GiftSection(layers=["auto", "w2"]))
    assert section_from_dict({"layers": "auto"}).layers == ["auto"]


def test_bad_gift_key_is_a_clear_error(tmp_path, capsys):
    err = refusal(tmp_path, capsys, "[launch]\nnproc = 2\n\n[gift]\nenabled = true\nrnak = 16\n")
    assert "unknown [gift] key(s) ['rnak']" in err and "'low_rank'" in err


def test_deprecated_rank_key_reaches_torchtitan_as_low_rank(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[gift]\nenabled = true\nrank = 16\n")
    with pytest.warns(DeprecationWarning, match="'rank' is deprecated; use 'low_rank'"):
        settings, _, document = launcher.check_job(launcher.load_job(job))
    assert launcher.parse_with_torchtitan(launcher.titan_args(document, settings)).gift.low_rank == 16


def test_section_help_comes_from_the_gift_config_docstrings():
    from gift_compile.config import field_docs

    docs = field_docs(GiftConfig)
    assert set(docs) == set(GiftConfig.field_names())
    assert docs["meter_interval"].startswith("Every N steps")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nstepz = 3\n", "unknown key 'training.stepz'"),
        ("[trainingg]\nsteps = 3\n", "unknown key 'trainingg'"),
        ("[launch]\nnprocs = 2\n", "unknown [launch] key(s) ['nprocs']"),
        ("[gift]\nfp8_format = \"e4m4\"\n", "GiftConfig.fp8_format='e4m4' is invalid"),
        ("training = 3\n", "'training' is a section"),
    ],
)
def test_bad_job_files(tmp_path, capsys, text, message):
    assert message in refusal(tmp_path, capsys, text)


def refusal(tmp_path, capsys, text: str) -> str:
    """What ``gift-titan --dry-run`` prints when it refuses the job file ``text`` (exit code 2)."""
    job = tmp_path / "job.toml"
    job.write_text(text)
    assert launcher.main([str(job), "--dry-run"]) == 2
    return capsys.readouterr().err


def test_flags_override_the_file_and_reach_torchtitan(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text('dump_folder = "x"\n[launch]\nnproc = 2\n[training]\nsteps = 50\n[gift]\nenabled = true\nlayers = ["w2"]\n')
    document = launcher.load_job(job, ["--training.steps", "3", "--gift.layers=w2,wo", "--gift.no-error_feedback", "--gift.low_rank", "None"])
    settings, _, document = launcher.check_job(document)
    args = launcher.titan_args(document, settings)
    config = launcher.parse_with_torchtitan(args)
    assert config.training.steps == 3
    assert config.gift.enabled and config.gift.layers == ["w2", "wo"] and config.gift.error_feedback is False
    assert config.gift.low_rank is None
    assert config.compile.pass_pipeline == "gift"
    assert launcher.main([str(job), "--dry-run", "--nproc", "3"]) == 0
    assert "--nproc_per_node=3" in capsys.readouterr().out


def test_auto_selection_cuts_at_the_largest_drop():
    rates = [
        autoselect.LayerHitRate("a.w2", 90, 1000), autoselect.LayerHitRate("b.w2", 80, 1000),
        autoselect.LayerHitRate("c.wo", 10, 1000), autoselect.LayerHitRate("d.wo", 8, 1000),
        autoselect.LayerHitRate("e.w1", 0, 1000),
    ]
    assert autoselect.choose_layers(rates) == ["a.w2", "b.w2"]
    assert autoselect.choose_layers(rates, max_layers=3) == ["a.w2", "b.w2", "c.wo"]
    assert autoselect.choose_layers([autoselect.LayerHitRate("x", 0, 10)]) == []
    counters = {"a": LayerCounters("fp8")}
    for saturated, flushed in [(2.0, 1.0), (1.0, 0.0)]:
        counters["a"].add_step(torch.tensor([saturated, flushed, 0.0, 1.0, 0.0, 1.0, 0.0]), bytes_sent=10)
    assert autoselect.global_hit_counts(counters, {"a": 10}) == [autoselect.LayerHitRate("a", 4, 20)]
    text = autoselect.layers_toml(["a.w2"], rates, 100)
    assert 'layers = ["a.w2"]' in text


def test_shims_are_not_applied_on_import():
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    import gift_compile.titan_integration.job_configs  # noqa: F401  (imports torchtitan)
    import torchtitan.tools.utils as utils

    from gift_compile.titan_integration import cpu_support

    if cpu_support.APPLIED:
        pytest.skip("another test in this process applied the shims")
    assert not hasattr(FSDPModule.set_gradient_divide_factor, "__wrapped__")
    assert utils.device_module is not cpu_support.CPU_DEVICE_MODULE
    assert "fsdp_force_sum" in cpu_support.needed_shims()
    assert dataclasses.is_dataclass(GiftSection)
    del dist


def test_one_node_runs_standalone_and_several_nodes_share_a_rendezvous(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text("[launch]\nnproc = 2\n[gift]\nenabled = true\n")
    assert launcher.main([str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--standalone" in out and "--nproc_per_node=2" in out
    argv = [str(job), "--dry-run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port", "29512"]
    assert launcher.main(argv) == 0
    out = capsys.readouterr().out
    for flag in ("--nnodes=2", "--node_rank=1", "--master_addr=10.1.2.3", "--master_port=29512", "--nproc_per_node=2"):
        assert flag in out
    assert "--standalone" not in out


@pytest.mark.parametrize(
    "launch, message",
    [
        ("nnodes = 2\nnode_rank = 0\n", "master_port is needed with nnodes > 1"),
        ("nnodes = 2\nnode_rank = 2\nmaster_port = 29500\n", "node_rank = 2 is invalid"),
        ("master_port = 70000\n", "master_port = 70000 is invalid"),
        ('module = "os"\n', "module = 'os' is not allowed"),
        ('config = "run_everything"\n', "config = 'run_everything' is not a config of"),
        ('config = "CONFIGS"\n', "config = 'CONFIGS' is not a config of"),
    ],
)
def test_bad_launch_settings_are_refused_before_anything_runs(tmp_path, capsys, launch, message):
    assert message in refusal(tmp_path, capsys, "[launch]\n" + launch)


@pytest.mark.parametrize(
    "gift, message",
    [
        ("layers = 5", "GiftConfig.layers=5 is invalid"),
        ('layers = [""]', "GiftConfig.layers=[''] is invalid; use 'auto' or a sequence of non-empty fnmatch patterns"),
        ("fallback_retry = 10000000000", "GiftConfig.fallback_retry=10000000000 is invalid; it must be an integer in [1, 2147483647]"),
        ("damping = true", "GiftConfig.damping=True is invalid"),
        ('layers_file = "../../x.toml"', "gift.layers_file='../../x.toml' is invalid"),
        ("compile_codec = 1", "gift.compile_codec=1 is invalid; it must be a bool"),
    ],
)
def test_loose_gift_values_name_their_field(tmp_path, capsys, gift, message):
    assert message in refusal(tmp_path, capsys, f"[gift]\nenabled = true\n{gift}\n")


def test_the_standard_trainer_takes_an_eager_codec(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text('[launch]\nconfig = "llama3_debug_standard"\n[gift]\nenabled = true\ncompile_codec = false\n')
    assert launcher.main([str(job), "--dry-run"]) == 0
    assert "--gift.no-compile_codec" in capsys.readouterr().out


def test_a_pattern_matching_no_layer_stops_the_launch_before_any_rank(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(f'dump_folder = "{tmp_path / "out"}"\n[launch]\nnproc = 2\n[gift]\nenabled = true\nlayers = ["nomatch"]\n')
    assert launcher.main([str(job)]) == 2  # not a dry run: it would have started torchrun
    err = capsys.readouterr().err
    assert "['nomatch'] match no Linear layer" in err and "layers.0.attention.qkv_linear.wqkv" in err
    assert not (tmp_path / "out").exists()


def test_the_test_harness_reports_a_refused_job_without_starting_it(tmp_path):
    from gift_compile.testing.titan_jobs import run_job

    job = tmp_path / "job.toml"
    job.write_text('[launch]\nnproc = 2\n[gift]\nenabled = true\nlayers = ["nomatch"]\n')
    result = run_job(job, tmp_path / "out")
    assert result.returncode == 2 and result.log.startswith("gift-titan: error: [gift] layers: ")
    assert "['nomatch'] match no Linear layer" in result.log
    assert not (tmp_path / "out").exists()
