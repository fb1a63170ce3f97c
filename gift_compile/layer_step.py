"""One layer's GIFT step, written once for the compiled graph and for the eager reference.

A step has two halves, so a compiled graph can start the statistics early:

* :func:`issue_statistics` (placed right after the layer's input exists: in a joint graph,
  during the forward): ``begin_step`` and, for current-step factors, this rank's sketch of
  the inputs and the all-reduce that sums it. The all-reduce is only issued here; its
  ``wait_tensor`` comes in the second half, so it overlaps with the compute in between.
* :func:`reduce_layer` (where the gradient's own collective was): the factors (from
  :func:`current_factors` on the summed sketch, or the periodic ones), the live meter, then
  ``comm.quantized_reduce`` with the layer's residuals, and ``end_step``.

With ``stats_source = "gradients"`` (the default) the first half only begins the step: the
second sketches the gradient (``G_k^T G_k Q``), sums it over the ranks and waits for the sum
before the encoding, since the gradient is what it measures; :func:`gradient_factors` sums the
sketches of several layers whose gradients exist together (a bucket) in one all-reduce.

With input statistics, layers that read the same input (a block's q, k and v projections; its w1 and w3) have the same
current-step factors: their sketches, their sums and every step of their subspace iteration
are equal (every basis starts from ``geometry.initial_basis``, which depends on the shape only).
So every route sketches such an input once: the first layer that reads it sends the statistics
and computes the factors, the others (``LayerPlan.shares_statistics``) only begin their step and
take those factors. That is fewer bytes, collectives and factorizations, and the same numbers.
(Not with ``adaptive_damping``: each layer's damping is its own, and so are its factors.)

The state is reached through a :class:`StateAccess`: :class:`EagerAccess` calls a
``GiftRuntime`` directly (the reference); ``ops.OpsAccess`` calls the ``gift::`` custom ops,
which look the runtime up at run time (the compiled graph). Everything else is shared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from gift_compile import policy
from gift_compile.collectives import WireFormat, all_reduce_bytes, received, statistics_group_name
from gift_compile.policy import Plan
from gift_compile.comm import Reduction, gather_residual_shape, quantized_reduce
from gift_compile.config import GiftConfig
from gift_compile.geometry import Whitening, input_sketch, sketch_numel, whitening_from_sketch, whitening_from_sketches
from gift_compile.runtime import GiftRuntime

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class LayerPlan:
    """What one stateful layer's step does (``policy.Plan`` plus where it happens): fixed when a
    graph is traced (and baked into it)."""

    fqn: str
    d_out: int
    d_in: int
    plan: Plan
    """``gift`` (whitened) or ``euclidean+ef`` (unwhitened, with a residual)."""
    collective: str  # "all_reduce" | "reduce_scatter"
    op: str  # "sum" | "avg"
    group_name: str
    config: GiftConfig
    shares_statistics: bool = False
    """Another layer reads the same input and sends the statistics for both (module docstring):
    this one sends none and takes that layer's current-step factors."""

    @classmethod
    def of(cls, fqn: str, d_out: int, d_in: int, config: GiftConfig, *, whitened: bool, collective: str, op: str,
           group_name: str) -> LayerPlan:
        """The step of a Linear layer that ``config`` whitens (or keeps a Euclidean residual for)."""
        return cls(fqn, d_out, d_in, policy.plan(config, "linear", selected=whitened, collective=collective),
                   collective, op, group_name, config)

    @property
    def whitened(self) -> bool:
        return self.plan.whitened

    @property
    def group(self) -> dist.ProcessGroup:
        return _resolve_process_group(self.group_name)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def current_step(self) -> bool:
        return self.whitened and self.config.factor_source == "current_step"

    @property
    def input_statistics(self) -> bool:
        """Current-step factors from the layer's input (``stats_source = "inputs"``): sketched
        in the step's first half, from the forward's input."""
        return self.current_step and self.config.statistics == "inputs"

    @property
    def gradient_statistics(self) -> bool:
        """Current-step factors from the gradients (``stats_source = "gradients"``): sketched in
        the second half, from the gradient, before its encoding."""
        return self.current_step and self.config.statistics == "gradients"

    @property
    def may_share_statistics(self) -> bool:
        """Input statistics with one damping for every layer (not ``adaptive_damping``): layers
        that read one input have the same factors (module docstring)."""
        return self.input_statistics and not self.config.adaptive_damping

    @property
    def low_rank(self) -> int:
        return self.config.factor_rank(self.d_in)

    @property
    def wire(self) -> WireFormat:
        return self.plan.wire

    @property
    def bytes_sent(self) -> int:
        return self.plan.bytes_sent((self.d_out, self.d_in), self.world, self.collective)

    @property
    def reduction(self) -> dict:
        """The keyword arguments of this step's ``comm.quantized_reduce`` (and of its halves)."""
        return dict(op=self.op, group=self.group, wire=self.wire, collective=self.collective, gather_dtype=self.plan.gather_dtype)

    def describe(self) -> str:
        """What this step sends, for the ranks' agreement (agreement.py)."""
        return self.plan.describe((self.d_out, self.d_in), self.collective, self.op, self.world)

    @property
    def stats_bytes(self) -> int:
        if not self.current_step or self.shares_statistics:
            return 0
        return all_reduce_bytes(sketch_numel(self.d_in, self.low_rank), self.world, self.config.stats_dtype)


