import pytest

from gift_compile.config import GiftConfig


def test_defaults_are_valid_and_frozen():
    config = GiftConfig()
    assert config.side == "input" and config.rank == 32 and config.refresh_interval == 10 and config.damping == 0.1
    with pytest.raises(Exception):
        config.rank = 4  # frozen


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("fp8_format", "e3m4", "fp8_format"),
        ("side", "left", "allowed values"),
        ("rank", 0, "rank"),
        ("rank", 2.5, "rank"),
        ("refresh_interval", 0, "refresh_interval"),
        ("damping", -1.0, "damping"),
        ("ema_decay", 1.0, "ema_decay"),
        ("layers", "w2", "layers"),
        ("layers", ("w2", ""), "layers"),
        ("euclidean_dtype", "fp16", "euclidean_dtype"),
        ("scale_mode", "shared", "scale_mode"),
        ("enabled", "yes", "enabled"),
    ],
)
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message) as info:
        GiftConfig(**{field: value})
    assert field in str(info.value)


def test_from_dict_rejects_unknown_keys_and_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown GIFT config key") as info:
        GiftConfig.from_dict({"rank": 8, "rnak": 8})
    assert "'rnak'" in str(info.value) and "refresh_interval" in str(info.value)


def test_from_toml_reads_the_gift_table(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[training]\nsteps = 3\n\n[gift]\nenabled = true\nrank = 8\nlayers = ["w2", "wo"]\nfp8_format = "e5m2"\n')
    config = GiftConfig.from_toml(path)
    assert config == GiftConfig(enabled=True, rank=8, layers=("w2", "wo"), fp8_format="e5m2")
    assert GiftConfig.from_toml(path, table="missing") == GiftConfig()
