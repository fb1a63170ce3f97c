"""The ``gift`` section of a torchtitan trainer config: ``--gift.<field>`` / TOML ``[gift]``.

Every :class:`gift_compile.GiftConfig` field appears here with the same name, meaning and
default, except ``enabled`` (off unless asked for) and ``layers`` (a list, because torchtitan's
command line takes lists as one comma-separated value: ``--gift.layers w2,wo``; ``auto`` is the
one-element list ``["auto"]``). Two fields belong to the integration only:
``embedding_dtype`` and ``layers_file``. :func:`to_gift_config` converts and validates (a
``ValueError`` naming the field).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from gift_compile.config import GiftConfig

INTEGRATION_FIELDS = ("embedding_dtype", "layers_file")


@dataclass(kw_only=True, slots=True)
class GiftSection:
    # Defaults are GiftConfig's (one source of truth), except enabled and the list form of layers.
    enabled: bool = False
    """Send gradients through GIFT / FP8 (graph_trainer route). Off: torchtitan runs unchanged."""

    fp8_format: Literal["e4m3", "e5m2"] = GiftConfig.fp8_format
    """FP8 format on the wire: e4m3 (3 mantissa bits, max 448) or e5m2 (2 bits, max 57344)."""

    scaling: Literal["tensor", "row_block"] = GiftConfig.scaling
    """tensor: one fp32 scale per tensor (the paper); row_block: one per scale_block_rows rows."""

    scale_block_rows: int = GiftConfig.scale_block_rows
    """Rows per scale when scaling = row_block."""

    side: Literal["input", "output", "both", "diag", "none"] = GiftConfig.side
    """K-FAC side that whitens: input (G T_A, the paper's choice; commutes with FSDP's dim-0
    reduce-scatter), output, both, diag (ablation) or none (Euclidean FP8 + error feedback)."""

    factorization: Literal["symmetric", "cholesky"] = GiftConfig.factorization
    """T ~ A^-1/2 built as symmetric A^-1/2 (ZCA) or Cholesky L_A^-T."""

    rank: int | None = GiftConfig.rank
    """Rank of the low-rank approximation of A; None uses the full matrix."""

    refresh_interval: int = GiftConfig.refresh_interval
    """K: factors are recomputed every K steps (paper: 50)."""

    damping: float = GiftConfig.damping
    """damping * mean_eigenvalue(A) * I is added to A before factorizing."""

    ema_decay: float = GiftConfig.ema_decay
    """Weight of the previous A at a refresh (0 = forget)."""

    stats_max_tokens: int | None = GiftConfig.stats_max_tokens
    """Tokens per rank used to estimate A at a refresh; None uses all."""

    error_feedback: bool = GiftConfig.error_feedback
    """Keep the quantization error in whitened coordinates and add it back next step."""

    layers: list[str] = field(default_factory=lambda: list(GiftConfig.layers))
    """Linear layers sent whitened: fnmatch patterns on trailing FQN components (default: the
    attention projections; w2, layers.[0-3].*.w2), or auto (profile FP8 boundary hits first, paper Figure 3)."""

    euclidean_dtype: Literal["fp8", "bf16", "fp32"] = GiftConfig.euclidean_dtype
    """Wire dtype of the Linear weight gradients that are not whitened."""

    scale_mode: Literal["per_rank", "global_max"] = GiftConfig.scale_mode
    """per_rank: each sender's own scale travels with its payload; global_max: one shared scale."""

    auto_profile_steps: int = GiftConfig.auto_profile_steps
    """layers = auto: steps of Euclidean FP8 profiling before the layers are chosen."""

    auto_max_layers: int | None = GiftConfig.auto_max_layers
    """layers = auto: keep at most this many (None: cut at the largest drop in hit rate)."""

    embedding_dtype: Literal["fp8", "bf16", "fp32"] = "fp8"
    """(integration) Wire dtype of 2-D gradients that are not Linear weights (the token
    embedding). Norm weights and other 1-D gradients always keep their fp32 collective."""

    layers_file: str = "gift_layers.toml"
    """(integration) Where layers = auto writes the chosen layers, relative to the dump folder;
    the file is a [gift] table that a later run can paste or pass to gift-titan."""


def section_field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GiftSection)]


def to_gift_config(section: GiftSection) -> GiftConfig:
    """The library config this section describes (validated by ``GiftConfig``)."""
    values = {name: getattr(section, name) for name in GiftConfig.field_names()}
    layers = [p for p in values["layers"] if p]  # [] / "" (command line): whiten nothing
    values["layers"] = "auto" if layers == ["auto"] else tuple(layers)
    if "auto" in layers and len(layers) > 1:
        raise ValueError(f"GiftConfig.layers={layers!r} is invalid; 'auto' must be the only entry")
    return GiftConfig(**values)


def section_from_dict(values: dict) -> GiftSection:
    """A section from a TOML ``[gift]`` table: unknown keys and bad values are a ``ValueError``."""
    unknown = sorted(set(values) - set(section_field_names()))
    if unknown:
        raise ValueError(f"unknown [gift] key(s) {unknown}; valid keys: {section_field_names()}")
    values = dict(values)
    if isinstance(values.get("layers"), str):
        values["layers"] = values["layers"].split(",")  # "auto", "w2" or "w2,wo" (command line)
    section = GiftSection(**values)
    to_gift_config(section)  # validate every GiftConfig field now, with its message
    if section.embedding_dtype not in ("fp8", "bf16", "fp32"):
        raise ValueError(f"gift.embedding_dtype={section.embedding_dtype!r} is invalid; allowed values: ['fp8', 'bf16', 'fp32']")
    return section


__all__ = ["GiftSection", "INTEGRATION_FIELDS", "section_field_names", "section_from_dict", "to_gift_config"]
