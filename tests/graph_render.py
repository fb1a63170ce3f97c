"""A short, stable rendering of what the GIFT pass put into a graph, for snapshot tests.

``render_gift_graph(graph)`` walks an FX graph in order and prints one line per *landmark*
and nothing else (no node names, none of the decomposed arithmetic in between), so a snapshot
changes when what the pass does changes, not when a decomposition or a generated name does.
The MLP's backward after the pass (fc2 whitened by its inputs' statistics, ``stats_source =
"inputs"``; fc1 Euclidean FP8) starts::

    fc2       gift::begin_step(NS, fc2, GROUP, d_out=8, d_in=32, whitened=True)
    fc2       gift::load_basis(NS, fc2, d_in=32, low_rank=4)
    fc2       gift::input_sketch(max_tokens=8192)
    fc2       all_reduce(sum, GROUP) float32[130]
    fc2       mm -> grad float32[8, 32]
    fc2.bias  all_reduce(avg, GROUP) float32[8] -> wait  (original)
    fc2       wait_tensor(all_reduce)
    fc2       gift::whitening_from_sketches()

The statistics' all_reduce is issued before fc2's gradient is computed and waited on only
after it (and after the bias's collective), which is the overlap the pass is for.

The left column says whose line it is:

* a Linear layer's FQN, for what the pass inserted for that layer and for the layer's
  weight-gradient ``mm``. ``gift::`` ops carry the FQN; a collective belongs to the layer
  whose weight gradient it carries (as whitened or FP8 bytes), or else to the layer whose
  FQN-carrying ``gift::`` ops use its result (the statistics' all_reduce); the ``gift::`` ops
  without an FQN (``input_sketch``, ``whitening_from_sketches``) likewise, and one whose result
  reaches several layers (a graph-wide op) shows ``*``;
* a parameter's name (``fc2.bias``, from the collective's module metadata with ``replicate``'s
  parametrization path folded; ``-`` when unknown) for a collective the pass did not touch,
  which is marked ``(original)`` (several parameters' collective, bucketed: their block's
  name and ``*``);
* ``<module path>.*`` for a collective that carries the gradients of several layers (a
  block's bucket, ``passes/bucketing.py``): their common module path, e.g. ``layers.1.*``.

The landmarks:

* ``gift::<op>(...)``: every ``gift::`` op with its non-tensor arguments: the namespace as
  ``NS`` (it is test-specific), the layer FQN, the process group(s) as ``GROUP``, the rest by
  their schema names (ints, bools, floats, strings; a string over 40 characters, such as a
  description, as ``name=...``; an optional tensor that is absent as ``name=None``, e.g.
  ``end_step``'s ``next_basis`` with periodic factors).
* ``<collective>(<reduce op>, GROUP) <dtype>[<shape>]``: every ``_c10d_functional``
  collective, with the dtype and shape of the tensor it sends (``uint8`` bytes for FP8). A
  second process group would print as ``GROUP2``.
* ``-> wait`` after a collective when its ``wait_tensor`` is the next landmark; otherwise the
  wait gets its own line, ``wait_tensor(<kind of collective>)``, under the layer of the
  collective, so a sunk wait (issued early, waited late) shows as the lines between the two.
* ``mm -> grad <dtype>[d_out, d_in]``: a Linear layer's weight-gradient ``mm`` (the backward
  compute the statistics overlap with), in a graph before the pass as well as after it.
* In a joint (forward + backward) graph: ``linear (forward) -> <dtype>[...]`` for each forward
  matmul of a module, and a ``-- backward --`` line where the backward begins.
"""

from __future__ import annotations

import re

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from gift_compile.passes.bucketing import BUCKET
from gift_compile.passes.gift_collectives import find_gradient_collectives
from gift_compile.passes.graph_utils import descendants, innermost_module

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_LONG = 40  # a longer string argument (a description, a config dump) prints as "name=..."
_PARAM_PATH = re.compile(r"\.parametrizations\.([^.]+)\.(?:\d+|original)$")  # replicate()'s parametrization


def _namespace(node: fx.Node) -> str | None:
    return getattr(node.target, "namespace", None) if node.op == "call_function" else None


def _is_gift(node: fx.Node) -> bool:
    return _namespace(node) == "gift"


