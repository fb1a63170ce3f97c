"""The fidelity benchmark's harness: one-step round trips of GIFT's codec, per whitening method.

Benchmark code, not library code: the ablations here (output side, both sides, diagonal A)
exist only to measure them (benchmarks/fidelity.py; tests/test_fidelity.py checks the harness).

A method's round trip for a weight gradient ``G`` is::

    U = whiten(G)          # G T_A (input side), T_B^T G (output side), or both
    Q = codec(U)           # FP8 per-tensor quantize + dequantize (or emulated FP4 per block)
    G_hat = unwhiten(Q)    # back to the gradient's own coordinates

and it is scored against the exact ``G`` with the paper's Eq. 15 metrics
(``numerics.fidelity``). The Euclidean method (``side="none"``) is exactly
``numerics.fp8_round_trip(G)``.

Also here: ``capture_layers`` (a layer's weight gradient together with the second moments
of its inputs and output-gradients over the same tokens, via hooks) and ``FeedbackChannel``
(a single-process emulation of the round trip repeated over steps, with or without error
feedback, in Euclidean or whitened coordinates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from gift_compile.geometry import Whitening, damp, factorize, second_moment
from gift_compile.numerics import fidelity, fp4_e2m1_round_trip, fp8_round_trip

#: Wire formats a round trip can use: FP8 per-tensor scale, or emulated FP4 E2M1 per block.
CODECS: tuple[str, ...] = ("e4m3", "e5m2", "fp4_b16", "fp4_b32")

MethodSide = Literal["none", "input", "output", "both"]


def codec_round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``decode(encode(x))`` for one of ``CODECS``."""
    if fmt in ("e4m3", "e5m2"):
        return fp8_round_trip(x, fmt)
    if fmt.startswith("fp4_b") and fmt in CODECS:
        return fp4_e2m1_round_trip(x, block_size=int(fmt.removeprefix("fp4_b")))
    raise ValueError(f"unknown codec {fmt!r}; allowed values: {list(CODECS)}")


@dataclass(frozen=True, kw_only=True)
class Method:
    """A coordinate system for the round trip (the rows of the paper's Tables I and II)."""

    name: str
    side: MethodSide = "input"
    """``none`` = Euclidean; ``input`` = ``G T_A``; ``output`` = ``T_B^T G``; ``both``."""
    factorization: Literal["symmetric", "cholesky"] = "symmetric"
    rank: int | None = None
    """Low-rank A (top eigenpairs + isotropic rest); ``None`` = full."""
    diagonal: bool = False
    """Use ``diag(A)`` only (the paper's ablation)."""
    damping: float
    """``A + damping * mean_eigenvalue * I`` before factorizing (as ``GiftConfig.damping``); no
    default here: each measurement states the damping it uses."""

    @property
    def sides(self) -> tuple[str, ...]:
        return {"none": (), "input": ("input",), "output": ("output",), "both": ("input", "output")}[self.side]


EUCLIDEAN = Method(name="euclidean", side="none", damping=0.0)


def build_transform(
    method: Method,
    input_moment: torch.Tensor | None,
    output_moment: torch.Tensor | None = None,
    *,
    damping: float | None = None,
) -> dict[str, Whitening]:
    """Factorize the moments a method needs; ``{}`` for the Euclidean method.

    ``damping`` overrides ``method.damping``.
    """
    damping = method.damping if damping is None else damping
    moments = {"input": input_moment, "output": output_moment}
    transform = {}
    for side in method.sides:
        if moments[side] is None:
            raise ValueError(f"method {method.name!r} needs the {side}-side second moment")
        rank = method.rank
        if rank is not None and rank >= moments[side].shape[0]:
            rank = None  # rank >= d is the full matrix
        if method.diagonal:
            transform[side] = diagonal_whitening(moments[side], damping)
        else:
            transform[side] = factorize(moments[side], factorization=method.factorization, rank=rank, damping=damping)
    return transform


def diagonal_whitening(moment: torch.Tensor, damping: float) -> Whitening:
    """``T = diag(A)^-1/2`` (the paper's ablation without cross-dimension correlation), stored dense."""
    diag = torch.diagonal(damp(moment.double(), damping))
    return Whitening("dense", {"T": torch.diag(diag.rsqrt()).float(), "T_inv": torch.diag(diag.sqrt()).float()})


def whiten(g: torch.Tensor, whitenings: dict[str, Whitening], sides: tuple[str, ...]) -> torch.Tensor:
    """``T_B^T G T_A`` restricted to ``sides`` (input side acts on rows, output side on columns)."""
    if "input" in sides:
        g = whitenings["input"].whiten(g)
    if "output" in sides:
        g = whitenings["output"].whiten(g.T).T
    return g


def unwhiten(u: torch.Tensor, whitenings: dict[str, Whitening], sides: tuple[str, ...]) -> torch.Tensor:
    if "output" in sides:
        u = whitenings["output"].unwhiten(u.T).T
    if "input" in sides:
        u = whitenings["input"].unwhiten(u)
    return u


def round_trip(g: torch.Tensor, transform: dict[str, Whitening], fmt: str) -> torch.Tensor:
    """Whiten, encode/decode with ``fmt``, unwhiten (``transform == {}``: plain codec)."""
    sides = tuple(transform)
    return unwhiten(codec_round_trip(whiten(g.float(), transform, sides), fmt), transform, sides)


