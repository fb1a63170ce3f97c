"""The ``gift::`` custom ops: how a compiled graph reaches GIFT state at run time.

A compiled graph must not hold GIFT state as constants: the basis and residuals change every
step, and Inductor's FX graph cache replays a graph without re-running our pass. The pass
therefore inserts calls to these ops, which carry only strings and ints (namespace, layer
FQN, process-group name, shapes) and look the runtime up (``runtime.get_runtime``) on every
call. :class:`OpsAccess` is the ``layer_step.StateAccess`` that emits them::

    ok    = gift::agree(ns, groups, description, like)                   first thing in the graph
            the ranks compare what they are about to send (agreement.py), once per graph; 1.0
    token = gift::begin_step(ns, fqn, group, d_out, d_in, whitened, layer_input, ok)
            create/place the layer state, refresh periodic factors when due; 1.0 (whiten) or 0.0 (fallback)
    Q,s,l = gift::load_basis(ns, fqn, d_in, low_rank, token)      copies of the subspace basis, sketch scale, damping
    T...  = gift::load_factors(ns, fqn, d_in, low_rank, token)    copies of the periodic factors
    R     = gift::load_residual(ns, fqn, d_out, d_in, token)      the residual itself
    R2    = gift::load_gather_residual(ns, fqn, rows, cols, token)
    token = gift::meter(ns, fqn, group, collective, op, grad, T..., token)  the meter's shadow on its window's steps
            (T: the layer's factors before the fallback's T = I, for the GIFT shadow on the fallback)
    ... whiten, quantize, FP8 collectives, unwhiten (plain aten ops, fused by Inductor) ...
    gift::end_step(ns, fqn, group, token, G_hat, R', R2', Q', s', stats, bytes, stats_bytes)
            keep the new state, count the step, complete the meter's reading from G_hat (meter.py)
    gift::record_euclidean(ns, fqn, path, stats, bytes)           counters of a stateless Euclidean step

Every collective the pass adds depends on ``ok`` (through ``begin_step``, or as ``grad * ok``
on the stateless Euclidean path), so no reordering can put one before the agreement. The
``token`` data dependency orders the ops (``meter`` hands on a new one, so ``end_step`` always
follows it, whatever a scheduler does); ``meter``, ``end_step`` and ``record_euclidean``
are marked side-effecting so dead-code elimination keeps them.

Residuals are never copied: ``load_residual`` hands out the state tensor and ``end_step``
adopts the graph's ``R'`` buffer as the new state. That is safe because (1) once ``end_step``
runs the state no longer refers to the old ``R``, so whatever Inductor reuses that buffer for
is harmless, and (2) ``end_step``'s lowering below takes ``R'`` out of Inductor's buffer
reuse, so nothing later in the graph overwrites it.
"""

from __future__ import annotations

import torch
from torch._inductor.lowering import fallback_handler, register_lowering
from torch._inductor.virtualized import V
from torch.distributed.distributed_c10d import _resolve_process_group

from gift_compile.comm import Reduction, gather_residual_shape
from gift_compile.geometry import Whitening, factor_shapes
from gift_compile.layer_step import LayerPlan
from gift_compile.runtime import get_runtime

# The gift:: ops run Python on every call (state hand-over, refresh, counters): a CUDA graph
# must not capture them, or replays would skip that Python and reuse stale tensors.
_RUNS_PYTHON = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("gift::agree", mutates_args=(), tags=_RUNS_PYTHON)
def agree(namespace: str, group_names: str, description: str, like: torch.Tensor) -> torch.Tensor:
    runtime = get_runtime(namespace)
    for name in group_names.split(","):  # a schema takes no list of strings
        runtime.agree(_resolve_process_group(name), description, like.device)
    return torch.ones((), device=like.device)


@agree.register_fake
def _(namespace, group_names, description, like):
    return like.new_empty((), dtype=torch.float32)


