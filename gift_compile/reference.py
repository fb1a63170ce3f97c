"""Eager GIFT data parallelism: the readable counterpart of the compiled path.

``GiftReference`` watches a model's Linear layers (forward hooks keep the inputs of the
layers that need them) and, after ``loss.backward()``, replaces every ``.grad`` by its
average over the process group:

* weights of selected Linear layers: the GIFT path (``layer_step``), with the layer's state
  in a ``GiftRuntime`` exactly as the compiled graph keeps it;
* weights of the other Linear layers: ``config.euclidean_dtype`` on the wire (FP8 default,
  with error feedback when ``euclidean_error_feedback``);
* every other parameter (biases, norms, embeddings): an exact fp32 all-reduce.

No gradient is ever left unreduced. It runs the same ``layer_step`` code as the compiled
graph, so the two agree bit for bit; the algorithm itself is checked against an independent
float64 oracle in the tests.
"""

from __future__ import annotations

import torch
from torch import nn

from gift_compile.agreement import describe
from gift_compile.collectives import WireFormat, resolve_group
from gift_compile.comm import euclidean_reduce
from gift_compile.config import GiftConfig
from gift_compile.layer_step import LayerPlan, step_eagerly
from gift_compile.runtime import GiftRuntime
from gift_compile.selection import linear_fqns, select_layers

_FP32 = WireFormat("fp32")


class GiftReducer:
    """Algorithm 1 for individual layers: ``reduce_layer(fqn, grad, layer_input)`` per step."""

    def __init__(self, config: GiftConfig, group=None) -> None:
        self.config, self.group = config, resolve_group(group)
        self.runtime = GiftRuntime(config)

    @property
    def state(self):
        return self.runtime.state

    def reduce_layer(
        self,
        fqn: str,
        grad: torch.Tensor,
        layer_input: torch.Tensor,
        *,
        op: str = "avg",
        collective: str = "all_reduce",
        whitened: bool = True,
    ) -> torch.Tensor:
        """One step of one layer (``whitened=False``: Euclidean FP8 with error feedback)."""
        plan = LayerPlan(fqn, grad.shape[0], grad.shape[1], whitened, collective, op, self.group.group_name, self.config)
        # The ranks agree on this layer's step before its first collective (agreement.py).
        self.runtime.agree(self.group, describe(self.config, [(fqn, plan.describe())]), grad.device)
        return step_eagerly(plan, self.runtime, grad, layer_input)


class GiftReference(GiftReducer):
    """Eager GIFT data parallelism for a whole model (see the module docstring)."""

    def __init__(self, model: nn.Module, config: GiftConfig, group=None) -> None:
        if config.layers == "auto":
            raise ValueError("layers='auto' needs the profiling run of the torchtitan integration; pass patterns here")
        super().__init__(config, group)
        self.model = model
        self.linears = linear_fqns(model)
        self.selected = select_layers(self.linears, config.layers) if config.enabled else []
        self.stateful_euclidean = config.enabled and config.euclidean_dtype == "fp8" and config.euclidean_error_feedback
        self._inputs: dict[str, torch.Tensor] = {}
        modules = dict(model.named_modules())
        watched = self.linears if self.stateful_euclidean else self.selected
        self._hooks = [modules[fqn].register_forward_hook(self._keep_input(fqn)) for fqn in watched]

    def _keep_input(self, fqn: str):
        def hook(module, args, output):
            self._inputs[fqn] = args[0].detach()

        return hook

    @torch.no_grad()
    def reduce_gradients(self, op: str = "avg") -> None:
        """Replace every parameter's ``.grad`` by its reduction over the group."""
        euclidean = WireFormat.euclidean(self.config) if self.config.enabled else _FP32
        linear_weights = {f"{fqn}.weight" if fqn else "weight": fqn for fqn in self.linears}
        params = [(name, p) for name, p in self.model.named_parameters() if p.grad is not None]
        if params:  # every rank reduces the same parameters, the same way (agreement.py)
            paths = [(name, f"{'gift' if linear_weights.get(name) in self.selected else 'reduced'} {list(p.shape)}") for name, p in params]
            self.runtime.agree(self.group, describe(self.config, paths), params[0][1].device)
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            fqn = linear_weights.get(name)
            if fqn is not None and (fqn in self.selected or self.stateful_euclidean):
                if fqn not in self._inputs:
                    raise RuntimeError(f"GiftReference: no forward input recorded for layer {fqn!r}; run the model's forward first")
                layer_input = self._inputs[fqn].reshape(-1, param.grad.shape[1])  # the latest forward's
                param.grad = self.reduce_layer(fqn, param.grad, layer_input, op=op, whitened=fqn in self.selected)
                continue
            wire = euclidean if fqn is not None else _FP32
            param.grad = euclidean_reduce(param.grad, op=op, group=self.group, wire=wire, collective="all_reduce",
                                          gather_dtype=self.config.all_gather_dtype).output

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
