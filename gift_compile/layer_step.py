"""One layer's GIFT step, written once for the compiled graph and for the eager reference.

A step has two halves, so a compiled graph can start the statistics early:

* :func:`issue_statistics` (placed right after the layer's input exists: in a joint graph,
  during the forward): ``begin_step`` and, for current-step factors, this rank's sketch of
  the inputs and the all-reduce that sums it. The all-reduce is only issued here; its
  ``wait_tensor`` comes in the second half, so it overlaps with the compute in between.
* :func:`reduce_layer` (where the gradient's own collective was): the factors from the
  summed sketch (or the periodic ones), the live meter, then ``comm.fp8_reduce`` with the
  layer's residuals, and ``end_step``.

The state is reached through a :class:`StateAccess`: :class:`EagerAccess` calls a
``GiftRuntime`` directly (the reference); ``ops.OpsAccess`` calls the ``gift::`` custom ops,
which look the runtime up at run time (the compiled graph). Everything else is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from gift_compile.collectives import WireFormat, all_reduce_bytes, bytes_sent
from gift_compile.comm import Reduction, gather_residual_shape, fp8_reduce
from gift_compile.config import GiftConfig
from gift_compile.geometry import Whitening, input_sketch, sketch_numel, whitening_from_sketch
from gift_compile.runtime import GiftRuntime

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's step does: fixed when a graph is traced (and baked into it)."""

    fqn: str
    d_out: int
    d_in: int
    whitened: bool
    """True: GIFT (whitened FP8). False: Euclidean FP8 with error feedback."""
    collective: str  # "all_reduce" | "reduce_scatter"
    op: str  # "sum" | "avg"
    group_name: str
    config: GiftConfig

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
    def low_rank(self) -> int:
        return self.config.factor_rank(self.d_in)

    @property
    def keeps_residual(self) -> bool:
        return self.config.error_feedback if self.whitened else self.config.euclidean_error_feedback

    @property
    def keeps_gather_residual(self) -> bool:
        return self.keeps_residual and self.collective == "all_reduce" and self.config.all_gather_dtype == "fp8"

    @property
    def wire(self) -> WireFormat:
        return WireFormat.gift(self.config) if self.whitened else WireFormat.euclidean(self.config)

    @property
    def bytes_sent(self) -> int:
        return bytes_sent((self.d_out, self.d_in), self.world, self.wire, self.collective, self.config.all_gather_dtype)

    def describe(self) -> str:
        """What this step sends, for the ranks' agreement (agreement.py)."""
        path = "gift" if self.whitened else "euclidean+ef"
        return f"{path} fp8 {self.collective}({self.op}) {[self.d_out, self.d_in]} x{self.world}"

    @property
    def stats_bytes(self) -> int:
        return all_reduce_bytes(sketch_numel(self.d_in, self.low_rank), self.world) if self.current_step else 0


