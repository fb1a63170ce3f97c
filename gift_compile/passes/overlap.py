"""Overlap gradient communication with the backward: issue each gradient collective as soon as
its input exists, and wait for it only after the next one has been issued.

A traced backward waits for each gradient's collective right after issuing it, so the bytes
travel while the rank does nothing. Reordered (docs/design.md §10)::

    before:  G_k = mm(..); U_k = encode(G_k); m_k = all_to_all(U_k); wait(m_k); decode(m_k) ..
             G_j = mm(..); U_j = encode(G_j); m_j = all_to_all(U_j); wait(m_j); decode(m_j) ..
    after:   G_k = mm(..); U_k = encode(G_k); m_k = all_to_all(U_k)
             G_j = mm(..); U_j = encode(G_j); m_j = all_to_all(U_j)    # layer j's backward meanwhile
             wait(m_k); decode(m_k) ..                                 # one collective later
             ...

It is a list scheduler (Kahn's algorithm) over the graph's data dependencies: among the nodes
whose inputs are ready, a gradient collective goes first; the wait of one becomes eligible
once ``lag`` more gradients have started their collectives after it (an all-reduce's second
phase, fed by the first one's wait, does not count, nor does a statistics all-reduce, whose
sum the backward needs first), or when nothing else can run; everything
else keeps graph order. Nodes with side effects keep their relative order,
except the ``gift::`` ops, each of which touches one layer's state and is ordered within its
layer by the step's token (a data dependency). Only the gradient collectives the GIFT pass marked move
(``GRADIENT_COMM``: the ones it rewrote, the statistics' all-reduces and the gradient
collectives it left as they were); a forward all-gather keeps its place, so FSDP's memory
profile is untouched. Correctness needs nothing but the data dependencies, which every move
respects; the lag bounds how long a received buffer waits for its decode (one collective).

Where the graph runs as it is ordered (graph_trainer's joint graph, executed as FX Python),
this order is the schedule. Inductor (the ``torch.compile`` route) keeps the order of its
collectives and extern kernels from the graph it lowers.
"""

from __future__ import annotations

import heapq

import torch
from torch import fx

from gift_compile.passes.graph_utils import call_arguments

c10d = torch.ops._c10d_functional

GRADIENT_COMM = "gift_gradient_comm"
"""``node.meta`` key the GIFT pass sets on the gradient collectives this scheduler may move."""
STATISTICS = "gift_statistics"
"""``node.meta`` key on a statistics all-reduce (its value: the block it sums): it feeds a layer's
whitening, not a later phase of the same gradient's reduction."""

PIECE_OF = "gift_piece_of"
"""``node.meta`` key on the second and later pieces of a collective sent in pieces
(``passes/pieces.py``): its first piece, whose issue number they share here."""
PIECE_INPUT = "gift_piece_input"
"""``node.meta`` key on the slices a collective's pieces are cut from: scheduled as soon as they
can run, like a collective, so that a collective's pieces go out together."""

PARAMETER_GATHER = "gift_parameter_gather"
"""``node.meta`` key on the calls a parameter all-gather was sent as (``passes/pieces.py``): its
first call. Not moved by this scheduler; :func:`prefetched_all_gathers` counts them as one."""

GRADIENT_STATISTICS = "gift_gradient_statistics"
"""``node.meta`` key on a gradient-statistics all-reduce (its value: the bucket it sums,
``gift_collectives.bucket_of``). Unlike ``STATISTICS`` it is the first phase of its gradients'
reduction, so the scheduler moves it as a gradient collective (it counts for the lag)."""

WAIT = c10d.wait_tensor.default
ALL_GATHERS = {c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default}
"""Parameter all-gathers: one per parameter as traced, one ``_out`` per bucket after graph_trainer's bucketing."""
COLLECTIVE_OPS = {
    c10d.all_reduce.default, c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default, *ALL_GATHERS,
}


def collectives_of(graph: fx.Graph) -> list[fx.Node]:
    """The collectives ``graph`` issues each time it runs, in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS]


def _layer_op(node: fx.Node) -> bool:
    """A ``gift::`` op: it touches one layer's state, ordered within the layer by its token (a
    data dependency), and is independent of every other layer's."""
    return getattr(node.target, "namespace", None) == "gift"


def mark_gradient_collectives(nodes) -> None:
    """Mark the collectives among ``nodes`` as gradient collectives the scheduler may move."""
    for node in nodes:
        if node.op == "call_function" and node.target in COLLECTIVE_OPS:
            node.meta[GRADIENT_COMM] = True


