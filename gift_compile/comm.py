"""One gradient's trip through a collective: the quantized path (FP8 or FP4, whitened or Euclidean) and dense wires.

Pure functions of tensors (factors and residuals are arguments, not state), so the eager
reference calls them directly and the FX pass traces them with ``make_fx`` and splices the
result into the backward graph: one piece of code for both, Inductor fuses the traced ops.

The quantized path for a weight gradient ``G`` (Algorithm 1, docs/design.md §1, §7; ``T = I``
on the Euclidean path; a layer's step hands over its low-rank ``T`` divided by its isotropic
scale, ``Whitening.unit_scaled``, which the amax-scaled wire does not see)::

    U  = (G + R) T          whiten; R is this rank's error-feedback residual, kept in G's own
                            coordinates, so a new T never needs a residual "move"
    Q  = quantize(U)        FP8 or FP4 (the wire), this rank's own scales
    S  = sum_ranks deq(Q)   quantized reduce-scatter (collectives.py): this rank's rows, whitened
    R' = (U - deq(Q)) T^-1  what this rank failed to send, in G's coordinates
    G_hat = S T^-1          unwhiten this rank's rows of the reduced gradient

The residual guard: a residual whose whitened form is larger than the whitened gradient it
would ride on (``|R T| > |G T|``) is not sent, and that step sends ``G T`` alone
(:func:`keeps_residual`). A residual is a rounding error, a few percent of the last step's
payload; carried into a new ``T`` it can come back far larger (it was unwhitened by the last
``T^-1``, large along the last step's loud input directions, and is whitened by this ``T``,
large where the inputs are now quiet), and once that growth beats the wire's rounding, error
feedback diverges, doubling the error each step (docs/design.md §8). The same holds for the
all-reduce route's second stage (``R2 T`` against the reduced shard). Each rank decides for its
own residual, which is its own: the ranks need not agree.

An all-reduce is that reduce-scatter followed by an all-gather of the reduced shards, with
``gather_dtype``:

* ``wire``: the owner of each shard re-quantizes it in whitened coordinates, with error feedback
  of its own (``R2``, kept in G's coordinates: ``U2 = S + R2 T``), every rank decodes the
  same bytes and unwhitens the whole tensor. Bit-identical on every rank because every rank
  builds the same ``T`` (geometry.py).
* ``bf16``: the owner unwhitens its shard (1/N of the work) and the shards travel in bf16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from gift_compile.collectives import (
    Encoded,
    WireFormat,
    all_gather,
    all_reduce,
    all_to_all,
    decode_gathered,
    encode_scatter,
    encode_shard,
    layout,
    reduce_scatter,
    reduce_scattered,
    resolve_group,
)
from gift_compile.geometry import Whitening

COLLECTIVES = ("all_reduce", "reduce_scatter")
GATHER_DTYPES = ("wire", "bf16")

# Layout of Reduction.stats (one small fp32 tensor, so reading it never syncs per element).
STATS = ("saturated", "flushed", "error_sq_wire", "sent_sq_wire", "error_sq", "payload_sq", "residuals_dropped")
"""``saturated``/``flushed``: boundary hits (FP8 or FP4) of this rank's encoding; ``*_wire``: squared norms
of its round-trip error and of what it encoded, in the coordinates on the wire; ``error_sq``,
``payload_sq``: the same in the gradient's own coordinates (``R'`` and ``G + R``);
``residuals_dropped``: residuals the guard did not send this step (0-2, module docstring)."""

RESIDUAL_GUARD = 1.0
"""The residual guard's bound (module docstring): a residual is sent while its whitened norm is
at most this times that of what it rides on. Error feedback measured 0.03-0.05 of it on
whitened layers that train normally, and 2.1-2.5 where it diverges (``tests/test_state_reference.py``)."""


class Reduction(NamedTuple):
    output: torch.Tensor
    """The reduced gradient (all-reduce) or this rank's rows of it (reduce-scatter), in the input dtype."""
    residual: torch.Tensor | None
    """This rank's new error-feedback residual (``R'``, G's shape and coordinates), if it keeps one."""
    gather_residual: torch.Tensor | None
    """The owner's rounding error of the all-gather re-quantization (its shard's rows, G's
    coordinates): its new gather residual if it keeps one. Whitened layers report it without
    error feedback too: the live meter reads what the second stage encoded from it (meter.py)."""
    stats: torch.Tensor
    """fp32, laid out as :data:`STATS`."""


