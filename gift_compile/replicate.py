"""``replicate(model)``: data parallelism whose gradient all-reduces live in the traced backward.

DDP (unless it runs its compiled-autograd reducer, see the README) and FSDP2 reduce
gradients from hooks outside any compiled graph, where no compiler pass can reach them.
Here every parameter is read through a parametrization whose autograd function is the
identity forward and a functional ``all_reduce(grad, "avg")`` backward, so
``torch.compile`` traces one collective per parameter into the backward graph, right after
the op that produced the gradient, which is where the GIFT pass finds it.

Parameters are broadcast from the group's first rank first, so all replicas start equal.
State-dict keys gain parametrize's ``parametrizations.<name>.original`` form.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.utils import parametrize

from gift_compile.collectives import resolve_group


class _AverageGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        reduced = funcol.all_reduce(grad, "avg", ctx.group)  # traced: followed by its wait_tensor
        return (reduced.wait() if isinstance(reduced, funcol.AsyncCollectiveTensor) else reduced), None


class AverageGradient(nn.Module):
    """Parametrization: the parameter itself forward, its group-average gradient backward."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, param: torch.Tensor) -> torch.Tensor:
        return _AverageGradient.apply(param, self.group)


def replicate(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Make ``model`` data parallel over ``group`` (default: world), in place; returns it."""
    group = resolve_group(group)
    src = dist.get_global_rank(group, 0)
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            with torch.no_grad():
                dist.broadcast(param.data, src=src, group=group)
            parametrize.register_parametrization(module, name, AverageGradient(group))
    return model
