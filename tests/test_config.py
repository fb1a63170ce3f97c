import warnings

import pytest

from gift_compile.config import GiftConfig


def test_defaults_are_valid_and_frozen():
    config = GiftConfig()
    assert config.factor_source == "current_step" and config.low_rank == 32 and config.whitening_layout == "lowrank"
    with pytest.raises(Exception):
        config.low_rank = 4  # frozen


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("fp8_format", "e3m4", "allowed values"),
        ("factor_source", "sometimes", "allowed values"),
        ("low_rank", 0, r"integer in \[1, 2147483647\]"),
        ("low_rank", 2.5, "integer in"),
        ("refresh_interval", 0, "integer in"),
        ("meter_interval", True, "integer in"),  # bool is an int in Python
        # Upper bounds: a value that would overflow int64 step arithmetic hours later (at the
        # first fallback) is refused now, naming its field and the range.
        ("fallback_retry", 2**63 - 1, r"integer in \[1, 2147483647\]"),
        ("fallback_retry", 10**30, r"integer in \[1, 2147483647\]"),
        ("meter_interval", 2**31, r"integer in \[1, 2147483647\]"),
        ("stats_max_tokens", 2**40, "integer in"),
        ("wire_piece_kib", -1, r"integer in \[0, 2147483647\]"),  # 0 (one call per message) is valid
        ("wire_piece_kib", 64.0, "integer in"),
        ("parameter_piece_kib", -1, r'integer in \[0, 2147483647\] or "auto"'),
        ("parameter_piece_kib", "fast", r'integer in \[0, 2147483647\] or "auto"'),
        ("damping", -1.0, "number in"),
        ("damping", True, "number in"),
        ("damping", 1e-300, r"number in \[1e-08, 1000\)"),  # gave NaN factors on a zero input
        ("damping", 0.0, "number in"),
        ("ema_decay", 1.0, "number in"),
        ("layers", "w2", "layers"),
        ("layers", 5, "layers"),
        ("layers", ("w2", ""), "layers"),
        ("layers", ("",), "non-empty fnmatch patterns"),
        ("layers", ["auto", "w2"], "'auto' must be the only entry"),
        ("euclidean_dtype", "fp16", "allowed values"),
        ("stats_group", "world", "allowed values"),
        ("all_gather_dtype", "fp32", "allowed values"),
        ("scale_mode", "shared", "allowed values"),
        ("enabled", "yes", "true or false"),
        ("fallback", 1, "true or false"),
    ],
)
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message) as info:
        GiftConfig(**{field: value})
    assert f"GiftConfig.{field}=" in str(info.value)


def test_the_bounds_themselves_are_valid():
    assert GiftConfig(fallback_retry=2**31 - 1, meter_interval=2**31 - 1, damping=1e-8).fallback_retry == 2**31 - 1
    assert GiftConfig(wire_piece_kib=0).wire_piece_kib == 0
    assert GiftConfig().parameter_piece_kib == "auto" and GiftConfig(parameter_piece_kib=0).parameter_piece_kib == 0
    assert GiftConfig(layers=["auto"]).layers == "auto" and GiftConfig(layers=[]).layers == ()


def test_empty_pattern_from_toml_is_refused_as_in_python(tmp_path):
    # One validation: layers = [""] used to be refused by GiftConfig but silently mean
    # "whiten nothing" when it came from a TOML table.
    with pytest.raises(ValueError) as python:
        GiftConfig(layers=("",))
    path = tmp_path / "job.toml"
    path.write_text('[gift]\nlayers = [""]\n')
    with pytest.raises(ValueError) as toml:
        GiftConfig.from_toml(path)
    assert str(toml.value) == str(python.value).replace("('',)", "['']")
    path.write_text("[gift]\nlayers = []\n")
    assert GiftConfig.from_toml(path).layers == ()  # the empty list: whiten nothing, in both


def test_cholesky_needs_periodic_factors():
    with pytest.raises(ValueError, match="factor_source='periodic'"):
        GiftConfig(factorization="cholesky")
    assert GiftConfig(factorization="cholesky", factor_source="periodic").whitening_layout == "dense"
    assert GiftConfig(factor_source="periodic", low_rank=None).whitening_layout == "dense"
    assert GiftConfig(low_rank=None).whitening_layout == "lowrank"  # current step, full rank: V diag V^T
    assert GiftConfig(low_rank=64).factor_rank(48) == 48 and GiftConfig(low_rank=None).factor_rank(48) == 48


def test_from_dict_rejects_unknown_keys_and_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown GIFT config key") as info:
        GiftConfig.from_dict({"low_rank": 8, "lowrank": 8})
    assert "'lowrank'" in str(info.value) and "refresh_interval" in str(info.value)


def test_removed_side_key_explains_itself():
    with pytest.raises(ValueError, match="'side' was removed: GIFT whitens the input side"):
        GiftConfig.from_dict({"side": "output"})


def test_from_toml_reads_the_gift_table_and_the_deprecated_rank_key(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[training]\nsteps = 3\n\n[gift]\nenabled = true\nrank = 8\nlayers = ["w2", "wo"]\nfp8_format = "e5m2"\n')
    with pytest.warns(DeprecationWarning, match="'rank' is deprecated; use 'low_rank'"):
        config = GiftConfig.from_toml(path)
    assert config == GiftConfig(enabled=True, low_rank=8, layers=("w2", "wo"), fp8_format="e5m2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no table, no deprecated key: no warning
        assert GiftConfig.from_toml(path, table="missing") == GiftConfig()
    with pytest.raises(ValueError, match="give 'low_rank' only"):
        GiftConfig.from_dict({"rank": 8, "low_rank": 8})


def test_the_readme_documents_every_config_key():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    for name in GiftConfig.field_names():
        assert f"| `{name}` |" in table, name
