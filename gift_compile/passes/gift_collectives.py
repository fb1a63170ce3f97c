"""GIFT pass: send Linear weight gradients through FP8 (whitened for selected layers).

Finds every gradient collective in a traced graph whose input is an ``nn.Linear`` weight
gradient and replaces it with the GIFT path (selected layers) or the Euclidean low-precision
path (other Linear layers). Everything else (biases, norms, embeddings, Linear layers when
``euclidean_dtype == "fp32"``) keeps its original collective, untouched.

Before (one Linear weight gradient, post-grad backward graph)::

    X     = <the layer's input: a saved activation, or a forward node in a joint graph>
    ...
    mm    = aten.mm(permute(grad_out), X)                      # (d_out, d_in)
    [permute; permute | view | _to_copy | div by world size]   # identity-shaped glue
    red   = _c10d_functional.all_reduce(mm, "avg", group)       # or reduce_scatter_tensor(mm, "sum", W, group)
    grad  = _c10d_functional.wait_tensor(red)

After (selected layer; the two halves are ``layer_step.issue_statistics`` and
``layer_step.reduce_layer`` traced into post-grad ATen)::

    ok    = gift.agree(ns, groups, description, ...)                # first: the ranks agree (agreement.py)
    X     = ...
    tok   = gift.begin_step(ns, fqn, group, d_out, d_in, True, X, ok)   # right after X exists
    Q     = gift.load_basis(ns, fqn, d_in, r, tok)
    sk    = cat(X^T (X Q), sum X^2, tokens) -> _c10d_functional.all_reduce(sk, "sum", group)   # no wait yet
    ...   (the rest of the forward / backward runs while the sketch travels)
    mm    = aten.mm(permute(grad_out), X)
    sk    = wait_tensor(sk) -> Rayleigh-Ritz (eigh r x r), qr -> T, T^-1 (low rank), Q'
    gift.meter(ns, fqn, mm, tok)
    R     = gift.load_residual(ns, fqn, d_out, d_in, tok)
    V     = (mm + R) @ T          -> amax, scale, clamp, cast to fp8, view uint8
    msg   = all_to_all_single(payload | scales) ; wait_tensor
    S     = sum_senders(decode(msg))          [all-reduce: + owner residual, re-encode, all_gather_into_tensor, decode]
    grad  = S @ T^-1
    gift.end_step(ns, fqn, group, tok, (V - decode(payload)) @ T^-1, R2', Q', stats, bytes, stats_bytes)

Identity relied on: input-side whitening right-multiplies, so it acts on each row alone and
commutes with the dim-0 split of a reduce-scatter; and ``sum_r (G_r T) T^-1 = sum_r G_r``
exactly, so only FP8 rounding separates the result from the plain collective.
Other Linear layers get ``comm.fp8_reduce`` without whitening (with ``euclidean_error_feedback``,
through the same two halves with a residual and no statistics).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.operator_schemas import normalize_function

from gift_compile.agreement import describe
from gift_compile.collectives import WireFormat, bytes_sent
from gift_compile.comm import euclidean_reduce
from gift_compile.config import GiftConfig
from gift_compile.layer_step import LayerPlan, issue_statistics, reduce_layer
from gift_compile.ops import OpsAccess, agree_first, record_euclidean_step
from gift_compile.passes.graph_utils import innermost_module, is_linear_type, splice_traced

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

COLLECTIVES = {c10d.all_reduce.default: "all_reduce", c10d.reduce_scatter_tensor.default: "reduce_scatter"}
WAIT = c10d.wait_tensor.default
# Ops allowed between the weight-gradient mm and the collective: they keep the values of a
# 2-D gradient (up to a transpose, tracked below, or a scalar factor that commutes with T).
_TRANSPOSES = {aten.permute.default, aten.t.default}
_SAME_SHAPE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten._to_copy.default,
               aten.clone.default, torch.ops.prims.convert_element_type.default}
_SCALAR_SCALE = {aten.div.Tensor, aten.mul.Tensor}


@dataclass(frozen=True)
class GradientCollective:
    """A gradient collective and, if it reduces a Linear weight gradient, where that came from."""

    collective: fx.Node
    wait: fx.Node
    collective_type: str  # "all_reduce" | "reduce_scatter"
    op: str  # "sum" | "avg"
    group_name: str
    mm: fx.Node | None  # the weight-gradient mm, if found
    fqn: str | None  # the Linear layer's FQN, if known


def find_gradient_collectives(graph: fx.Graph) -> list[GradientCollective]:
    found = []
    for target, collective_type in COLLECTIVES.items():
        for node in graph.find_nodes(op="call_function", target=target):
            kwargs = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
            waits = [u for u in node.users if u.target is WAIT]
            if len(waits) != 1 or len(node.users) != 1:
                continue
            mm = weight_gradient_mm(kwargs["input"])
            fqn = None
            if mm is not None:
                origin = innermost_module(mm)
                if origin is not None and (origin[1] is None or is_linear_type(origin[1])):
                    fqn = origin[0]
            found.append(GradientCollective(node, waits[0], collective_type, kwargs["reduce_op"], kwargs["group_name"], mm, fqn))
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(found, key=lambda g: order[g.collective])


def weight_gradient_mm(node: fx.Node) -> fx.Node | None:
    """Walk back from a collective's input to an ``mm`` through value-preserving glue."""
    transposed = False
    shape = _shape(node)
    if shape is None or len(shape) != 2:
        return None
    while node.target is not aten.mm.default:
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        if node.target in _TRANSPOSES:
            transposed = not transposed
        elif node.target in _SCALAR_SCALE:
            if isinstance(node.args[1], fx.Node):
                return None
        elif node.target in _SAME_SHAPE:
            if _shape(node.args[0]) not in (shape, shape[::-1]):
                return None
        else:
            return None
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    if transposed or _shape(node) != shape:
        return None
    return node


