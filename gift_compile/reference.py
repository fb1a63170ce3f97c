"""Eager GIFT data parallelism: the readable counterpart of the compiled path.

``GiftReference`` watches a model's Linear layers (forward hooks keep the inputs of the
layers that need them) and, after ``loss.backward()``, replaces every ``.grad`` by its
average over the process group:

* weights of selected Linear layers: the GIFT path (``layer_step``), with the layer's state
  in a ``GiftRuntime`` exactly as the compiled graph keeps it;
* weights of the other Linear layers: ``config.euclidean_dtype`` on the wire (FP8 default,
  with error feedback when ``euclidean_error_feedback``);
* other 2-D parameters (embeddings): ``config.embedding_dtype``;
* every other parameter (biases, norms): an exact all-reduce in its own dtype
  (``policy.py`` has the rule, shared with every other route).

No gradient is ever left unreduced. It runs the same ``layer_step`` code as the compiled
graph, so the two agree bit for bit; the algorithm itself is checked against an independent
float64 oracle in the tests.
"""

from __future__ import annotations

import torch
from torch import nn

from gift_compile import policy
from gift_compile.agreement import describe
from gift_compile.collectives import WireFormat, resolve_group
from gift_compile.comm import euclidean_reduce
from gift_compile.config import GiftConfig
from gift_compile.layer_step import InputStatistics, LayerPlan, step_eagerly
from gift_compile.runtime import GiftRuntime
from gift_compile.selection import linear_fqns, select_layers


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
        taken: list[InputStatistics] | None = None,
    ) -> torch.Tensor:
        """One step of one layer (``whitened=False``: Euclidean with error feedback). ``taken``:
        this step's statistics so far, shared with a layer that reads the same input (``layer_step``)."""
        plan = LayerPlan.of(fqn, grad.shape[0], grad.shape[1], self.config, whitened=whitened, collective=collective, op=op,
                            group_name=self.group.group_name)
        # The ranks agree on this layer's step before its first collective (agreement.py).
        self.runtime.agree(self.group, describe(self.config, [(fqn, plan.describe())]), grad.device)
        return step_eagerly(plan, self.runtime, grad, layer_input, taken)


class GiftReference(GiftReducer):
    """Eager GIFT data parallelism for a whole model (see the module docstring)."""

    def __init__(self, model: nn.Module, config: GiftConfig, group=None) -> None:
        if config.layers == "auto":
            raise ValueError("layers='auto' needs the profiling run of the torchtitan integration; pass patterns here")
        super().__init__(config, group)
        self.model = model
        self.linears = linear_fqns(model)
        self.selected = select_layers(self.linears, config.layers) if config.enabled else []
        self.plans = {name: policy.plan(config, kind, selected=layer in self.selected, collective="all_reduce")
                      for name, kind, layer in parameter_kinds(model)}
        self._inputs: dict[str, torch.Tensor] = {}
        modules = dict(model.named_modules())
        watched = {layer for name, _, layer in parameter_kinds(model) if self.plans[name].stateful}
        self._hooks = [modules[fqn].register_forward_hook(self._keep_input(fqn)) for fqn in sorted(watched)]

    def _keep_input(self, fqn: str):
        def hook(module, args, output):
            self._inputs[fqn] = args[0].detach()

        return hook

    @torch.no_grad()
    def reduce_gradients(self, op: str = "avg") -> None:
        """Replace every parameter's ``.grad`` by its reduction over the group."""
        layers = {name: layer for name, _, layer in parameter_kinds(self.model)}
        params = [(name, p) for name, p in self.model.named_parameters() if p.grad is not None]
        if params:  # every rank reduces the same parameters, the same way (agreement.py)
            world = self.group.size()
            entries = [(name, self.plans[name].describe(tuple(p.shape), "all_reduce", op, world)) for name, p in params]
            self.runtime.agree(self.group, describe(self.config, entries), params[0][1].device)
        taken: list[InputStatistics] = []  # q, k and v (w1 and w3) read one input: one sketch
        for name, param in params:
            plan = self.plans[name]
            if plan.stateful:
                fqn = layers[name]
                if fqn not in self._inputs:
                    raise RuntimeError(f"GiftReference: no forward input recorded for layer {fqn!r}; run the model's forward first")
                layer_input = self._inputs[fqn].reshape(-1, param.grad.shape[1])  # the latest forward's
                param.grad = self.reduce_layer(fqn, param.grad, layer_input, op=op, whitened=plan.whitened, taken=taken)
                continue
            wire = plan.wire or WireFormat("bf16" if param.grad.dtype == torch.bfloat16 else "fp32")
            param.grad = euclidean_reduce(param.grad, op=op, group=self.group, wire=wire, collective="all_reduce",
                                          gather_dtype=plan.gather_dtype).output

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def parameter_kinds(model: nn.Module) -> list[tuple[str, policy.ParamKind, str | None]]:
    """``(parameter name, policy kind, its Linear layer's FQN or None)`` of every parameter."""
    kinds = []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            if isinstance(module, nn.Linear) and pname == "weight":
                kinds.append((name, "linear", module_name))
            else:
                kinds.append((name, "matrix" if param.dim() == 2 else "vector", None))
    return kinds