def measure(g: torch.Tensor, transform: dict[str, Whitening], fmt: str) -> dict[str, float]:
    """Eq. 15 metrics (``rel_l2``, ``cosine``, ``max_err``, ``mse``) of one method's round trip."""
    f = fidelity(round_trip(g, transform, fmt), g)
    return {"rel_l2": f.rel_l2.item(), "cosine": f.cosine.item(), "max_err": f.max_err.item(), "mse": f.mse.item()}


@dataclass
class LayerSample:
    """One Linear layer's weight gradient and the statistics of the same tokens."""

    grad: torch.Tensor
    """Weight gradient ``(d_out, d_in)`` of the mean loss over all tokens."""
    input_moment: torch.Tensor | None
    """``A = E[x x^T]`` over the layer's inputs (``d_in x d_in``)."""
    output_moment: torch.Tensor | None
    """``B = E[d d^T]`` over the gradients w.r.t. the layer's outputs (``d_out x d_out``)."""
    tokens: int


def capture_layers(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    backward: bool = True,
    input_side: bool = True,
    output_side: bool = True,
) -> dict[str, LayerSample]:
    """Gradient and second moments of every layer in ``layers`` over all ``micro_batches``.

    The micro-batches are accumulated into the gradient of the mean loss over all of their
    tokens (each micro-batch loss is weighted by its share of the tokens), which is what one
    data-parallel rank would send for that many tokens. ``backward=False`` collects only the
    input moments (a forward pass under ``no_grad``); ``grad`` is then empty.
    ``input_side``/``output_side=False`` skip those moments (they are then ``None``). The
    model's ``.grad`` fields are overwritten.
    """
    input_sums: dict[str, torch.Tensor] = {}
    output_sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = dict.fromkeys(layers, 0)

    def add(store: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> None:
        moment, _ = second_moment(t.detach())
        store[name] = store[name] + moment if name in store else moment

    def forward_hook(name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x = args[0]
            if input_side:
                add(input_sums, name, x)
            counts[name] += x.numel() // x.shape[-1]
            if backward and output_side and output.requires_grad:
                output.register_hook(lambda grad: add(output_sums, name, grad))

        return hook

    handles = [module.register_forward_hook(forward_hook(name)) for name, module in layers.items()]
    total = sum(inputs.numel() for inputs, _ in micro_batches)
    try:
        if backward:
            model.zero_grad(set_to_none=True)
            for inputs, targets in micro_batches:
                (loss_fn(model(inputs), targets) * (inputs.numel() / total)).backward()
        else:
            with torch.no_grad():
                for inputs, _ in micro_batches:
                    model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    samples = {}
    for name, module in layers.items():
        n = max(counts[name], 1)
        grad = module.weight.grad.detach().float().clone() if backward else torch.empty(0)
        samples[name] = LayerSample(
            grad=grad,
            input_moment=input_sums[name] / n if name in input_sums else None,
            output_moment=output_sums[name] / n if name in output_sums else None,
            tokens=counts[name],
        )
    return samples


class FeedbackChannel:
    """The round trip of one layer repeated over steps (single process: the reduction is the identity).

    With ``error_feedback`` the quantization error ``R = (U + R) - Q(U + R)`` is kept in the
    coordinates the codec sees and added to the next step's payload; when the whitening
    changes, ``R`` is mapped into the new coordinates (``R T_old^-1 T_new``), as
    ``state.GiftLayerState.refresh`` does.
    """

    def __init__(self, fmt: str, *, error_feedback: bool) -> None:
        self.fmt, self.error_feedback = fmt, error_feedback
        self.transform: dict[str, Whitening] = {}
        self.residual: torch.Tensor | None = None

    def set_transform(self, transform: dict[str, Whitening]) -> None:
        if self.residual is not None:
            euclidean = unwhiten(self.residual, self.transform, tuple(self.transform))
            self.residual = whiten(euclidean, transform, tuple(transform))
        self.transform = transform

    def send(self, g: torch.Tensor) -> torch.Tensor:
        """What the receiver reconstructs for this step's gradient ``g``."""
        sides = tuple(self.transform)
        u = whiten(g.float(), self.transform, sides)
        if self.error_feedback and self.residual is not None:
            u = u + self.residual
        q = codec_round_trip(u, self.fmt)
        if self.error_feedback:
            self.residual = u - q
        return unwhiten(q, self.transform, sides)


def spearman(x: Iterable[float], y: Iterable[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    xs, ys = torch.tensor(list(x), dtype=torch.float64), torch.tensor(list(y), dtype=torch.float64)

    def ranks(v: torch.Tensor) -> torch.Tensor:
        order = v.argsort()
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for value in v.unique():  # ties share their mean rank
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(xs) - ranks(xs).mean(), ranks(ys) - ranks(ys).mean()
    denom = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / denom) if denom > 0 else float("nan")


__all__ = [
    "CODECS",
    "EUCLIDEAN",
    "FeedbackChannel",
    "LayerSample",
    "Method",
    "build_transform",
    "capture_layers",
    "codec_round_trip",
    "measure",
    "round_trip",
    "spearman",
]