def _shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


@dataclass(frozen=True)
class Rewrite:
    """What the pass does with one gradient collective."""

    found: GradientCollective
    kind: str
    """``gift`` (whitened), ``euclidean+ef`` (Euclidean FP8 with a residual) or ``euclidean`` (stateless)."""
    config: GiftConfig
    """The config of this collective's path (an integration's embedding path has its own ``euclidean_dtype``)."""

    def describe(self) -> tuple[str, str]:
        """``(layer, what travels)``: this rank's entry of the ranks' agreement (agreement.py)."""
        shape = list(self.found.collective.args[0].meta["val"].shape)
        wire = self.config.euclidean_dtype if self.kind == "euclidean" else "fp8"
        return self.found.fqn, f"{self.kind} {wire} {self.found.collective_type}({self.found.op}) {shape} x{world_size(self.found)}"


def plan_rewrites(graph: fx.Graph, config: GiftConfig, selected: frozenset[str]) -> list[Rewrite]:
    """Which Linear weight-gradient collectives of ``graph`` the pass rewrites, and how.

    ``selected`` are the FQNs sent in whitened coordinates. Collectives that cannot be
    attributed to a Linear layer keep their original, full-precision reduction (warned).
    """
    rewrites, skipped = [], []
    uses: Counter[str] = Counter()
    for found in find_gradient_collectives(graph):
        if found.fqn is None:
            if found.mm is not None:
                skipped.append(found.collective.name)
            continue
        # A layer used twice in one forward has one collective per use (replicate() reduces each
        # use's part of the gradient): each keeps its own state, keyed "fqn#2", "fqn#3", ...
        uses[found.fqn] += 1
        layer = found.fqn
        if uses[layer] > 1:
            found = dataclasses.replace(found, fqn=f"{layer}#{uses[layer]}")
        if layer in selected:
            rewrites.append(Rewrite(found, "gift", config))
        elif config.euclidean_dtype == "fp8" and config.euclidean_error_feedback:
            rewrites.append(Rewrite(found, "euclidean+ef", config))
        elif config.euclidean_dtype != "fp32":
            rewrites.append(Rewrite(found, "euclidean", config))
    if skipped:
        log.warning(
            "GIFT: %d weight-gradient collective(s) could not be attributed to a Linear layer and keep "
            "their full-precision reduction: %s", len(skipped), skipped,
        )
    return rewrites