def overlap_gradient_collectives(graph: fx.Graph, lag: int = 1) -> int:
    """Reorder ``graph`` in place (module docstring); returns how many gradient waits moved past
    a later gradient collective (0: the graph had nothing to overlap)."""
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    marked = {n for n in nodes if n.meta.get(GRADIENT_COMM)}
    waits = {u: c for c in marked for u in c.users if u.target is WAIT}
    if not marked:
        return 0
    inputs = {n: set(n.all_input_nodes) for n in nodes}
    previous_effect = None
    for node in nodes:  # side effects keep their order: a chain through them
        if node.op == "call_function" and node not in marked and node not in waits and node.is_impure() and not _layer_op(node):
            if previous_effect is not None:
                inputs[node].add(previous_effect)
            previous_effect = node
    users = {n: [] for n in nodes}
    for node, deps in inputs.items():
        for dep in deps:
            users[dep].append(node)
    missing = {n: len(deps) for n, deps in inputs.items()}

    # A collective fed by another one's wait (an all-reduce's all-gather of the reduced shard) is
    # a later phase of the same gradient: only a new gradient's first collective counts for the lag.
    phase_waits = {w for w, c in waits.items() if STATISTICS not in c.meta}
    after_wait: dict[fx.Node, bool] = {}
    for node in nodes:
        after_wait[node] = any(dep in phase_waits or after_wait[dep] for dep in node.all_input_nodes)
    # The lag counts gradients. A statistics all-reduce goes out as early as any collective, but
    # it is not counted: its sum is first needed in the backward (the layer's whitening), so its
    # wait is held until gradients are on the wire. Counted, the next block's statistics would
    # release it in the forward, where it queues behind every collective issued before it (FSDP's
    # prefetched all-gathers) and stalls the forward.
    # The later pieces of a collective sent in pieces (passes/pieces.py) are that collective's:
    # they take its issue number, so their waits are held with its own.
    leading = {c for c in marked if not after_wait[c] and STATISTICS not in c.meta and PIECE_OF not in c.meta}

    ready: list[tuple[int, int, fx.Node]] = []  # (0 for a gradient collective or a piece's slice else 1, graph position, node)
    held: list[tuple[int, fx.Node]] = []  # gradient waits not yet eligible, by their collective's issue number
    issued: dict[fx.Node, int] = {}

    def make_ready(node: fx.Node) -> None:
        if node in waits:
            heapq.heappush(held, (issued[waits[node]], position[node], node))
        else:
            heapq.heappush(ready, (0 if node in marked or PIECE_INPUT in node.meta else 1, position[node], node))

    for node in nodes:
        if missing[node] == 0:
            make_ready(node)
    order, deferred, started = [], 0, 0  # started: leading collectives issued so far
    while ready or held:
        while held and (held[0][0] + lag < started or not ready):
            number, _, wait = heapq.heappop(held)
            deferred += number + 1 < started
            heapq.heappush(ready, (1, position[wait], wait))
        _, _, node = heapq.heappop(ready)
        order.append(node)
        if node in marked:
            issued[node] = issued.get(node.meta[PIECE_OF], started) if PIECE_OF in node.meta else started
            started += node in leading
        for user in users[node]:
            missing[user] -= 1
            if missing[user] == 0:
                make_ready(user)
    if len(order) != len(nodes):
        raise RuntimeError(f"overlap scheduling left {len(nodes) - len(order)} nodes unscheduled (a dependency cycle?)")
    placeholders = [n for n in order if n.op == "placeholder"]
    rest = [n for n in order if n.op not in ("placeholder", "output")]
    anchor = nodes[0]
    for node in placeholders + rest + [graph.output_node()]:
        if node is not anchor:
            anchor.append(node)
        anchor = node
    graph.lint()
    return deferred


def prefetched_all_gathers(graph: fx.Graph) -> int:
    """All-gathers issued before an earlier all-gather's wait: the ones in flight while the
    compute before that wait runs (graph_trainer's FSDP prefetch; 0 when each is waited where
    it is issued)."""
    pending, prefetched = set(), 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if _parameter_gather(node) is node:
            prefetched += bool(pending)
            pending.add(node)
        elif node.target is WAIT:
            pending.discard(_parameter_gather(node.args[0]))
    return prefetched


def _parameter_gather(node: fx.Node) -> fx.Node | None:
    """The parameter all-gather ``node`` is a call of (its first call, when sent in pieces), or
    None (a gradient's second phase is not a parameter all-gather)."""
    if node.target in ALL_GATHERS and not node.meta.get(GRADIENT_COMM):
        return node
    return node.meta.get(PARAMETER_GATHER)


def statistics_on_own_group(graph: fx.Graph) -> tuple[int, int]:
    """``(statistics all-reduces, those on a group no other collective of the graph uses)``: the
    second counts the ones that cannot queue behind a parameter all-gather or a gradient
    (``collectives.separate_statistics_group``)."""
    collectives = collectives_of(graph)
    statistics = [n for n in collectives if STATISTICS in n.meta or GRADIENT_STATISTICS in n.meta]
    others = {_group_name(n) for n in collectives if n not in statistics}
    return len(statistics), sum(_group_name(n) not in others for n in statistics)


def _group_name(collective: fx.Node) -> str:
    return call_arguments(collective)["group_name"]


__all__ = ["ALL_GATHERS", "GRADIENT_COMM", "GRADIENT_STATISTICS", "PARAMETER_GATHER", "PIECE_INPUT", "PIECE_OF", "collectives_of", "prefetched_all_gathers", "STATISTICS", "statistics_on_own_group", "mark_gradient_collectives", "overlap_gradient_collectives"]