def _unwhitener(whitening: Whitening | None):
    """``T^-1`` as a function: the identity on the Euclidean path."""
    return whitening.unwhiten if whitening is not None else (lambda t: t)


def quantized_reduce(
    g: torch.Tensor,
    whitening: Whitening | None,
    residual: torch.Tensor | None,
    gather_residual: torch.Tensor | None,
    *,
    op: str,
    group,
    wire: WireFormat,
    collective: str,
    gather_dtype: str = "wire",
) -> Reduction:
    """Reduce one 2-D gradient through its quantized wire (module docstring). ``whitening=None`` is the
    Euclidean path (``T = I``); ``residual`` / ``gather_residual`` turn error feedback on.

    :func:`encode_reduction`, the ``all_to_all`` of its messages, :func:`reduce_received`, and
    on the all-reduce route the all-gather of the reduced shards and :func:`finish_gathered`: a
    caller that reduces several gradients at once calls the parts and sends every message of a
    phase in one call (``collectives.exchange``, ``collectives.gather_many``; the FSDP route)."""
    _check_arguments(collective, gather_dtype)
    group = resolve_group(group)
    encoded = encode_reduction(g, whitening, residual, op=op, group=group, wire=wire)
    incoming = all_to_all(encoded.scatter.messages.reshape(-1), group)
    received = reduce_received(g, whitening, residual, gather_residual, encoded, incoming, op=op, group=group,
                               wire=wire, collective=collective, gather_dtype=gather_dtype)
    if isinstance(received, Reduction):
        return received
    gathered = all_gather(received.message, group)
    return finish_gathered(g, whitening, received, gathered, group=group, wire=wire, gather_dtype=gather_dtype)


class EncodedReduction(NamedTuple):
    """:func:`quantized_reduce` up to its ``all_to_all``."""

    scatter: Encoded
    """The reduce-scatter's half: ``scatter.messages`` is what goes on the wire."""
    payload: torch.Tensor
    """What was sent, in G's coordinates: ``G + R`` (or ``G`` where the guard dropped ``R``)."""
    sent_coords: torch.Tensor
    """``payload`` whitened: what was encoded."""
    dropped: torch.Tensor | None
    """The residual guard's verdict (0-d bool, True where ``R`` was not sent), or None without a residual."""


def encode_reduction(
    g: torch.Tensor, whitening: Whitening | None, residual: torch.Tensor | None, *, op: str, group, wire: WireFormat,
) -> EncodedReduction:
    """The first half of :func:`quantized_reduce`: whiten ``G + R`` and encode it."""
    if g.dim() != 2:
        raise ValueError(f"the quantized gradient path takes 2-D (d_out, d_in) gradients, got shape {tuple(g.shape)}")
    group = resolve_group(group)
    dropped = None
    if residual is None:
        payload = g.float()
        sent_coords = whitening.whiten(payload) if whitening is not None else payload
    elif whitening is None:  # Euclidean: T never changes, so the residual stays a rounding error
        payload = g.float() + residual
        sent_coords = payload
    else:
        payload, kept, projected = guarded_sum(g.float(), residual, whitening)
        sent_coords = whitening.whiten(payload, projected)
        dropped = ~kept
    return EncodedReduction(encode_scatter(sent_coords, op, group, wire), payload, sent_coords, dropped)