class StateAccess(Protocol):
    """How a step reaches its layer's state (eagerly, or through the ``gift::`` ops)."""

    def begin(self, plan: LayerPlan, layer_input: torch.Tensor, agreed: torch.Tensor | None) -> torch.Tensor:
        """Start the step; a 0-d float on the input's device: 1.0 whiten, 0.0 fallback (T = I).
        ``agreed`` (a compiled graph's ``gift::agree`` result) orders the step after the ranks' check."""

    def basis(self, plan: LayerPlan, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The subspace basis and the sketch's scale (``geometry.input_sketch``)."""

    def factors(self, plan: LayerPlan, token: torch.Tensor) -> list[torch.Tensor]: ...

    def residual(self, plan: LayerPlan, token: torch.Tensor) -> torch.Tensor: ...

    def gather_residual(self, plan: LayerPlan, token: torch.Tensor) -> torch.Tensor: ...

    def meter(self, plan: LayerPlan, grad: torch.Tensor, token: torch.Tensor) -> None: ...

    def end(
        self, plan: LayerPlan, token: torch.Tensor, reduction: Reduction, next_basis: torch.Tensor | None, next_scale: torch.Tensor | None
    ) -> None: ...


def issue_statistics(
    plan: LayerPlan, access: StateAccess, layer_input: torch.Tensor, agreed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """First half: begin the step and start the all-reduce of this rank's input sketch.
    Returns ``(token, summed sketch (to be waited on), basis, sketch scale)``, the last three
    None without current-step factors."""
    token = access.begin(plan, layer_input, agreed)
    if not plan.current_step:
        return token, None, None, None
    basis, scale = access.basis(plan, token)
    sketch = input_sketch(layer_input, basis, scale, plan.config.stats_max_tokens)
    return token, c10d.all_reduce(sketch, "sum", plan.group_name), basis, scale


def reduce_layer(
    plan: LayerPlan, access: StateAccess, grad: torch.Tensor, token: torch.Tensor, sketch: torch.Tensor | None,
    basis: torch.Tensor | None, scale: torch.Tensor | None, *, reduce=fp8_reduce,
) -> torch.Tensor:
    """Second half: factors, meter, the FP8 reduction with error feedback, ``end_step``.
    ``reduce`` is :func:`comm.fp8_reduce` or a compiled version of it (the FSDP route)."""
    whitening, next_basis, next_scale = None, None, None
    if plan.whitened:
        if plan.current_step:
            whitening, next_basis, next_scale = whitening_from_sketch(c10d.wait_tensor(sketch), basis, scale, plan.config.damping)
        else:
            whitening = Whitening.from_list(plan.config.whitening_layout, access.factors(plan, token))
        whitening = whitening.or_identity(token)
        access.meter(plan, grad, token)
    residual = access.residual(plan, token) if plan.keeps_residual else None
    gather_residual = access.gather_residual(plan, token) if plan.keeps_gather_residual else None
    reduction = reduce(
        grad, whitening, residual, gather_residual, op=plan.op, group=plan.group, wire=plan.wire,
        collective=plan.collective, gather_dtype=plan.config.all_gather_dtype,
    )
    access.end(plan, token, reduction, next_basis, next_scale)
    return reduction.output


class EagerAccess:
    """:class:`StateAccess` on a ``GiftRuntime`` in this process (the eager reference)."""

    def __init__(self, runtime: GiftRuntime) -> None:
        self.runtime = runtime

    def begin(self, plan, layer_input, agreed=None):
        on = self.runtime.begin_step(plan.fqn, plan.d_out, plan.d_in, plan.whitened, layer_input, plan.group)
        return torch.full((), float(on), device=layer_input.device)

    def basis(self, plan, token):
        layer = self.runtime.layer(plan.fqn)
        return layer.basis, layer.sketch_scale

    def factors(self, plan, token):
        return self.runtime.layer(plan.fqn).factor_tensors()

    def residual(self, plan, token):
        return self.runtime.layer(plan.fqn).residual

    def gather_residual(self, plan, token):
        return self.runtime.layer(plan.fqn).ensure_gather_residual(*gather_residual_shape((plan.d_out, plan.d_in), plan.group))

    def meter(self, plan, grad, token):
        self.runtime.meter(plan.fqn, grad)

    def end(self, plan, token, reduction, next_basis, next_scale):
        self.runtime.end_step(plan.fqn, plan.group, reduction, next_basis, next_scale, plan.bytes_sent, plan.stats_bytes)


def step_eagerly(plan: LayerPlan, runtime: GiftRuntime, grad: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
    """Both halves back to back, on ``runtime``: one layer's step in the eager reference."""
    access = EagerAccess(runtime)
    return reduce_layer(plan, access, grad, *issue_statistics(plan, access, layer_input))


__all__ = ["EagerAccess", "LayerPlan", "StateAccess", "issue_statistics", "reduce_layer", "step_eagerly"]
