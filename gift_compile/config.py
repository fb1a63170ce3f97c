"""``GiftConfig``: every knob of GIFT in one frozen, validated dataclass.

The same object drives the eager reference, the compiler pass and the torchtitan
integration, so a TOML ``[gift]`` table, a ``--gift.<field>`` flag and a Python
keyword all mean the same thing.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

Fp8Format = Literal["e4m3", "e5m2"]
Scaling = Literal["tensor", "row_block"]
Side = Literal["input", "output", "both", "diag", "none"]
Factorization = Literal["symmetric", "cholesky"]
EuclideanDtype = Literal["fp8", "bf16", "fp32"]
ScaleMode = Literal["per_rank", "global_max"]


@dataclass(frozen=True, kw_only=True)
class GiftConfig:
    enabled: bool = True
    """Master switch. When False every gradient is reduced exactly as without GIFT."""

    fp8_format: Fp8Format = "e4m3"
    """FP8 format on the wire: ``e4m3`` (3 mantissa bits, max 448) or ``e5m2`` (2 bits, max 57344)."""

    scaling: Scaling = "tensor"
    """``tensor``: one fp32 scale per tensor (the paper). ``row_block``: one scale per
    ``scale_block_rows`` rows, which tracks rows of very different magnitude."""

    scale_block_rows: int = 128
    """Rows per scale when ``scaling == "row_block"``."""

    side: Side = "input"
    """Which K-FAC factor whitens the gradient. ``input`` (``G T_A``, the paper's choice and
    the only one that commutes with dim-0 sharding), ``output`` (``T_B G``), ``both``,
    ``diag`` (diagonal of A only, an ablation) or ``none`` (Euclidean FP8 with error feedback)."""

    factorization: Factorization = "symmetric"
    """How ``T ~ A^-1/2`` is built: ``symmetric`` (``A^-1/2``, ZCA) or ``cholesky`` (``L_A^-T``)."""

    rank: int | None = 32
    """Rank of the low-rank approximation of A (top eigenpairs + isotropic rest). ``None``
    uses the full matrix."""

    refresh_interval: int = 10
    """K: the factors are recomputed every K steps from that step's layer inputs. The paper
    uses 50; on our measurements (benchmarks/results/fidelity.md) the gain of fresh factors
    is gone within ~10 steps on a fast-moving model."""

    damping: float = 1e-1
    """Added to A as ``damping * mean_eigenvalue(A) * I`` before factorizing. It bounds how
    much a stale factor can amplify directions that had little input variance at the
    refresh (1e-1 measured better than 1e-3 both fresh and stale), and keeps dead inputs finite."""

    ema_decay: float = 0.5
    """Weight of the previous A when a refresh mixes in new statistics (0 = forget)."""

    stats_max_tokens: int | None = 8192
    """Tokens per rank used to estimate A at a refresh (evenly strided subsample);
    ``None`` uses every token."""

    error_feedback: bool = True
    """Keep the quantization error of whitened gradients and add it back next step."""

    layers: tuple[str, ...] | Literal["auto"] = ("w[qkvo]*",)
    """Linear layers sent in whitened coordinates (default: the attention projections ``wq``,
    ``wk``, ``wv``, ``wo`` or a fused ``wqkv``, which gained most in our fidelity measurements;
    the paper picks ``w2``). Each pattern is matched with ``fnmatch``
    component by component against the trailing components of the dotted FQN, so ``"w2"``
    selects ``layers.3.feed_forward.w2`` and ``"layers.[0-3].*.w2"`` the first four.
    ``"auto"`` profiles FP8 boundary hits first (torchtitan integration)."""

    euclidean_dtype: EuclideanDtype = "fp8"
    """How Linear weight gradients that are not selected travel: ``fp8``, ``bf16`` or ``fp32``."""

    scale_mode: ScaleMode = "per_rank"
    """``per_rank``: every sender's own scale travels with its payload (exact). ``global_max``:
    one scale max-synchronized across ranks first (the paper's shared scale), for ablations."""

    auto_profile_steps: int = 100
    """With ``layers = "auto"``: steps of Euclidean FP8 profiling before layers are chosen."""

    auto_max_layers: int | None = None
    """With ``layers = "auto"``: keep at most this many layers (``None``: cut at the largest
    drop in boundary-hit rate, as in the paper's Figure 3)."""

    def __post_init__(self) -> None:
        for name, choices in _LITERAL_FIELDS.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"GiftConfig.{name}={value!r} is invalid; allowed values: {list(choices)}")
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.layers != "auto":
            if isinstance(self.layers, str) or not all(isinstance(p, str) and p for p in self.layers):
                raise ValueError(
                    f"GiftConfig.layers={self.layers!r} is invalid; use 'auto' or a sequence of "
                    "non-empty fnmatch patterns such as ('w2',)"
                )
        _check_int("scale_block_rows", self.scale_block_rows, minimum=1)
        _check_int("refresh_interval", self.refresh_interval, minimum=1)
        _check_int("auto_profile_steps", self.auto_profile_steps, minimum=1)
        if self.rank is not None:
            _check_int("rank", self.rank, minimum=1)
        if self.stats_max_tokens is not None:
            _check_int("stats_max_tokens", self.stats_max_tokens, minimum=1)
        if self.auto_max_layers is not None:
            _check_int("auto_max_layers", self.auto_max_layers, minimum=1)
        if not (isinstance(self.damping, (int, float)) and 0.0 < self.damping < 1e3):
            raise ValueError(f"GiftConfig.damping={self.damping!r} is invalid; it must be a float in (0, 1000)")
        if not (isinstance(self.ema_decay, (int, float)) and 0.0 <= self.ema_decay < 1.0):
            raise ValueError(f"GiftConfig.ema_decay={self.ema_decay!r} is invalid; it must be a float in [0, 1)")
        for name in ("enabled", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GiftConfig.{name}={getattr(self, name)!r} is invalid; it must be true or false")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GiftConfig:
        """Build from a plain mapping (a parsed TOML table); unknown keys are an error."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown GIFT config key(s) {unknown}; valid keys: {cls.field_names()}")
        return cls(**values)

    @classmethod
    def from_toml(cls, path: str | Path, table: str = "gift") -> GiftConfig:
        """Read the ``[table]`` of a TOML file; a missing table gives the defaults."""
        with open(path, "rb") as f:
            document = tomllib.load(f)
        values = document.get(table, {})
        if not isinstance(values, dict):
            raise ValueError(f"{path}: [{table}] must be a table, got {type(values).__name__}")
        return cls.from_dict(values)

    def replace(self, **changes: Any) -> GiftConfig:
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"GiftConfig.{name}={value!r} is invalid; it must be an integer >= {minimum}")


_LITERAL_FIELDS: dict[str, tuple[str, ...]] = {
    "fp8_format": get_args(Fp8Format),
    "scaling": get_args(Scaling),
    "side": get_args(Side),
    "factorization": get_args(Factorization),
    "euclidean_dtype": get_args(EuclideanDtype),
    "scale_mode": get_args(ScaleMode),
}

__all__ = ["GiftConfig"]