class Gathering(NamedTuple):
    """:func:`reduce_received` on the all-reduce route: all but the all-gather of the reduced
    shards and what follows it (:func:`finish_gathered`)."""

    message: torch.Tensor
    """What this rank sends every rank: its reduced shard, re-encoded (``gather_dtype="wire"``,
    uint8 ``(1, bytes)``) or unwhitened in bf16."""
    residual: torch.Tensor | None
    gather_residual: torch.Tensor | None
    stats: torch.Tensor
    """As :class:`Reduction`'s: the all-gather adds nothing to them."""


def reduce_received(
    g: torch.Tensor,
    whitening: Whitening | None,
    residual: torch.Tensor | None,
    gather_residual: torch.Tensor | None,
    encoded: EncodedReduction,
    incoming: torch.Tensor,
    *,
    op: str,
    group,
    wire: WireFormat,
    collective: str,
    gather_dtype: str = "wire",
) -> Reduction | Gathering:
    """The second half of :func:`quantized_reduce`, from what every sender sent this rank
    (``incoming``, the shape of ``encoded.scatter.messages``): decode and sum, the new
    residual, unwhiten; on the all-reduce route the second stage up to its all-gather."""
    _check_arguments(collective, gather_dtype)
    group = resolve_group(group)
    unwhiten = _unwhitener(whitening)
    scattered = reduce_scattered(encoded.scatter, incoming, encoded.sent_coords.shape, op, group, wire)
    payload, sent_coords = encoded.payload, encoded.sent_coords
    dropped = [] if encoded.dropped is None else [encoded.dropped]
    # This rank's round trip. Non-finite entries (whitening has already spread one over its
    # row) are dropped before unwhitening: there the zeroing fuses with the encoder's pass;
    # after it, it would take a pass over R' of its own.
    wire_error = finite_or_zero(sent_coords - scattered.sent)
    if whitening is None:  # T = I: the wire's coordinates are G's, and the encoder has the squared norms already
        error, squares = wire_error, scattered.stats[2:]
    else:
        # In G's coordinates: R' and its squared norm both from the one projection of the wire's
        # error, and the encoder's own |error|^2, so no pass over R' of its own (a step whose
        # payload was not finite reports a non-finite error, as the Euclidean path does).
        projected = whitening.projection(wire_error)
        error = whitening.unwhiten(wire_error, projected)
        error_sq = (error.square().sum() if projected is None  # a dense T: no projection to start from
                    else whitening.squared_norm(wire_error, projected, inverse=True, g_squared=scattered.stats[2]))
        squares = torch.stack([error_sq, payload.square().sum()])
    new_residual = error if residual is not None else None
    stats = [scattered.stats, squares]

    if collective == "reduce_scatter":
        return Reduction(unwhiten(scattered.reduced).to(g.dtype), new_residual, None, _with_drops(stats, dropped))
    if gather_dtype == "bf16":
        shard = unwhiten(scattered.reduced).to(torch.bfloat16)
        return Gathering(shard, new_residual, None, _with_drops(stats, dropped))
    if gather_residual is None:
        shard = scattered.reduced
    elif whitening is None:
        shard = scattered.reduced + gather_residual
    else:
        whitened_residual = whitening.whiten(gather_residual)
        kept = keeps_residual(whitened_residual.square().sum(), scattered.reduced.square().sum())
        shard = torch.where(kept, scattered.reduced + whitened_residual, scattered.reduced)
        dropped.append(~kept)
    message, own = encode_shard(shard, g.shape[0], group, wire)
    new_gather_residual = None
    if gather_residual is not None or whitening is not None:
        new_gather_residual = unwhiten(finite_or_zero(shard - own))
    return Gathering(message, new_residual, new_gather_residual, _with_drops(stats, dropped))


