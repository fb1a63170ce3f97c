"""Attribute weight gradients in compiled-autograd graphs to their ``nn.Linear`` layers.

DDP with ``torch._dynamo.config.optimize_ddp = "python_reducer"`` reduces gradients inside
the compiled-autograd graph (``div; all_reduce; wait_tensor`` after each ``AccumulateGrad``).
That graph is traced from the autograd engine, not from modules, and Inductor retraces it
through a wrapper that flattens its list input, so its post-grad nodes carry no metadata at
all: the GIFT pass finds each weight-gradient ``mm`` but not its layer.

Two facts survive instead:

* In the Dynamo graph, graph output ``i`` is the gradient accumulated by an
  ``AccumulateGrad([grad], inputs[k], ...)`` call, and ``inputs``' example list holds the real
  ``Parameter`` objects. The forward graph, compiled earlier by the same backend, names
  every parameter it reads (placeholder source ``...._modules['fc2']._parameters['weight']``).
  Together: output ``i`` -> Linear FQN (``output_fqns``).
* AOTAutograd keeps the output order of the graph it compiles, so post-grad output ``i`` is
  the ``wait_tensor`` of that same gradient's collective. ``tag_outputs`` writes the FQN as
  ``meta['custom']['module_fqn']`` on the weight-gradient ``mm`` behind it, where the pass
  reads it as in any annotated graph, after checking the ``mm`` has the weight's shape.
"""

from __future__ import annotations

import operator
import re
from typing import NamedTuple

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from gift_compile.passes.gift_collectives import COLLECTIVES, WAIT, weight_gradient_mm
from gift_compile.passes.graph_utils import module_fqn

# A Linear weight as Dynamo names it: plain, or the original behind a parametrization
# (gift_compile.replicate reads every parameter through one).
_WEIGHT_SOURCE = re.compile(
    r"^(?P<module>.*?)(\._modules\['parametrizations'\]\._modules\['weight'\]\._parameters\['original'\]"
    r"|\._parameters\['weight'\])$"
)
_ACCUMULATE_GRAD = ("torch._dynamo.compiled_autograd.ops", "AccumulateGrad")


class LinearWeight(NamedTuple):
    fqn: str
    shape: tuple[int, ...]


def remember_linear_weights(gm: fx.GraphModule, linears: list[str], weights: WeakIdKeyDictionary) -> list[tuple[int, str]]:
    """Record ``Parameter -> Linear FQN`` for the Linear weights this Dynamo graph reads;
    returns ``(graph input position, FQN)`` of each."""
    found = []
    for position, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        grapharg = node.meta.get("grapharg")
        match = _WEIGHT_SOURCE.match(grapharg.source.name) if grapharg is not None else None
        fqn = module_fqn(match["module"]) if match else None
        if fqn in linears and isinstance(grapharg.example, torch.nn.Parameter):
            weights[grapharg.example] = fqn
            found.append((position, fqn))
    return found


def output_fqns(gm: fx.GraphModule, weights: WeakIdKeyDictionary) -> tuple[LinearWeight | None, ...] | None:
    """For a compiled-autograd Dynamo graph, the Linear weight behind each graph output.

    None for any other graph (no ``AccumulateGrad`` output).
    """
    outputs = gm.graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)) or not any(_is_accumulate_grad(_producer(out)) for out in outputs):
        return None
    return tuple(_accumulated_weight(out, weights) for out in outputs)


def tag_outputs(graph: fx.Graph, weights: tuple[LinearWeight | None, ...]) -> None:
    """Write each output's Linear FQN onto the weight-gradient ``mm`` of its collective."""
    outputs = graph.output_node().args[0]
    if len(outputs) != len(weights):
        return  # not the layout we know: leave every collective as it is (the pass reports it)
    for out, weight in zip(outputs, weights):
        if weight is None or not (isinstance(out, fx.Node) and out.target is WAIT):
            continue
        collective = out.args[0]
        if collective.target not in COLLECTIVES:
            continue
        mm = weight_gradient_mm(collective.args[0])
        if mm is not None and tuple(mm.meta["val"].shape) == weight.shape:
            mm.meta["custom"] = {**(mm.meta.get("custom") or {}), "module_fqn": weight.fqn}


def _producer(out) -> fx.Node | None:
    """``AccumulateGrad(...)`` behind an output ``getitem(AccumulateGrad(...), 0)``."""
    if isinstance(out, fx.Node) and out.target is operator.getitem and isinstance(out.args[0], fx.Node):
        return out.args[0]
    return None


def _is_accumulate_grad(node: fx.Node | None) -> bool:
    target = getattr(node, "target", None)
    return (getattr(target, "__module__", None), getattr(target, "__name__", None)) == _ACCUMULATE_GRAD


def _accumulated_weight(out, weights: WeakIdKeyDictionary) -> LinearWeight | None:
    accumulate = _producer(out)
    if not _is_accumulate_grad(accumulate):
        return None
    param = _input_example(accumulate.args[1])
    fqn = weights.get(param) if isinstance(param, torch.nn.Parameter) else None
    return LinearWeight(fqn, tuple(param.shape)) if fqn is not None else None


def _input_example(node) -> object:
    """The example value behind ``inputs[k]`` in a compiled-autograd graph, else None."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem):
        return None
    source, index = node.args
    grapharg = source.meta.get("grapharg") if isinstance(source, fx.Node) and source.op == "placeholder" else None
    example = grapharg.example if grapharg is not None else None
    return example[index] if isinstance(example, (list, tuple)) and isinstance(index, int) else None
