"""One gradient's trip through a collective: the GIFT path and the Euclidean path.

Pure functions of tensors (factors and residual are arguments, not state), so the eager
reference calls them directly and the FX pass traces them with ``make_fx`` and splices the
result into the backward graph: one piece of code for both, Inductor fuses the traced ops.

GIFT path for a weight gradient ``G`` of a selected Linear layer (Algorithm 1)::

    U = G T                 whiten (input side: right-multiply, acts on each row alone)
    V = U + R               error feedback, in whitened coordinates
    Q = quantize(V)         FP8, this rank's own scales
    S = sum_ranks deq(Q)    FP8 reduce-scatter / all-reduce (collectives.py)
    R' = V - deq(Q)         what this rank failed to send, carried to the next step
    G_hat = S T^-1          unwhiten the reduced (shard of the) gradient
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gift_compile.collectives import WireFormat, all_reduce, fp8_all_reduce, fp8_reduce_scatter, reduce_scatter
from gift_compile.geometry import FACTOR_NAMES, Whitening
from gift_compile.state import unwhiten, whiten

COLLECTIVES = ("all_reduce", "reduce_scatter")


class Reduction(NamedTuple):
    output: torch.Tensor
    """The reduced gradient (all-reduce) or this rank's rows of it (reduce-scatter), in the input dtype."""
    residual: torch.Tensor | None
    """The new error-feedback residual (GIFT path with error feedback), else None."""
    stats: torch.Tensor
    """fp32 ``[saturated, flushed, ||err||^2, ||sent||^2]`` of this rank's FP8 encoding (zeros otherwise)."""


def whitenings_from_list(kind: str, sides: tuple[str, ...], factors: list[torch.Tensor]) -> dict[str, Whitening]:
    names = FACTOR_NAMES[kind]
    if len(factors) != len(names) * len(sides):
        raise ValueError(f"expected {len(names) * len(sides)} factor tensors for sides {sides}, got {len(factors)}")
    return {
        side: Whitening(kind, dict(zip(names, factors[i * len(names) : (i + 1) * len(names)])))
        for i, side in enumerate(sides)
    }


def gift_reduce(
    g: torch.Tensor,
    factors: list[torch.Tensor],
    residual: torch.Tensor | None,
    *,
    kind: str,
    sides: tuple[str, ...],
    op: str,
    group,
    wire: WireFormat,
    collective: str,
) -> Reduction:
    """Reduce one weight gradient in whitened coordinates (see the module docstring)."""
    if g.dim() != 2:
        raise ValueError(f"GIFT whitens 2-D Linear weight gradients, got shape {tuple(g.shape)}")
    if collective == "reduce_scatter" and "output" in sides:
        raise ValueError("output-side whitening mixes rows, so it cannot run before a dim-0 reduce-scatter; use side='input'")
    whitenings = whitenings_from_list(kind, sides, factors)
    sent_coords = whiten(g.float(), whitenings, sides)
    if residual is not None:
        sent_coords = sent_coords + residual
    reduce = {"all_reduce": fp8_all_reduce, "reduce_scatter": fp8_reduce_scatter}[collective]
    reduced, sent, stats = reduce(sent_coords, op, group, wire)
    new_residual = None
    if residual is not None:
        error = sent_coords - sent
        # A non-finite gradient already reaches the trainer through `reduced`; keeping it in
        # the residual would poison every later step, so that step's error is dropped instead.
        new_residual = torch.where(torch.isfinite(error), error, torch.zeros_like(error))
    return Reduction(unwhiten(reduced, whitenings, sides).to(g.dtype), new_residual, stats)


def euclidean_reduce(g: torch.Tensor, *, op: str, group, wire: WireFormat, collective: str) -> Reduction:
    """Reduce a gradient as it is, through ``wire`` (FP8, bf16 or fp32)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    if wire.dtype == "fp8":
        reduce = fp8_all_reduce if collective == "all_reduce" else fp8_reduce_scatter
        reduced, _, stats = reduce(g, op, group, wire)
        return Reduction(reduced.to(g.dtype), None, stats)
    reduce = all_reduce if collective == "all_reduce" else reduce_scatter
    return Reduction(reduce(g, op, group, wire), None, g.new_zeros(4, dtype=torch.float32))