def finish_gathered(
    g: torch.Tensor, whitening: Whitening | None, gathering: Gathering, gathered: torch.Tensor, *, group,
    wire: WireFormat, gather_dtype: str = "wire",
) -> Reduction:
    """The all-reduce route's end, from every owner's :attr:`Gathering.message` (``gathered``,
    rank ``r``'s first): the whole reduced gradient, decoded with each owner's scales and
    unwhitened."""
    if gather_dtype == "bf16":
        output = gathered.float().reshape(-1, g.shape[1])[: g.shape[0]]
    else:
        unwhiten = _unwhitener(whitening)
        output = unwhiten(decode_gathered(gathered, tuple(g.shape), group, wire))
    return Reduction(output.to(g.dtype), gathering.residual, gathering.gather_residual, gathering.stats)


def _with_drops(stats: list[torch.Tensor], dropped: list[torch.Tensor]) -> torch.Tensor:
    """The :data:`STATS` row: ``stats`` and the count of residuals the guard dropped."""
    drops = torch.stack(dropped).sum(dtype=torch.float32) if dropped else torch.zeros((), device=stats[0].device)
    return torch.cat([*stats, drops[None]])


def keeps_residual(residual_sq: torch.Tensor, carrier_sq: torch.Tensor) -> torch.Tensor:
    """The residual guard (module docstring), from squared norms in the wire's coordinates: whether
    a residual is sent with what it rides on (a 0-d bool, no host sync). A NaN in the carrier
    drops the residual (the comparison is false); that step's output is NaN anyway."""
    return residual_sq <= RESIDUAL_GUARD**2 * carrier_sq


def guarded_sum(carrier: torch.Tensor, residual: torch.Tensor,
                whitening: Whitening) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``carrier + residual`` in the gradient's coordinates, or ``carrier`` alone where the
    residual guard drops the residual (their norms measured after whitening, without forming
    either: ``Whitening.squared_norm``); whether it was kept; and the sum's ``Whitening.projection``,
    which whitening it needs: the norms' products, added (linear), instead of a product of its own."""
    carrier_b, residual_b = whitening.projection(carrier), whitening.projection(residual)
    kept = keeps_residual(whitening.squared_norm(residual, residual_b), whitening.squared_norm(carrier, carrier_b))
    projected = None if carrier_b is None else torch.where(kept, carrier_b + residual_b, carrier_b)
    return torch.where(kept, carrier + residual, carrier), kept, projected


def euclidean_reduce(g: torch.Tensor, *, op: str, group, wire: WireFormat, collective: str, gather_dtype: str = "wire") -> Reduction:
    """Reduce a gradient as it is, with no state: FP8/FP4 (2-D), or bf16/fp32 (any shape)."""
    if wire.quantized:
        return quantized_reduce(g, None, None, None, op=op, group=group, wire=wire, collective=collective, gather_dtype=gather_dtype)
    _check_collective(collective)
    reduce = all_reduce if collective == "all_reduce" else reduce_scatter
    return Reduction(reduce(g, op, group, wire), None, None, g.new_zeros(len(STATS), dtype=torch.float32))


def gather_residual_shape(shape: tuple[int, int], group) -> tuple[int, int]:
    """Rows x cols of the all-gather residual one owner keeps (its padded shard of ``shape``)."""
    lay = layout(shape, dist.get_world_size(resolve_group(group)), WireFormat())
    return lay.shard_rows, lay.cols


def finite_or_zero(error: torch.Tensor) -> torch.Tensor:
    # A non-finite gradient already reaches the trainer through the reduced output; keeping it
    # in a residual would poison every later step, so that step's error is dropped instead.
    return torch.where(torch.isfinite(error), error, torch.zeros_like(error))


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


def _check_arguments(collective: str, gather_dtype: str) -> None:
    _check_collective(collective)
    if gather_dtype not in GATHER_DTYPES:
        raise ValueError(f"gather_dtype must be one of {GATHER_DTYPES}, got {gather_dtype!r}")