@torch.library.custom_op("gift::begin_step", mutates_args=(), tags=_RUNS_PYTHON)
def begin_step(
    namespace: str, fqn: str, group_name: str, d_out: int, d_in: int, whitened: bool, layer_input: torch.Tensor, agreed: torch.Tensor
) -> torch.Tensor:
    on = get_runtime(namespace).begin_step(fqn, d_out, d_in, whitened, layer_input, _resolve_process_group(group_name))
    return torch.full((), float(on), device=layer_input.device)


@begin_step.register_fake
def _(namespace, fqn, group_name, d_out, d_in, whitened, layer_input, agreed):
    return layer_input.new_empty((), dtype=torch.float32)


@torch.library.custom_op("gift::load_basis", mutates_args=(), tags=_RUNS_PYTHON)
def load_basis(namespace: str, fqn: str, d_in: int, low_rank: int, token: torch.Tensor) -> list[torch.Tensor]:
    layer = get_runtime(namespace).layer(fqn)
    # copies (d_in x rank and scalars: small), because end_step overwrites the state
    return [layer.basis.clone(memory_format=torch.contiguous_format), layer.sketch_scale.clone(),
            layer.damping_tensor()]


@load_basis.register_fake
def _(namespace, fqn, d_in, low_rank, token):
    return [token.new_empty((d_in, low_rank)), token.new_empty(()), token.new_empty(())]


@torch.library.custom_op("gift::load_factors", mutates_args=(), tags=_RUNS_PYTHON)
def load_factors(namespace: str, fqn: str, d_in: int, low_rank: int, token: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone(memory_format=torch.contiguous_format) for t in get_runtime(namespace).layer(fqn).factor_tensors()]


@load_factors.register_fake
def _(namespace, fqn, d_in, low_rank, token):
    layout = get_runtime(namespace).config.whitening_layout
    return [token.new_empty(shape) for shape in factor_shapes(layout, d_in, low_rank)]


@torch.library.custom_op("gift::load_residual", mutates_args=(), tags=_RUNS_PYTHON)
def load_residual(namespace: str, fqn: str, d_out: int, d_in: int, token: torch.Tensor) -> torch.Tensor:
    return get_runtime(namespace).layer(fqn).residual  # not a copy: see the module docstring


@load_residual.register_fake
def _(namespace, fqn, d_out, d_in, token):
    return token.new_empty((d_out, d_in))


@torch.library.custom_op("gift::load_gather_residual", mutates_args=(), tags=_RUNS_PYTHON)
def load_gather_residual(namespace: str, fqn: str, rows: int, cols: int, token: torch.Tensor) -> torch.Tensor:
    return get_runtime(namespace).layer(fqn).ensure_gather_residual(rows, cols)  # not a copy


@load_gather_residual.register_fake
def _(namespace, fqn, rows, cols, token):
    return token.new_empty((rows, cols))


@torch.library.custom_op("gift::meter", mutates_args=(), tags=_RUNS_PYTHON)
def meter(
    namespace: str, fqn: str, group_name: str, collective: str, op: str, grad: torch.Tensor, factors: list[torch.Tensor], token: torch.Tensor
) -> torch.Tensor:
    runtime = get_runtime(namespace)
    whitening = Whitening.from_list(runtime.config.whitening_layout, factors)
    runtime.meter(fqn, grad, whitening, collective, op, _resolve_process_group(group_name))
    return token.clone()  # the token end_step takes: the meter's shares are held before end_step reads them


@meter.register_fake
def _(namespace, fqn, group_name, collective, op, grad, factors, token):
    return torch.empty_like(token)


@torch.library.custom_op("gift::end_step", mutates_args=(), tags=_RUNS_PYTHON)
def end_step(
    namespace: str, fqn: str, group_name: str, token: torch.Tensor, output: torch.Tensor, residual: torch.Tensor | None,
    gather_residual: torch.Tensor | None, next_basis: torch.Tensor | None, next_scale: torch.Tensor | None, stats: torch.Tensor,
    bytes_sent: int, stats_bytes: int,
) -> None:
    reduction = Reduction(output, residual, gather_residual, stats)
    get_runtime(namespace).end_step(fqn, _resolve_process_group(group_name), reduction, next_basis, next_scale, bytes_sent, stats_bytes)


