"""``GiftConfig``: every knob of GIFT in one frozen, validated dataclass.

The same object drives the eager reference, the compiler pass and the torchtitan
integration, so a TOML ``[gift]`` table, a ``--gift.<field>`` flag and a Python
keyword all mean the same thing. Choices derived from several fields (the storage layout of
the factors, whether a layer keeps a residual) are properties here, computed in one place.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

Fp8Format = Literal["e4m3", "e5m2"]
Scaling = Literal["tensor", "row_block"]
FactorSource = Literal["current_step", "periodic"]
Factorization = Literal["symmetric", "cholesky"]
WhiteningLayout = Literal["dense", "lowrank"]
GiftDtype = Literal["fp8", "fp4"]
EuclideanDtype = Literal["fp8", "fp4", "bf16", "fp32"]
Fp4Format = Literal["nvfp4", "mxfp4"]
GatherDtype = Literal["wire", "bf16"]
StatsDtype = Literal["fp32", "bf16"]
StatsSource = Literal["inputs", "gradients"]
StatsGroup = Literal["own", "shared"]
ScaleMode = Literal["per_rank", "global_max"]

# Keys a [gift] table may still use, with the field that replaced them; and old values.
DEPRECATED_KEYS = {"rank": "low_rank"}
DEPRECATED_VALUES = {("all_gather_dtype", "fp8"): "wire"}  # from before FP4: the gather re-encodes on the layer's wire
REMOVED_KEYS = {
    "side": "GIFT whitens the input side only (G T_A, the paper's choice and the only one that commutes "
    "with dim-0 sharding); the output/both/diag ablations live in benchmarks/fidelity.py",
}


@dataclass(frozen=True, kw_only=True)
class GiftConfig:
    enabled: bool = True
    """Master switch. When False every gradient is reduced exactly as without GIFT."""

    gift_dtype: GiftDtype = "fp8"
    """The wire of the whitened layers: ``fp8`` (8 bits per value, 0.25x fp32's bytes) or ``fp4``
    (E2M1 with block scales, ``fp4_format``: 4.25-4.5 bits per value, ~0.14x fp32's bytes). A
    whitened layer on its fallback keeps this wire (Euclidean FP4 for an FP4 layer)."""

    fp8_format: Fp8Format = "e4m3"
    """FP8 format on the wire: ``e4m3`` (3 mantissa bits, max 448) or ``e5m2`` (2 bits, max 57344)."""

    fp4_format: Fp4Format = "nvfp4"
    """FP4 encoding: ``nvfp4`` (16 values per E4M3 block scale, times an fp32 scale per sender:
    4.5 bits per value) or ``mxfp4`` (32 values per power-of-two scale: 4.25 bits). Blocks run
    along ``d_in``, the axis whitening mixes."""

    scaling: Scaling = "tensor"
    """``tensor``: one fp32 scale per tensor (the paper). ``row_block``: one scale per
    ``scale_block_rows`` rows, which tracks rows of very different magnitude."""

    scale_block_rows: int = 128
    """Rows per scale when ``scaling == "row_block"``."""

    factor_source: FactorSource = "current_step"
    """Where the whitening ``T ~ A^-1/2`` comes from. ``current_step``: this step's global layer
    inputs, every step (a warm-started subspace iteration: each rank sends ``X^T X Q``, ``d_in x
    low_rank`` floats, in one all-reduce placed right after the layer's forward). ``periodic``:
    recomputed every ``refresh_interval`` steps from an EMA of ``A`` (the paper's schedule; its
    factors go stale in between, see README)."""

    factorization: Factorization = "symmetric"
    """``symmetric`` (``A^-1/2``, ZCA) or ``cholesky`` (``L_A^-T``, the paper's; ``periodic`` only)."""

    low_rank: int | None = 32
    """Rank of the approximation of ``A`` (top eigenpairs + isotropic rest); ``None`` or a value
    >= the layer's ``d_in`` uses the full matrix. (TOML: ``rank`` is a deprecated alias.)"""

    damping: float = 1.0
    """Added to ``A`` as ``damping * mean_eigenvalue(A) * I`` before factorizing. It bounds how much
    the transform can amplify directions with little input variance (whose estimate from one
    step's tokens is noisy) and keeps dead inputs finite; 1.0 measured best in the training
    loop (benchmarks/fidelity_loop.py), also for fresh factors. With ``adaptive_damping``: each
    layer's starting value."""

    adaptive_damping: bool = False
    """Current-step factors only: each whitened layer moves its own damping (its whitening
    strength, from full whitening towards ``T = I``, Euclidean) by a factor of 2 at each live
    meter reading, in the direction that lowered the reading, within ``2^-7`` to ``2^7`` times
    ``damping`` (``state.py``). Every rank reads the same summed meter, so every rank holds the same damping.
    Layers that read one input then each sketch it (their damping differs)."""

    stats_source: StatsSource | None = None
    """Current-step factors only: the second moment ``T`` whitens (``None``, the default:
    ``gradients``; the ``periodic`` factors are always built from an EMA of ``A``).
    ``gradients``: the ranks' weight gradients' own input-side Gram ``S = sum_k G_k^T G_k``,
    sketched where each gradient exists (``G_k^T G_k Q``, ``d_in x low_rank`` floats per layer,
    none shared) and read by a Nystrom approximation; the encoding waits for that all-reduce.
    ``inputs``: the layer inputs' ``A = E[x x^T]`` (K-FAC's input factor, the paper's, which
    approximates ``S`` only where ``dY`` is white and independent of ``X``), sketched right after
    the forward, once for the layers that read one input. In the training loop ``S`` gives
    0.43x against ``A``'s 0.57x of Euclidean FP4's error on the attention
    layers of a model trained on Tiny Shakespeare, 0.33x against 0.39x on WikiText-2, and no
    whitened layer above the same route's FP8 in any 25-step window on the four in-loop cases
    (README, "Whitening by the gradients' own statistics"). ``inputs`` costs fewer statistics
    bytes (shared sketches) and sends them before the backward."""

    @property
    def statistics(self) -> StatsSource:
        """``stats_source`` with its default resolved: what the factors are built from."""
        return self.stats_source or ("gradients" if self.factor_source == "current_step" else "inputs")

    stats_dtype: StatsDtype = "fp32"
    """Dtype of the current-step statistics on the wire (``d_in x low_rank`` per layer, summed over
    the ranks): ``fp32``, or ``bf16`` at half the bytes (the sums round to 8 mantissa bits; every
    rank still builds the same factors from the same summed bytes)."""

    stats_group: StatsGroup = "own"
    """torchtitan's trainers: the process group the current-step statistics are summed on. ``own``:
    a group of their own with the data-parallel ranks (one more process group per data-parallel
    mesh dimension), so a statistics all-reduce never queues with FSDP's parameter all-gathers
    (measured over a shaped link: docs/design.md §10); ``shared``: the gradients' group."""

    stats_max_tokens: int | None = 8192
    """Tokens per rank used for the statistics of ``A`` (evenly strided subsample); ``None``: all."""

    refresh_interval: int = 10
    """``periodic`` only: K, the steps between factor refreshes (the paper uses 50)."""

    ema_decay: float = 0.5
    """``periodic`` only: weight of the previous ``A`` when a refresh mixes in new statistics."""

    error_feedback: bool = True
    """Whitened layers keep their quantization error and add it to the next step's gradient
    (and, on the all-reduce route, the owner of each reduced shard does the same for the
    second quantization)."""

    euclidean_error_feedback: bool = False
    """The same error feedback for the Linear layers that travel as Euclidean FP8."""

    all_gather_dtype: GatherDtype = "wire"
    """All-reduce route only (replicate / DDP): the dtype of its second phase, the all-gather of
    the reduced shards. ``wire``: the owner re-encodes its shard on the layer's own wire (FP8 or
    FP4, with error feedback at the owner), so the all-reduce keeps the wire's bytes; ``bf16``
    sends the shards in bf16 (FP8 layers: 0.375x fp32's bytes) and adds almost no error.
    (``fp8`` is the old name of ``wire``.)"""

    overlap: bool = True
    """Issue each gradient collective as soon as its input exists and wait for it only after the
    next one has been issued, so the rest of the backward computes while its bytes travel
    (``passes/overlap.py``). Off: each collective is waited on where it was issued."""

    wire_piece_kib: int = 128
    """gloo only: a quantized gradient message larger than this per destination (KiB) travels in
    pieces of at most this size, several ``all_to_all`` calls instead of one, because gloo moves
    one large call at a fraction of a slow link's rate and pieces at nearly all of it
    (``passes/pieces.py``, ``collectives.all_to_all_in_pieces``). 0 sends each message in one
    call. Every route: the graph routes' traced collectives and the standard trainer's eager ones."""

    parameter_piece_kib: int | Literal["auto"] = "auto"
    """gloo, graph_trainer's FSDP only: send each parameter all-gather of the forward (torchtitan's
    per-block buckets) as calls of at most this many KiB per rank, issued and waited where the
    all-gather was (``passes/pieces.py``); 0: one call each. On a slow link gloo moves those
    all-gathers at 70-80% of its rate and pieces at ~100% (FSDP FP8 at 50 Mbit/s: 2.74 against 3.08
    s/step); from 1 Gbit/s up the calls' fixed cost makes the step slower (0.56 against 0.51 s/step).
    ``"auto"``: the job times one ``all_to_all`` on the FSDP group at start-up and sends pieces of
    128 KiB below ``collectives.SLOW_LINK_MBIT``, one call above (the log says which)."""

    bucket: bool = True
    """Graph routes: send the quantized gradients of the Linear layers of one child module of a
    block together (``layers.3.attention``, ``layers.3.feed_forward``: ``gift_collectives.bucket_of``),
    one ``all_to_all``, and on the all-reduce route one ``all_gather``, per module instead of per
    gradient, and the fp32 all-reduces of the parameters it leaves as they are (norm weights,
    biases) one per block, so the round trips per step do not grow with the number of layers;
    the bytes and the quantized gradients are the same (``passes/bucketing.py``). FSDP2's
    standard trainer: each parameter group's (a block's) quantized gradients in one ``all_to_all``
    and its dense ones (norm weights) in one reduce-scatter (``fsdp.py``). Off: one call
    per gradient, each sent as soon as it exists (a little earlier; on a link with latency, many
    more round trips)."""

    meter_interval: int = 10
    """Every N steps, each whitened layer reads the live meter (``meter.py``): the error of the
    gradient GIFT delivered on its route over the error the same route's Euclidean wire (FP8, or
    FP4 for FP4 layers) would have delivered with the same error-feedback setting, both against
    the ranks' exact average (measured through a sketch: one small all-reduce per reading).
    ``error_vs_fp8`` (one step) and ``accumulated_vs_fp8`` (summed over the window) in the counters."""

    meter_window: int = 2
    """With error feedback, the steps before each reading on which the meter's Euclidean shadow
    also runs: the first starts its residuals, the rest are summed with the reading's step into
    ``accumulated_vs_fp8``. Each such step costs one Euclidean round trip of the whitened
    layers' local gradients (no communication). Without error feedback only the reading's step."""

    fallback: bool = True
    """A whitened layer whose ``error_vs_fp8`` stays above 1 for ``fallback_patience``
    measurements in a row is sent as Euclidean FP8 for ``fallback_retry`` steps, then retried if
    the meter's GIFT shadow (run on the fallback) reads at or below 1."""

    fallback_patience: int = 3
    """Consecutive meter readings above 1 that switch a layer to its fallback."""

    fallback_retry: int = 200
    """Steps a layer stays on its fallback before GIFT is tried again. A retry whose GIFT shadow
    read above 1, or a retried layer's first reading above 1, fails: the layer then waits twice as
    long as before (up to 64x, ``state.RETRY_DOUBLINGS``), until a reading at or below 1 ends the
    run of failed retries."""

    layers: tuple[str, ...] | Literal["auto"] = ("*",)
    """Linear layers sent in whitened coordinates (default ``"*"``: every Linear layer, whatever
    its name, each kept no worse than Euclidean FP8 by the live meter and fallback; the attention
    projections ``"w[qkvo]*"`` gain most on Llama, the paper picks ``w2``). Each pattern is matched
    with ``fnmatch`` component by component against the trailing components of the dotted FQN,
    so ``"w2"`` selects ``layers.3.feed_forward.w2`` and ``"layers.[0-3].*.w2"`` the first four;
    ``()`` whitens nothing. ``"auto"`` profiles FP8 boundary hits first (torchtitan integration)."""

    euclidean_dtype: EuclideanDtype = "fp8"
    """How Linear weight gradients that are not selected travel: ``fp8``, ``fp4``, ``bf16`` or ``fp32``."""

    embedding_dtype: EuclideanDtype = "fp8"
    """How other 2-D gradients (the token embedding) travel: ``fp8``, ``fp4``, ``bf16`` or ``fp32``.
    1-D gradients (biases, norms) always keep their collective's own dtype."""

    scale_mode: ScaleMode = "per_rank"
    """``per_rank``: every sender's own scale travels with its payload (exact). ``global_max``:
    one scale max-synchronized across ranks first (the paper's shared scale), for ablations."""

    auto_profile_steps: int = 100
    """With ``layers = "auto"``: steps of Euclidean FP8 profiling before layers are chosen."""

    auto_max_layers: int | None = None
    """With ``layers = "auto"``: keep at most this many layers (``None``: cut at the largest
    drop in boundary-hit rate, as in the paper's Figure 3)."""

    def __post_init__(self) -> None:
        for (name, old), new in DEPRECATED_VALUES.items():
            if getattr(self, name) == old:
                warnings.warn(f"GiftConfig.{name}={old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3)
                object.__setattr__(self, name, new)
        for name, choices in _LITERAL_FIELDS.items():
            value = getattr(self, name)
            if value not in choices and not (value is None and name in _OPTIONAL_LITERALS):
                raise ValueError(f"GiftConfig.{name}={value!r} is invalid; allowed values: {list(choices)}")
        object.__setattr__(self, "layers", _normalize_layers(self.layers))
        for name in ("scale_block_rows", "refresh_interval", "auto_profile_steps", "meter_interval", "meter_window",
                     "fallback_patience", "fallback_retry"):
            _check_int(name, getattr(self, name))
        _check_int("wire_piece_kib", self.wire_piece_kib, minimum=0)
        if self.parameter_piece_kib != "auto":
            try:
                _check_int("parameter_piece_kib", self.parameter_piece_kib, minimum=0)
            except ValueError as error:
                raise ValueError(f'{error} or "auto"') from None
        for name in ("low_rank", "stats_max_tokens", "auto_max_layers"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        _check_float("damping", self.damping, low=MIN_DAMPING, high=1e3, closed_low=True)
        _check_float("ema_decay", self.ema_decay, low=0.0, high=1.0, closed_low=True)
        for name in ("enabled", "error_feedback", "euclidean_error_feedback", "fallback", "overlap", "bucket", "adaptive_damping"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GiftConfig.{name}={getattr(self, name)!r} is invalid; it must be true or false")
        if self.adaptive_damping and self.factor_source != "current_step":
            raise ValueError("GiftConfig.adaptive_damping=true needs factor_source='current_step' (the periodic factors keep one damping)")
        if self.stats_source == "gradients" and self.factor_source != "current_step":
            raise ValueError("GiftConfig.stats_source='gradients' needs factor_source='current_step' (the periodic factors "
                             "are built from A; leave stats_source unset or set it to 'inputs')")
        if self.factor_source == "current_step" and self.factorization != "symmetric":
            raise ValueError(
                "GiftConfig.factorization='cholesky' needs factor_source='periodic'; the current-step "
                "factors are symmetric (A^-1/2 from a subspace iteration)"
            )

    # -- derived choices -----------------------------------------------------------------------
    @property
    def whitening_layout(self) -> WhiteningLayout:
        """How a whitened layer's factors are stored (``geometry.Whitening.layout``): symmetric
        low rank (also current-step full rank) never forms a ``d x d`` matrix."""
        if self.factor_source == "current_step" or (self.factorization == "symmetric" and self.low_rank is not None):
            return "lowrank"
        return "dense"

    def factor_rank(self, d_in: int) -> int:
        """The rank actually used for a layer with ``d_in`` inputs (full when ``low_rank`` is None or larger)."""
        return d_in if self.low_rank is None else min(self.low_rank, d_in)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GiftConfig:
        """Build from a plain mapping (a parsed TOML table); unknown keys are an error."""
        return cls(**normalize_keys(values, "GIFT config", cls.field_names()))

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


def normalize_keys(values: dict[str, Any], what: str, valid: list[str]) -> dict[str, Any]:
    """Map deprecated keys to their fields (with a warning) and reject unknown or removed ones."""
    values = dict(values)
    for old, new in DEPRECATED_KEYS.items():
        if old in values:
            if new in values:
                raise ValueError(f"{what}: give {new!r} only; {old!r} is its deprecated alias")
            warnings.warn(f"{what} key {old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3)
            values[new] = values.pop(old)
    removed = sorted(set(values) & set(REMOVED_KEYS))
    if removed:
        raise ValueError(f"{what} key {removed[0]!r} was removed: {REMOVED_KEYS[removed[0]]}")
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown {what} key(s) {unknown}; valid keys: {valid}")
    return values


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields carry a string literal below them
    (the convention here; it keeps help texts, README and code in one place)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# Every integer knob is a count of steps, rows, tokens or layers: bounded to the int32 range,
# so step arithmetic (``step + 1 + fallback_retry`` in an int64 buffer) can never overflow
# and a typo such as 10**30 fails here, naming its field, not hours later inside torch.
MAX_INT = 2**31 - 1
# ``damping * mean_eigenvalue`` must stay a positive double after the 1e-30 floor on the mean
# eigenvalue (geometry): below ~1e-278 it underflows to 0 and a zero input gives NaN factors.
# 1e-8 keeps the damped spectrum far above that and far below any damping that helps.
MIN_DAMPING = 1e-8


def _normalize_layers(layers: Any) -> tuple[str, ...] | Literal["auto"]:
    """``layers`` as ``"auto"`` or a tuple of non-empty patterns; the one check for Python, TOML and
    the command line (``["auto"]`` is ``"auto"``; ``[]`` whitens nothing; ``[""]`` is an error)."""
    if layers == "auto":
        return "auto"
    if isinstance(layers, (list, tuple)) and all(isinstance(p, str) and p for p in layers):
        if "auto" not in layers:
            return tuple(layers)
        if len(layers) == 1:
            return "auto"
        raise ValueError(f"GiftConfig.layers={layers!r} is invalid; 'auto' must be the only entry")
    raise ValueError(
        f"GiftConfig.layers={layers!r} is invalid; use 'auto' or a sequence of non-empty fnmatch patterns "
        "such as ('w2',), or () to whiten nothing"
    )


def _check_int(name: str, value: Any, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise ValueError(f"GiftConfig.{name}={value!r} is invalid; it must be an integer in [{minimum}, {MAX_INT}]")


def _check_float(name: str, value: Any, *, low: float, high: float, closed_low: bool) -> None:
    # bool is an int in Python: `damping = true` must not pass as 1.0.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (low <= value if closed_low else low < value) and value < high
    if not ok:
        bracket = "[" if closed_low else "("
        raise ValueError(f"GiftConfig.{name}={value!r} is invalid; it must be a number in {bracket}{low:g}, {high:g})")


_LITERAL_FIELDS: dict[str, tuple[str, ...]] = {
    "gift_dtype": get_args(GiftDtype),
    "fp8_format": get_args(Fp8Format),
    "fp4_format": get_args(Fp4Format),
    "scaling": get_args(Scaling),
    "factor_source": get_args(FactorSource),
    "factorization": get_args(Factorization),
    "euclidean_dtype": get_args(EuclideanDtype),
    "embedding_dtype": get_args(EuclideanDtype),
    "all_gather_dtype": get_args(GatherDtype),
    "stats_dtype": get_args(StatsDtype),
    "stats_source": get_args(StatsSource),
    "stats_group": get_args(StatsGroup),
    "scale_mode": get_args(ScaleMode),
}

_OPTIONAL_LITERALS = {"stats_source"}
"""Literal fields whose ``None`` default resolves to a value later (a property of the config)."""

__all__ = ["GiftConfig"]
