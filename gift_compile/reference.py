"""Eager reference of GIFT data parallelism: the readable oracle for the compiled path.

``GiftReference`` watches a model's selected Linear layers (forward hooks keep their inputs
for the K-FAC statistics) and, after ``loss.backward()``, replaces every ``.grad`` by its
average over the process group:

* weights of selected Linear layers: the GIFT path (``comm.gift_reduce``), with the layer's
  state refreshed every ``refresh_interval`` steps;
* weights of the other Linear layers: ``config.euclidean_dtype`` on the wire (FP8 default);
* every other parameter (biases, norms, embeddings): an exact fp32 all-reduce.

No gradient is ever left unreduced.
"""

from __future__ import annotations

import torch
from torch import nn

from gift_compile.collectives import WireFormat, resolve_group
from gift_compile.comm import euclidean_reduce, gift_reduce
from gift_compile.config import GiftConfig
from gift_compile.selection import linear_fqns, select_layers
from gift_compile.state import GiftState

_FP32 = WireFormat("fp32")


class GiftReducer:
    """Algorithm 1 for individual layers: ``reduce_layer(fqn, grad, layer_input)`` per step."""

    def __init__(self, config: GiftConfig, group=None) -> None:
        self.config, self.group = config, resolve_group(group)
        self.state = GiftState(config)

    def reduce_layer(
        self,
        fqn: str,
        grad: torch.Tensor,
        layer_input: torch.Tensor | None,
        grad_output: torch.Tensor | None = None,
        *,
        op: str = "avg",
        collective: str = "all_reduce",
    ) -> torch.Tensor:
        """One GIFT step of one layer: refresh if due, reduce, keep the residual, count the step."""
        layer = self.state.layer(fqn, *grad.shape, grad.device)
        layer.begin_step(layer_input, grad_output, self.group)
        reduced, new_residual, _ = gift_reduce(
            grad,
            layer.factor_tensors(),
            layer.residual,
            kind=layer.kind,
            sides=layer.sides,
            op=op,
            group=self.group,
            wire=WireFormat.gift(self.config),
            collective=collective,
        )
        layer.end_step(new_residual)
        return reduced


class GiftReference(GiftReducer):
    """Eager GIFT data parallelism for a whole model (see the module docstring)."""

    def __init__(self, model: nn.Module, config: GiftConfig, group=None) -> None:
        if config.layers == "auto":
            raise ValueError("layers='auto' needs the profiling run of the torchtitan integration; pass patterns here")
        super().__init__(config, group)
        self.model = model
        self.linears = linear_fqns(model)
        self.selected = select_layers(self.linears, config.layers) if config.enabled else []
        self._inputs: dict[str, torch.Tensor] = {}
        self._grad_outputs: dict[str, torch.Tensor] = {}
        modules = dict(model.named_modules())
        self._hooks = []
        for fqn in self.selected:
            self._hooks.append(modules[fqn].register_forward_hook(self._keep_input(fqn)))
            if config.side in ("output", "both"):
                self._hooks.append(modules[fqn].register_full_backward_hook(self._keep_grad_output(fqn)))

    def _keep_input(self, fqn: str):
        def hook(module, args, output):
            self._inputs[fqn] = args[0].detach()

        return hook

    def _keep_grad_output(self, fqn: str):
        def hook(module, grad_input, grad_output):
            self._grad_outputs[fqn] = grad_output[0].detach()

        return hook

    @torch.no_grad()
    def reduce_gradients(self, op: str = "avg") -> None:
        """Replace every parameter's ``.grad`` by its reduction over the group."""
        euclidean = WireFormat.euclidean(self.config) if self.config.enabled else _FP32
        linear_weights = {f"{fqn}.weight" if fqn else "weight": fqn for fqn in self.linears}
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            fqn = linear_weights.get(name)
            if fqn in self.selected:
                param.grad = self.reduce_layer(fqn, param.grad, self._inputs.pop(fqn, None), self._grad_outputs.pop(fqn, None), op=op)
            else:
                wire = euclidean if fqn is not None else _FP32
                param.grad = euclidean_reduce(param.grad, op=op, group=self.group, wire=wire, collective="all_reduce").output

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