@end_step.register_fake
def _(namespace, fqn, group_name, token, output, residual, gather_residual, next_basis, next_scale, stats, bytes_sent, stats_bytes):
    return None


@register_lowering(torch.ops.gift.end_step.default, type_promotion_kind=None)
def _lower_end_step(namespace, fqn, group_name, token, output, residual, gather_residual, next_basis, next_scale, stats, bytes_sent, stats_bytes):
    for kept in (residual, gather_residual):
        if kept is not None:
            # end_step keeps this buffer as the layer's residual: no later buffer of the graph may
            # reuse its memory, and no later kernel may write into it in place.
            kept.realize()
            V.graph.never_reuse_buffers.add(kept.get_name())
    return fallback_handler(torch.ops.gift.end_step.default, add_to_fallback_set=False)(
        namespace, fqn, group_name, token, output, residual, gather_residual, next_basis, next_scale, stats, bytes_sent, stats_bytes
    )


@torch.library.custom_op("gift::record_euclidean", mutates_args=(), tags=_RUNS_PYTHON)
def record_euclidean(namespace: str, fqn: str, path: str, stats: torch.Tensor, bytes_sent: int) -> None:
    get_runtime(namespace).record_euclidean(fqn, path, stats, bytes_sent)


@record_euclidean.register_fake
def _(namespace, fqn, path, stats, bytes_sent):
    return None


for _op in (torch.ops.gift.agree.default, torch.ops.gift.meter.default, torch.ops.gift.end_step.default,
            torch.ops.gift.record_euclidean.default):
    torch.fx.node.has_side_effect(_op)


class OpsAccess:
    """``layer_step.StateAccess`` through the ``gift::`` ops of runtime ``namespace``."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def begin(self, plan: LayerPlan, layer_input, agreed):
        return torch.ops.gift.begin_step(self.namespace, plan.fqn, plan.group_name, plan.d_out, plan.d_in, plan.whitened, layer_input, agreed)

    def basis(self, plan, token):
        return torch.ops.gift.load_basis(self.namespace, plan.fqn, plan.d_in, plan.low_rank, token)

    def factors(self, plan, token):
        return torch.ops.gift.load_factors(self.namespace, plan.fqn, plan.d_in, plan.low_rank, token)

    def residual(self, plan, token):
        return torch.ops.gift.load_residual(self.namespace, plan.fqn, plan.d_out, plan.d_in, token)

    def gather_residual(self, plan, token):
        rows, cols = gather_residual_shape((plan.d_out, plan.d_in), plan.group)
        return torch.ops.gift.load_gather_residual(self.namespace, plan.fqn, rows, cols, token)

    def meter(self, plan, grad, whitening, token):
        return torch.ops.gift.meter(self.namespace, plan.fqn, plan.group_name, plan.collective, plan.op, grad,
                                    list(whitening.tensors.values()), token)

    def end(self, plan, token, reduction, next_basis, next_scale):
        torch.ops.gift.end_step(
            self.namespace, plan.fqn, plan.group_name, token, reduction.output, reduction.residual, reduction.gather_residual,
            next_basis, next_scale, reduction.stats, plan.bytes_sent, plan.stats_bytes,
        )


def record_euclidean_step(namespace: str, fqn: str, path: str, stats: torch.Tensor, bytes_sent: int) -> None:
    torch.ops.gift.record_euclidean(namespace, fqn, path, stats, bytes_sent)


def agree_first(namespace: str, group_names: list[str], description: str, like: torch.Tensor) -> torch.Tensor:
    return torch.ops.gift.agree(namespace, ",".join(group_names), description, like)


__all__ = ["OpsAccess", "agree_first", "record_euclidean_step"]