def apply_rewrites(graph: fx.Graph, rewrites: list[Rewrite], config: GiftConfig, namespace: str) -> None:
    """Rewrite ``graph`` in place: first ``gift::agree`` (the ranks compare what they are about to
    send, agreement.py), then every collective of ``rewrites``, each ordered after it."""
    if rewrites:
        description = describe(config, [r.describe() for r in rewrites])
        groups = list(dict.fromkeys(r.found.group_name for r in rewrites))
        like = next(n for n in graph.find_nodes(op="placeholder") if isinstance(n.meta.get("val"), torch.Tensor))
        agreed = splice_traced(graph, lambda x: agree_first(namespace, groups, description, x), [like], after=like)
        for rewrite in rewrites:
            if rewrite.kind == "euclidean":
                rewrite_euclidean(graph, rewrite.found, rewrite.config, namespace, agreed)
            else:
                rewrite_stateful(graph, rewrite.found, rewrite.config, namespace, agreed, whitened=rewrite.kind == "gift")
    graph.lint()


def gift_collectives_pass(graph: fx.Graph, config: GiftConfig, namespace: str, selected: frozenset[str]) -> list[GradientCollective]:
    """Rewrite the Linear weight-gradient collectives of ``graph`` in place; returns those rewritten."""
    rewrites = plan_rewrites(graph, config, selected)
    apply_rewrites(graph, rewrites, config, namespace)
    return [r.found for r in rewrites]


def _replace(graph: fx.Graph, found: GradientCollective, fn, args: list[fx.Node]) -> None:
    result = splice_traced(graph, fn, args, before=found.wait)
    found.wait.replace_all_uses_with(result)
    graph.erase_node(found.wait)
    graph.erase_node(found.collective)


def rewrite_stateful(
    graph: fx.Graph, found: GradientCollective, config: GiftConfig, namespace: str, agreed: fx.Node, *, whitened: bool
) -> None:
    """Replace a Linear weight-gradient collective by the two halves of ``layer_step``: the
    statistics right after the layer's input exists (and after the agreement), the reduction
    where the collective was."""
    d_out, d_in = found.mm.meta["val"].shape
    plan = LayerPlan(found.fqn, d_out, d_in, whitened, found.collective_type, found.op, found.group_name, config)
    access = OpsAccess(namespace)
    layer_input = found.mm.args[1]
    anchor = agreed if layer_input.op == "placeholder" else layer_input  # the agreement is the first computation
    early = splice_traced(graph, lambda x, ok: issue_statistics(plan, access, x, ok), [layer_input, agreed], after=anchor)
    early = [n for n in early if n is not None]

    if len(early) == 4:  # current-step factors: (token, summed sketch, basis, sketch scale)
        def late(grad, token, sketch, basis, scale):
            return reduce_layer(plan, access, grad, token, sketch, basis, scale)
    else:  # periodic factors, or no whitening: the token only
        def late(grad, token):
            return reduce_layer(plan, access, grad, token, None, None, None)

    _replace(graph, found, late, [found.collective.args[0], *early])


def rewrite_euclidean(graph: fx.Graph, found: GradientCollective, config: GiftConfig, namespace: str, agreed: fx.Node) -> None:
    """Replace one gradient collective by the stateless Euclidean ``config.euclidean_dtype`` path,
    counted under ``found.fqn`` (also used by integrations for non-Linear 2-D gradients)."""
    wire = WireFormat.euclidean(config)
    shape = tuple(found.collective.args[0].meta["val"].shape)
    nbytes = bytes_sent(shape, world_size(found), wire, found.collective_type, config.all_gather_dtype)
    group = _resolve_process_group(found.group_name)

    def replacement(grad, ok):
        # grad * ok (ok = 1.0, exact for every value) orders this collective after the agreement
        reduction = euclidean_reduce(grad * ok, op=found.op, group=group, wire=wire, collective=found.collective_type,
                                     gather_dtype=config.all_gather_dtype)
        record_euclidean_step(namespace, found.fqn, config.euclidean_dtype, reduction.stats, nbytes)
        return reduction.output

    _replace(graph, found, replacement, [found.collective.args[0], agreed])


def world_size(found: GradientCollective) -> int:
    return torch.distributed.get_world_size(_resolve_process_group(found.group_name))