def _is_collective(node: fx.Node) -> bool:
    return _namespace(node) == "_c10d_functional" and node.target is not _WAIT


def _tensor_type(value) -> str:
    if not isinstance(value, torch.Tensor):
        return "?"
    return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(str(s) for s in value.shape)}]"


def _kind(node: fx.Node) -> str:
    return node.target._schema.name.split("::")[-1]


class _Groups:
    """Process-group names -> GROUP, GROUP2, ... in order of appearance."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self.names:
            self.names[name] = "GROUP" if not self.names else f"GROUP{len(self.names) + 1}"
        return self.names[name]


def _gift_line(node: fx.Node, groups: _Groups) -> str:
    schema = node.target._schema
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    parts = []
    for arg in schema.arguments:
        if arg.name not in values:
            continue
        value = values[arg.name]
        if arg.name == "namespace":
            parts.append("NS")
        elif arg.name == "fqn":
            parts.append(str(value))
        elif arg.name.startswith("group") and isinstance(value, str):  # one name, or several joined by ","
            parts.append(",".join(groups(name) for name in value.split(",")))
        elif isinstance(value, fx.Node):
            continue
        elif isinstance(value, (list, tuple)) and any(isinstance(v, fx.Node) for v in value):
            continue
        elif isinstance(value, str) and len(value) > _LONG:
            parts.append(f"{arg.name}=...")
        else:
            parts.append(f"{arg.name}={value}")
    return f"gift::{_kind(node)}({', '.join(parts)})"


def _collective_line(node: fx.Node, groups: _Groups) -> str:
    kwargs = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    parts = [kwargs["reduce_op"]] if "reduce_op" in kwargs else []
    if "group_name" in kwargs:
        parts.append(groups(kwargs["group_name"]))
    sent = next((v for v in kwargs.values() if isinstance(v, fx.Node)), None)
    return f"{_kind(node)}({', '.join(parts)}) {_tensor_type(sent.meta.get('val') if sent is not None else None)}"


def _fqn(node: fx.Node) -> str | None:
    """The layer FQN a ``gift::`` op carries, if it has one."""
    if _is_gift(node):
        names = [a.name for a in node.target._schema.arguments]
        if "fqn" in names:
            position = names.index("fqn")
            return str(node.args[position] if position < len(node.args) else node.kwargs["fqn"])
    return None


def _downstream_layer(nodes: list[fx.Node]) -> dict[fx.Node, str]:
    """Node -> the layer of the FQN-carrying ``gift::`` ops among itself and everything
    downstream of it, ``*`` when those ops belong to several layers (a graph-wide op); nodes
    with no such op downstream are left out."""
    layers: dict[fx.Node, frozenset[str]] = {}
    for node in reversed(nodes):
        found = set().union(*(layers.get(u, ()) for u in node.users))
        if _fqn(node) is not None:
            found.add(_fqn(node))
        if found:
            layers[node] = frozenset(found)
    return {n: next(iter(fqns)) if len(fqns) == 1 else "*" for n, fqns in layers.items()}


def ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                stack.append(inp)
    return seen


def _gradient_mms(nodes: list[fx.Node]) -> dict[fx.Node, str]:
    """The weight-gradient ``mm`` of each rewritten layer: the last ``mm`` (in graph order) behind
    the layer's last ``gift::`` op that no ``gift::`` op feeds (so not one the pass inserted:
    the whitening GEMMs all depend on ``gift::`` ops), from the layer's own module where the
    metadata says (behind a bucketed collective, the other members' ``mm`` are too). Everything
    else behind that op is the ``mm``'s own inputs or was inserted by the pass."""
    inserted: set[fx.Node] = set()
    last_op: dict[str, fx.Node] = {}
    for node in nodes:
        if _is_gift(node) or any(i in inserted for i in node.all_input_nodes):
            inserted.add(node)
        if _fqn(node) is not None:
            last_op[_fqn(node)] = node
    index = {n: i for i, n in enumerate(nodes)}
    found = {}
    for fqn, op in last_op.items():
        mms = [n for n in ancestors(op) if n.target is torch.ops.aten.mm.default and n not in inserted]
        own = [n for n in mms if (innermost_module(n) or ("",))[0] == fqn]  # not a bucket partner's
        if own or mms:
            found[max(own or mms, key=index.__getitem__)] = fqn
    return found


def _collective_owners(nodes: list[fx.Node], grad_mms: dict[fx.Node, str]) -> dict[fx.Node, str]:
    """Collective -> layer: the layer whose weight-gradient ``mm`` it carries (directly or its
    whitened/encoded bytes), else the layer whose ``gift::`` ops use its result (the
    statistics' all_reduce). A collective with neither was left alone by the pass."""
    downstream = _downstream_layer(nodes)
    carried: dict[fx.Node, list[str]] = {}
    for mm, fqn in grad_mms.items():
        for node in descendants(mm):
            if _is_collective(node):
                carried.setdefault(node, []).append(fqn)
    owners = {node: _common_owner(fqns) for node, fqns in carried.items()}
    for node in nodes:
        if _is_collective(node) and node not in owners and node in downstream:
            owners[node] = downstream[node]
    return owners


def _common_owner(fqns: list[str]) -> str:
    """One layer's FQN, or for a collective that carries several layers' gradients (a bucket)
    their common module path and ``*``: ``layers.1.*``."""
    if len(set(fqns)) == 1:
        return fqns[0]
    parts = [name.split(".") for name in fqns]
    common = next((i for i, names in enumerate(zip(*parts)) if len(set(names)) > 1), min(map(len, parts)))
    return ".".join([*parts[0][:common], "*"])


def _parameter_name(collective: fx.Node) -> str:
    origin = innermost_module(collective)
    if origin is None and BUCKET in collective.meta:  # several parameters' all-reduce, bucketed
        return f"{collective.meta[BUCKET]}.*"
    return _PARAM_PATH.sub(r".\1", origin[0]) if origin is not None else "-"


def render_gift_graph(graph: fx.Graph) -> str:
    """The landmarks of ``graph`` in order, one ``<owner>  <landmark>`` line each (module docstring)."""
    nodes = list(graph.nodes)
    grad_mms = _gradient_mms(nodes)
    owners = {**_downstream_layer(nodes), **_collective_owners(nodes, grad_mms)}
    # Weight gradients still sent by their original collective (a graph before the pass, or a
    # layer the pass leaves alone): the pass's own matcher says which mm computed them.
    for found in find_gradient_collectives(graph):
        if found.mm is not None and found.fqn is not None:
            grad_mms.setdefault(found.mm, found.fqn)
    groups = _Groups()
    original: dict[fx.Node, str] = {}  # collective the pass left alone -> parameter name
    rows: list[list[str]] = []  # [owner, text, note]
    row_of: dict[fx.Node, int] = {}  # collective -> its row
    seen_forward = in_backward = False
    for node in nodes:
        if node.op != "call_function":
            continue
        if seen_forward and not in_backward and node.meta.get("autograd_backward"):
            in_backward = True
            rows.append(["", "-- backward --", ""])
        if _is_gift(node):
            rows.append([_fqn(node) or owners.get(node, "-"), _gift_line(node, groups), ""])
        elif _is_collective(node):
            row_of[node] = len(rows)
            if node in owners:
                rows.append([owners[node], _collective_line(node, groups), ""])
            else:
                original[node] = _parameter_name(node)
                rows.append([original[node], _collective_line(node, groups), "original"])
        elif node.target is _WAIT:
            waited = node.args[0]
            if row_of.get(waited) == len(rows) - 1:  # no other landmark in between: waited at once
                rows[-1][1] += " -> wait"
                continue
            owner = owners.get(waited, original.get(waited, "-"))
            rows.append([owner, f"wait_tensor({_kind(waited) if isinstance(waited, fx.Node) and _namespace(waited) else '?'})", ""])
        elif node in grad_mms:
            rows.append([grad_mms[node], f"mm -> grad {_tensor_type(node.meta.get('val'))}", ""])
        elif node.target in _MATMULS and not in_backward and not node.meta.get("autograd_backward"):
            origin = innermost_module(node)  # None for what the pass inserted (no module metadata)
            if origin is not None:
                seen_forward = True
                rows.append([origin[0], f"linear (forward) -> {_tensor_type(node.meta.get('val'))}", ""])
    width = max((len(owner) for owner, _, _ in rows), default=0)
    lines = []
    for owner, text, note in rows:
        text = f"{text}  ({note})" if note else text
        lines.append(f"{owner:<{width}}  {text}" if owner else text)
    return "\n".join(lines)