class StateAccess(Protocol):
    """How a step reaches its layer's state (eagerly, or through the ``gift::`` ops)."""

    def begin(self, plan: LayerPlan, layer_input: torch.Tensor, agreed: torch.Tensor | None) -> torch.Tensor:
        """Start the step; a 0-d float on the input's device: 1.0 whiten, 0.0 fallback (T = I).
        ``agreed`` (a compiled graph's ``gift::agree`` result) orders the step after the ranks' check."""

    def basis(self, plan: LayerPlan, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The subspace basis, the sketch's scale (``geometry.input_sketch``) and the damping (0-d)."""

    def factors(self, plan: LayerPlan, token: torch.Tensor) -> list[torch.Tensor]: ...

    def residual(self, plan: LayerPlan, token: torch.Tensor) -> torch.Tensor: ...

    def gather_residual(self, plan: LayerPlan, token: torch.Tensor) -> torch.Tensor: ...

    def meter(self, plan: LayerPlan, grad: torch.Tensor, whitening: Whitening, token: torch.Tensor) -> torch.Tensor:
        """The live meter's part ahead of the reduction (``meter.py``; ``whitening``: the layer's
        ``T`` before the fallback's ``T = I``); returns the token the rest of the step takes."""

    def end(
        self, plan: LayerPlan, token: torch.Tensor, reduction: Reduction, next_basis: torch.Tensor | None, next_scale: torch.Tensor | None
    ) -> None:
        """Keep the step's new residuals and basis, count it, and complete the meter's reading
        from ``reduction.output`` (what was delivered)."""


CurrentFactors = tuple[Whitening, torch.Tensor, torch.Tensor]
"""``(T, next basis, next sketch scale)``: what :func:`current_factors` derives from a summed sketch."""


def sketch_of(plan: LayerPlan, rows: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """This rank's sketch of ``rows`` (``geometry.input_sketch``: the layer's input, or with
    gradient statistics its weight gradient, whose rows are all used), in the wire's dtype."""
    max_tokens = plan.config.stats_max_tokens if plan.input_statistics else None
    sketch = input_sketch(rows, basis, scale, max_tokens)
    return sketch.to(torch.bfloat16) if plan.config.stats_dtype == "bf16" else sketch


def sketch_all_reduce(plan: LayerPlan, rows: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Issue the sum over ranks of this rank's sketch of ``rows``; no wait."""
    return c10d.all_reduce(sketch_of(plan, rows, basis, scale), "sum", statistics_group_name(plan.group_name))


def gradient_factors(steps: list[tuple[LayerPlan, StateAccess, torch.Tensor, torch.Tensor]]) -> list[CurrentFactors]:
    """The current-step factors of gradient-statistics layers, from ``(plan, access, grad,
    token)`` each, all reduced over one group: their sketches summed in one all-reduce (a
    bucket's layers, whose gradients exist together), then their Nystrom factors as one batch. A
    sum is elementwise and a batch factorizes each layer alone, so each gets the numbers it would alone."""
    bases = [access.basis(plan, token) for plan, access, _, token in steps]
    sketches = [sketch_of(plan, grad, basis, scale) for (plan, _, grad, _), (basis, scale, _) in zip(steps, bases)]
    group_name = statistics_group_name(steps[0][0].group_name)
    if len(sketches) == 1:  # alone: no concatenation (batch_gradient_statistics reads the batch's cat)
        summed = [received(c10d.all_reduce(sketches[0], "sum", group_name))]
    else:
        whole = received(c10d.all_reduce(torch.cat([s.reshape(-1) for s in sketches]), "sum", group_name))
        summed = [piece.view_as(s) for piece, s in zip(whole.split([s.numel() for s in sketches]), sketches)]
    return whitening_from_sketches([(total.float(), basis, scale, damping) for total, (basis, scale, damping) in zip(summed, bases)],
                                   nystrom=True)


def issue_statistics(
    plan: LayerPlan, access: StateAccess, layer_input: torch.Tensor, agreed: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, ...]:
    """First half: begin the step and start the all-reduce of this rank's input sketch.
    Returns ``(token, summed sketch (to be waited on), basis, sketch scale, damping)``, the
    last four None without current-step factors or when the layer ``shares_statistics``."""
    token = access.begin(plan, layer_input, agreed)
    if not plan.input_statistics or plan.shares_statistics:
        return token, None, None, None, None
    basis, scale, damping = access.basis(plan, token)
    return token, sketch_all_reduce(plan, layer_input, basis, scale), basis, scale, damping


def current_factors(sketch: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor, damping: torch.Tensor) -> CurrentFactors:
    """Wait for the summed sketch and derive the factors: once per input, for every layer that reads it."""
    summed = received(sketch).float()
    return whitening_from_sketch(summed, basis, scale, damping)


def reduce_layer(
    plan: LayerPlan, access: StateAccess, grad: torch.Tensor, token: torch.Tensor, factors: CurrentFactors | None,
) -> torch.Tensor:
    """Second half: factors, meter, the FP8 reduction with error feedback, ``end_step``.
    ``factors``: :func:`current_factors` of the layer's input (input statistics), else None
    (periodic factors, no whitening, or gradient statistics, which this half computes itself)."""
    step = prepare_reduction(plan, access, grad, token, factors)
    return step.end(quantized_reduce(grad, step.whitening, step.residual, step.gather_residual, **plan.reduction))


@dataclass(frozen=True)
class PreparedReduction:
    """A layer's step between :func:`prepare_reduction` and its reduction's result: what the
    reduction takes, and how the step ends."""

    plan: LayerPlan
    access: StateAccess
    token: torch.Tensor
    whitening: Whitening | None
    residual: torch.Tensor | None
    gather_residual: torch.Tensor | None
    next_basis: torch.Tensor | None
    next_scale: torch.Tensor | None

    def end(self, reduction: Reduction) -> torch.Tensor:
        """``end_step`` on the reduction; returns the reduced gradient."""
        self.access.end(self.plan, self.token, reduction, self.next_basis, self.next_scale)
        return reduction.output


def prepare_reduction(
    plan: LayerPlan, access: StateAccess, grad: torch.Tensor, token: torch.Tensor, factors: CurrentFactors | None,
) -> PreparedReduction:
    """:func:`reduce_layer` up to its reduction: the factors, the live meter, the residuals.
    With gradient statistics ``factors`` may be given (:func:`gradient_factors` of a bucket),
    else computed here."""
    if plan.gradient_statistics and factors is None:  # from the gradient itself: sketch, sum, factorize
        (factors,) = gradient_factors([(plan, access, grad, token)])
    whitening, next_basis, next_scale = factors if factors is not None else (None, None, None)
    if plan.whitened:
        if whitening is None:
            whitening = Whitening.from_list(plan.config.whitening_layout, access.factors(plan, token))
        token = access.meter(plan, grad, whitening, token)  # on the fallback, its GIFT shadow whitens with T
        whitening = whitening.or_identity(token).unit_scaled()
    residual = access.residual(plan, token) if plan.plan.error_feedback else None
    gather_residual = access.gather_residual(plan, token) if plan.plan.gather_error_feedback else None
    return PreparedReduction(plan, access, token, whitening, residual, gather_residual, next_basis, next_scale)


class EagerAccess:
    """:class:`StateAccess` on a ``GiftRuntime`` in this process (the eager reference)."""

    def __init__(self, runtime: GiftRuntime) -> None:
        self.runtime = runtime

    def begin(self, plan, layer_input, agreed=None):
        on = self.runtime.begin_step(plan.fqn, plan.d_out, plan.d_in, plan.whitened, layer_input, plan.group)
        return torch.full((), float(on), device=layer_input.device)

    def basis(self, plan, token):
        layer = self.runtime.layer(plan.fqn)
        return layer.basis, layer.sketch_scale, layer.damping_tensor()

    def factors(self, plan, token):
        return self.runtime.layer(plan.fqn).factor_tensors()

    def residual(self, plan, token):
        return self.runtime.layer(plan.fqn).residual

    def gather_residual(self, plan, token):
        return self.runtime.layer(plan.fqn).ensure_gather_residual(*gather_residual_shape((plan.d_out, plan.d_in), plan.group))

    def meter(self, plan, grad, whitening, token):
        self.runtime.meter(plan.fqn, grad, whitening, plan.collective, plan.op, plan.group)
        return token

    def end(self, plan, token, reduction, next_basis, next_scale):
        self.runtime.end_step(plan.fqn, plan.group, reduction, next_basis, next_scale, plan.bytes_sent, plan.stats_bytes)


class InputStatistics:
    """An eager route's current-step statistics of one layer input: the sketch's all-reduce in
    flight, then the factors, computed once for every layer that reads that input."""

    def __init__(self, plan: LayerPlan, access: StateAccess, token: torch.Tensor, layer_input: torch.Tensor) -> None:
        # The input is held, so its memory cannot be reused by another tensor that would then match it.
        self.layer_input, self.group_name = layer_input, plan.group_name
        self.version = layer_input._version
        self.basis, self.scale, self.damping = access.basis(plan, token)
        self.sketch = sketch_all_reduce(plan, layer_input, self.basis, self.scale)
        self._factors: CurrentFactors | None = None
        self._settled = False

    def reads(self, plan: LayerPlan, layer_input: torch.Tensor) -> bool:
        """Whether ``layer_input`` is this input, unchanged (a view of the same memory, shape and
        strides, not written since), on the same group."""
        x = self.layer_input
        return (plan.group_name == self.group_name and layer_input.data_ptr() == x.data_ptr()
                and layer_input.shape == x.shape and layer_input.stride() == x.stride() and layer_input.dtype == x.dtype
                and layer_input.device == x.device and layer_input._version == self.version)

    def factors(self) -> CurrentFactors:
        if self._factors is None:
            self._factors = current_factors(self.sketch, self.basis, self.scale, self.damping)
        return self._factors

    def settle(self) -> None:
        """Finish the all-reduce of statistics that no step will use (a forward with no backward)."""
        if self._factors is None and not self._settled:
            received(self.sketch)
            self._settled = True


def begin_eagerly(
    plan: LayerPlan, access: StateAccess, layer_input: torch.Tensor, taken: list[InputStatistics]
) -> tuple[LayerPlan, torch.Tensor, InputStatistics | None]:
    """An eager route's first half: begin the step and, for current-step factors, take the
    statistics of ``layer_input`` from ``taken`` (this step's, appended to) or issue them.
    Returns the plan (``shares_statistics`` set when taken), the token and the statistics."""
    token = access.begin(plan, layer_input, None)
    if not plan.input_statistics:
        return plan, token, None
    for statistics in taken if plan.may_share_statistics else ():
        if statistics.reads(plan, layer_input):
            return dataclasses.replace(plan, shares_statistics=True), token, statistics
    statistics = InputStatistics(plan, access, token, layer_input)
    if plan.may_share_statistics:
        taken.append(statistics)
    return plan, token, statistics


def step_eagerly(
    plan: LayerPlan, runtime: GiftRuntime, grad: torch.Tensor, layer_input: torch.Tensor, taken: list[InputStatistics] | None = None
) -> torch.Tensor:
    """Both halves back to back, on ``runtime``: one layer's step in the eager reference.
    ``taken``: the statistics of this step's earlier layers, shared with any that read the same input."""
    access = EagerAccess(runtime)
    plan, token, statistics = begin_eagerly(plan, access, layer_input, [] if taken is None else taken)
    return reduce_layer(plan, access, grad, token, statistics.factors() if statistics else None)


__all__ = [
    "CurrentFactors", "EagerAccess", "InputStatistics", "LayerPlan", "PreparedReduction", "StateAccess", "begin_eagerly",
    "current_factors", "gradient_factors", "issue_statistics", "prepare_reduction", "reduce_layer", "step_eagerly",
]
