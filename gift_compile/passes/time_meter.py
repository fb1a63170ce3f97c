"""The time meter's ticks in a graph that runs as ordered Python (graph_trainer's joint graph):
one wherever the nodes change kind (``timing.py`` keeps the time)."""

from __future__ import annotations

import torch
from torch import fx

from gift_compile.passes.overlap import GRADIENT_COMM, WAIT
from gift_compile.timing import mark, tick

CODEC = "gift_codec"
"""``node.meta`` key the GIFT pass sets on every node it adds."""


def gradient_waits(graph: fx.Graph) -> set[fx.Node]:
    """The waits of the gradient collectives the GIFT pass marked."""
    return {u for n in graph.nodes if n.meta.get(GRADIENT_COMM) for u in n.users if u.target is WAIT}


def kind_of(node: fx.Node, gradient_waits: set[fx.Node]) -> str:
    if node in gradient_waits:
        return "wait"
    return "codec" if node.meta.get(CODEC) else "compute"


def instrument(graph: fx.Graph, namespace: str) -> int:
    """Insert a ``tick`` before every node whose kind differs from the previous node's, and at
    the end, and a ``mark("backward")`` before the first backward node of a joint graph
    (graph_trainer's ``autograd_backward`` meta); returns the number of ticks. For graphs that
    run as ordered (not through Inductor)."""
    waits = gradient_waits(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    device = next((n.meta["val"].device for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)), None)
    ticks, previous = 0, None
    for node in list(graph.nodes):
        if node.op == "placeholder":
            continue
        kind = None if node.op == "output" else kind_of(node, waits)
        if kind != previous:
            with graph.inserting_before(node):
                graph.call_function(tick, (namespace, kind, device))
            ticks, previous = ticks + 1, kind
    first_backward = next((n for n in graph.nodes if n.meta.get("autograd_backward")), None)
    if first_backward is not None:
        with graph.inserting_before(first_backward):
            graph.call_function(mark, ("backward",))
    return ticks


__all__ = ["CODEC", "gradient_waits", "instrument", "kind_of"]
