"""GIFT pass: send gradients through FP8 or FP4 (Linear weights whitened when selected).

Finds every gradient collective in a traced graph and replaces it as ``policy.plan`` says:
an ``nn.Linear`` weight gradient takes the GIFT path (selected layers) or the Euclidean
low-precision path (other Linear layers); another 2-D gradient whose module is known (the
token embedding) the Euclidean path on ``embedding_dtype``. Everything else (biases, norms,
wires equal to the collective's own: fp32) keeps its original collective, untouched.

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
            (a layer that reads the same X as an earlier one, such as k and v after q, has no sk
            of its own: it takes that layer's T, T^-1, Q'; ``layer_step`` says why that is exact)
    gift.meter(ns, fqn, mm, T, tok)      # T: for the GIFT shadow on the fallback (meter.py)
    R     = gift.load_residual(ns, fqn, d_out, d_in, tok)
    V     = (mm + R) @ T          -> amax, scale, clamp, cast to fp8, view uint8
    msg   = all_to_all_single(payload | scales) ; wait_tensor
    S     = sum_senders(decode(msg))          [all-reduce: + owner residual, re-encode, all_gather_into_tensor, decode]
    grad  = S @ T^-1
    gift.end_step(ns, fqn, group, tok, (V - decode(payload)) @ T^-1, R2', Q', stats, bytes, stats_bytes)

Identity relied on: input-side whitening right-multiplies, so it acts on each row alone and
commutes with the dim-0 split of a reduce-scatter; and ``sum_r (G_r T) T^-1 = sum_r G_r``
exactly, so only the wire's rounding separates the result from the plain collective.
Other Linear layers get ``comm.quantized_reduce`` without whitening (with ``euclidean_error_feedback``,
through the same two halves with a residual and no statistics).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch._inductor.pattern_matcher import stable_topological_sort

from gift_compile import policy
from gift_compile.agreement import describe
from gift_compile.comm import euclidean_reduce
from gift_compile.config import GiftConfig
from gift_compile.geometry import Whitening
from gift_compile.layer_step import CurrentFactors, LayerPlan, current_factors, gradient_factors, issue_statistics, reduce_layer
from gift_compile.ops import OpsAccess, agree_first, record_euclidean_step
from gift_compile.passes.bucketing import ALL_GATHER, ALL_TO_ALL, BUCKET, bucket_gradient_collectives
from gift_compile.passes.graph_utils import call_arguments, innermost_module, is_linear_type, splice_traced, waited_once
from gift_compile.passes.overlap import GRADIENT_COMM, GRADIENT_STATISTICS, STATISTICS, mark_gradient_collectives
from gift_compile.passes.time_meter import CODEC
from gift_compile.policy import ParamKind, Plan

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
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
FACTORIZATION = torch.ops.gift.whitening_from_sketches.default


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
            if not waited_once(node):
                continue
            kwargs = call_arguments(node)
            mm = weight_gradient_mm(kwargs["input"])
            fqn = None
            if mm is not None:
                origin = innermost_module(mm)
                if origin is not None and (origin[1] is None or is_linear_type(origin[1])):
                    fqn = origin[0]
            found.append(GradientCollective(node, next(iter(node.users)), collective_type, kwargs["reduce_op"], kwargs["group_name"], mm, fqn))
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
    """What the pass does with one gradient collective: its ``policy.Plan``."""

    found: GradientCollective
    plan: Plan

    def describe(self) -> tuple[str, str]:
        """``(layer, what travels)``: this rank's entry of the ranks' agreement (agreement.py)."""
        shape = tuple(self.found.collective.args[0].meta["val"].shape)
        return self.found.fqn, self.plan.describe(shape, self.found.collective_type, self.found.op, world_size(self.found))


def parameter_kind(found: GradientCollective) -> tuple[ParamKind, str] | None:
    """``(policy kind, counters name)`` of a gradient collective; None when a 2-D gradient cannot
    be attributed (it keeps its original reduction)."""
    if found.fqn is not None:
        return "linear", found.fqn
    value = found.collective.args[0]
    if found.mm is not None or value.meta["val"].dim() != 2:
        return None if found.mm is not None else ("vector", value.name)
    origin = innermost_module(value)
    if origin is None or is_linear_type(origin[1]):
        return None
    return "matrix", origin[0]


def plan_rewrites(graph: fx.Graph, config: GiftConfig, selected: frozenset[str]) -> list[Rewrite]:
    """Which gradient collectives of ``graph`` the pass rewrites, and how (``policy.plan``).

    ``selected`` are the Linear FQNs sent in whitened coordinates. A weight-gradient ``mm``
    that cannot be attributed to a Linear layer keeps its original, full-precision reduction
    (warned), as does any plan whose wire is the collective's own (``unchanged``, fp32).
    """
    rewrites, skipped = [], []
    uses: Counter[str] = Counter()
    for found in find_gradient_collectives(graph):
        kind = parameter_kind(found)
        if kind is None:
            skipped += [found.collective.name] if found.mm is not None else []
            continue
        kind, name = kind
        plan = policy.plan(config, kind, selected=name in selected, collective=found.collective_type)
        if plan.kind == "unchanged" or (plan.kind == "euclidean" and plan.wire.dtype == "fp32"):
            continue  # that is the collective as traced
        # A layer used twice in one forward has one collective per use (replicate() reduces each
        # use's part of the gradient): each keeps its own state, keyed "fqn#2", "fqn#3", ...
        uses[name] += 1
        rewrites.append(Rewrite(dataclasses.replace(found, fqn=name if uses[name] == 1 else f"{name}#{uses[name]}"), plan))
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
        before = set(graph.nodes)
        shared: dict[tuple, list[fx.Node]] = {}
        factorizations: list[list[fx.Node]] = []
        for rewrite in rewrites:
            present = set(graph.nodes)
            if rewrite.plan.stateful:
                rewrite_stateful(graph, rewrite, config, namespace, agreed, shared, factorizations)
            else:
                rewrite_euclidean(graph, rewrite, namespace, agreed)
            for node in graph.nodes:
                if node not in present and node.target in (ALL_TO_ALL, ALL_GATHER):
                    node.meta[BUCKET] = bucket_of(rewrite.found.fqn)
        batch_statistics(graph)
        if config.bucket:
            batch_gradient_statistics(graph)
        gather_factorizations(graph, factorizations)
        batch_factorizations(graph)
        if config.bucket:
            bucket_left_alone(graph, before)
            bucket_gradient_collectives(graph)
        added = [n for n in graph.nodes if n not in before]
        mark_gradient_collectives(added)  # for the overlap scheduler
        for node in added:
            node.meta[CODEC] = True  # for the time meter (timing.py)
    graph.lint()


def gather_factorizations(graph: fx.Graph, factorizations: list[list[fx.Node]]) -> None:
    """Run the step's factorizations back to back, before the first of them is needed.

    Each one sits where its layer's reduction needs it, which in a backward is right after the
    layer's weight-gradient GEMM; on the project's CPU the small ops right after a long GEMM run
    2-3x slower than after other small ops (``benchmarks/codec_profile.py``: 0.8-0.9 ms a
    factorization in the main job, 0.35 ms back to back), and a factorization is ~40 of them.
    Their inputs (the summed sketches, issued in a joint graph's forward or at the start of a
    backward graph) exist before the first of them is needed, so each moves to just before the
    earliest consumer of any of them, in its own order; one whose inputs are not all there yet (a
    sketch recomputed later in the backward) stays where it is. The same ops on the same values:
    only when they run changes."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups = [[n for n in group if n in order] for group in factorizations]  # batch_statistics replaced the waits
    groups = [sorted(group, key=order.__getitem__) for group in groups if group]
    if len(groups) < 2:
        return
    consumers = [u for group in groups for n in group for u in n.users if u not in group]
    target = min(consumers, key=order.__getitem__)
    for group in sorted(groups, key=lambda g: order[g[0]]):
        members = set(group)
        inputs = [a for n in group for a in n.all_input_nodes if a not in members]
        if all(order[a] < order[target] for a in inputs):
            for node in group:
                target.prepend(node)


def batch_factorizations(graph: fx.Graph) -> None:
    """One factorization op for the layers whose factors can be computed together: those whose
    sketches were summed in one all-reduce (a bucket's gradient sketches,
    :func:`batch_gradient_statistics`, as ``layer_step.gradient_factors`` batches them eagerly; a
    block's input sketches, :func:`batch_statistics`). A factorization joins the batch of an
    earlier one with the same basis shape and method when its inputs exist where that one runs,
    up to view and dtype glue (which moves there), so no layer waits longer for its factors; one
    that waits for a sum of its own keeps its own call. A batch pays its ops' fixed costs once and
    computes each layer's factors as it would alone (``geometry.whitening_from_sketches``)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    open_batches: dict[tuple, list[fx.Node]] = {}
    batches: list[list[fx.Node]] = []
    for node in sorted(graph.find_nodes(op="call_function", target=FACTORIZATION), key=order.__getitem__):
        args = call_arguments(node)
        key = (args["nystrom"], *(tuple(basis.meta["val"].shape) for basis in args["bases"]))
        batch = open_batches.get(key)
        if batch is not None and all(_exists_at(a, batch[0], order) for a in node.all_input_nodes):
            batch.append(node)
        else:
            open_batches[key] = batch = [node]
            batches.append(batch)
    for batch in batches:
        if len(batch) > 1:
            _merge_factorizations(graph, batch, {node: i for i, node in enumerate(graph.nodes)})


def _exists_at(node: fx.Node, first: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether ``node`` runs before ``first``, or is view or dtype glue on nodes that do."""
    if order[node] < order[first]:
        return True
    return (node.target in _SAME_SHAPE or node.target is operator.getitem) and all(
        _exists_at(a, first, order) for a in node.all_input_nodes)


def _merge_factorizations(graph: fx.Graph, batch: list[fx.Node], order: dict[fx.Node, int]) -> None:
    """Replace ``batch`` by one call where its first member runs: the later members' glue inputs
    (:func:`_exists_at`) move before it, and each member's ``getitem`` users read their outputs
    from the merged call's flat list (4 per layer, in batch order)."""
    first = batch[0]
    glue, stack = set(), [a for node in batch[1:] for a in node.all_input_nodes]
    while stack:
        node = stack.pop()
        if order[node] > order[first] and node not in glue:
            glue.add(node)
            stack.extend(node.all_input_nodes)
    for node in sorted(glue, key=order.__getitem__):
        first.prepend(node)
    calls = [call_arguments(node) for node in batch]
    lists = [[t for call in calls for t in call[name]] for name in ("sketches", "bases", "scales", "dampings")]
    with graph.inserting_before(first):
        merged = graph.call_function(FACTORIZATION, (*lists, calls[0]["nystrom"]))
    # the first call's metadata, less its eager input values (Inductor matches the inputs' strides to them)
    merged.meta.update({key: value for key, value in first.meta.items() if key != "eager_input_vals"})
    merged.meta["val"] = [value for node in batch for value in node.meta["val"]]
    offset = 0
    for node in batch:
        for user in list(node.users):  # getitem(node, i): the layer's i-th output
            user.args = (merged, offset + user.args[1])
        offset += len(node.meta["val"])
        graph.erase_node(node)


def bucket_left_alone(graph: fx.Graph, original: set[fx.Node]) -> None:
    """The gradient all-reduces the pass left as they are (in ``original``: on the all-reduce
    route the norm weights' and biases', and any Linear weight left in fp32) go one per block:
    all of a block's in one all-reduce of their concatenation, which sums each element as alone."""
    for node in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        origin = innermost_module(node) or innermost_module(node.args[0])  # graph_trainer: on the gradient only
        if node in original and node.meta.get(GRADIENT_COMM) and origin is not None and block_of(origin[0]):
            node.meta[BUCKET] = block_of(origin[0])


def block_of(fqn: str) -> str:
    """The block a layer belongs to: its FQN up to the first numeric component (``layers.3``), or
    ``""`` when it has none (one block for the whole graph)."""
    parts = fqn.split(".")
    return next((".".join(parts[: i + 1]) for i, part in enumerate(parts) if part.isdigit()), "")


def bucket_of(fqn: str) -> str:
    """The bucket a layer's quantized gradient travels in (``passes/bucketing.py``): the child of
    its block that holds it (``layers.3.attention`` for ``layers.3.attention.qkv_linear.wqkv`` and
    ``layers.3.attention.wo``; ``layers.3.feed_forward`` for ``w1``, ``w2``, ``w3``), the block
    itself for a layer directly in it, and the layer alone outside any block (the output
    projection, the embedding)."""
    block = block_of(fqn)
    if not block:
        return fqn
    child = fqn[len(block) + 1:].split(".")
    return f"{block}.{child[0]}" if len(child) > 1 else block


def batch_statistics(graph: fx.Graph) -> None:
    """One statistics all-reduce per block and group instead of one per layer: the sketches of a
    block's layers are concatenated and summed together, right after the last of them exists
    (in a joint graph, still during the forward), and each layer reads its slice after the
    wait. A sum is elementwise, so every layer's summed sketch is the same as alone. A sketch
    that only exists after another layer of the block needs its sum (an input recomputed in
    the backward, such as the attention output ``wo`` reads) starts a new batch."""
    blocks: dict[tuple, list[fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        if STATISTICS in node.meta:
            blocks.setdefault((node.meta[STATISTICS], node.args[2]), []).append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for (block, group_name), reduces in blocks.items():
        batches: list[list[fx.Node]] = []
        for reduce in sorted(reduces, key=lambda r: order[r.args[0]]):
            if batches and order[reduce.args[0]] < min(order[next(iter(r.users))] for r in batches[-1]):
                batches[-1].append(reduce)  # its sketch exists before any of the batch's sums is waited on
            else:
                batches.append([reduce])
        for batch in batches:
            if len(batch) > 1:
                _batch(graph, batch, block, group_name)


def batch_gradient_statistics(graph: fx.Graph) -> None:
    """One gradient-statistics all-reduce per bucket and group instead of one per layer: a
    bucket's quantized gradients travel together once its last gradient is encoded
    (``passes/bucketing.py``), so their sketches can be summed together once the last exists.
    Each layer's factors, meter and encoding move after the batch's wait (a stable topological
    sort). A sketch that depends on another layer's sum starts a new batch; none does in a
    backward, where the weight gradients feed only their own reductions. With ``bucket`` off
    each layer keeps its own all-reduce."""
    buckets: dict[tuple, list[fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        if GRADIENT_STATISTICS in node.meta:
            buckets.setdefault((node.meta[GRADIENT_STATISTICS], node.args[2]), []).append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    batched = False
    for (bucket, group_name), reduces in buckets.items():
        batches: list[list[fx.Node]] = []
        for reduce in sorted(reduces, key=lambda r: order[r.args[0]]):
            if batches and not _depends_on(reduce.args[0], {next(iter(r.users)) for r in batches[-1]}):
                batches[-1].append(reduce)
            else:
                batches.append([reduce])
        for batch in batches:
            if len(batch) > 1:
                _batch(graph, batch, bucket, group_name, key=GRADIENT_STATISTICS)
                batched = True
    if batched:
        stable_topological_sort(graph)


def _depends_on(node: fx.Node, sources: set[fx.Node]) -> bool:
    """Whether ``node`` reads any of ``sources``, directly or through its inputs."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in sources:
            return True
        for dep in current.all_input_nodes:
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return False


def _batch(graph: fx.Graph, reduces: list[fx.Node], block: str, group_name: str, key: str = STATISTICS) -> None:
    sketches = [r.args[0] for r in reduces]
    sizes = [s.meta["val"].numel() for s in sketches]

    def summed(*parts):
        whole = c10d.wait_tensor(c10d.all_reduce(torch.cat(parts), "sum", group_name))
        return list(torch.split(whole, sizes))

    slices = splice_traced(graph, summed, sketches, after=sketches[-1])
    for node in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        if node.args[0].target is torch.ops.aten.cat.default and node.args[0].args[0] == sketches:
            node.meta[key] = block  # the batch's one statistics all-reduce
    for reduce, piece in zip(reduces, slices):
        (wait,) = reduce.users
        wait.replace_all_uses_with(piece)
        graph.erase_node(wait)
        graph.erase_node(reduce)


def gift_collectives_pass(graph: fx.Graph, config: GiftConfig, namespace: str, selected: frozenset[str]) -> list[GradientCollective]:
    """Rewrite the gradient collectives of ``graph`` in place; returns those rewritten."""
    found = find_gradient_collectives(graph)
    rewrites = plan_rewrites(graph, config, selected)
    mark_gradient_collectives(g.collective for g in found)  # those left as they are move too
    apply_rewrites(graph, rewrites, config, namespace)
    return [r.found for r in rewrites]


def _replace(graph: fx.Graph, found: GradientCollective, fn, args: list[fx.Node]) -> None:
    result = splice_traced(graph, fn, args, before=found.wait)
    found.wait.replace_all_uses_with(result)
    graph.erase_node(found.wait)
    graph.erase_node(found.collective)


def rewrite_stateful(
    graph: fx.Graph, rewrite: Rewrite, config: GiftConfig, namespace: str, agreed: fx.Node, shared: dict[tuple, list[fx.Node]],
    factorizations: list[list[fx.Node]],
) -> None:
    """Replace a Linear weight-gradient collective by the two halves of ``layer_step``: the
    statistics right after the layer's input exists (and after the agreement), the factors and
    the reduction where the collective was. ``shared``: the factors of each input sketched so
    far (by :func:`input_key`); a layer that reads one of them takes those (``layer_step``).
    ``factorizations``: each computation of factors this adds, as its nodes (for
    :func:`gather_factorizations`)."""
    found = rewrite.found
    d_out, d_in = found.mm.meta["val"].shape
    plan = LayerPlan(found.fqn, d_out, d_in, rewrite.plan, found.collective_type, found.op, found.group_name, config)
    layer_input = found.mm.args[1]
    key = (*input_key(layer_input), found.group_name)
    factors = shared.get(key) if plan.may_share_statistics else None
    if factors is not None:
        plan = dataclasses.replace(plan, shares_statistics=True)
    access = OpsAccess(namespace)
    anchor = agreed if layer_input.op == "placeholder" else layer_input  # the agreement is the first computation
    token, *statistics = splice_traced(graph, lambda x, ok: issue_statistics(plan, access, x, ok), [layer_input, agreed],
                                       after=anchor)
    if statistics[0] is not None:  # this layer sketches its input: the factors, computed once, before its reduction
        statistics[0].meta[STATISTICS] = block_of(found.fqn)  # the sketch's all_reduce: batched per block below
        present = set(graph.nodes)
        factors = splice_traced(graph, lambda *s: flat_factors(current_factors(*s)), statistics, before=found.wait)
        factorizations.append([n for n in graph.nodes if n not in present])
        if plan.may_share_statistics:
            shared[key] = factors
    elif plan.gradient_statistics:  # from the gradient, where its reduction was (batch_gradient_statistics)
        grad = found.collective.args[0]
        present = set(graph.nodes)
        factors = splice_traced(graph, lambda g, t: flat_factors(gradient_factors([(plan, access, g, t)])[0]), [grad, token],
                                before=found.wait)
        (reduce,) = [n for n in graph.nodes if n not in present and n.target is c10d.all_reduce.default]
        reduce.meta[GRADIENT_STATISTICS] = bucket_of(found.fqn)

    if factors is None:  # periodic factors, or no whitening: the token only
        def late(grad, token):
            return reduce_layer(plan, access, grad, token, None)
    else:
        def late(grad, token, *flat):
            return reduce_layer(plan, access, grad, token, unflat_factors(list(flat)))

    _replace(graph, found, late, [found.collective.args[0], token, *(factors or [])])


def input_key(node: fx.Node) -> tuple[fx.Node, tuple[int, ...]]:
    """What a weight-gradient ``mm`` reads as the layer's input: the node under its view glue,
    and the shape read. Views and reshapes keep the row-major order of the elements, so two
    layers with the same key read the same values."""
    shape = tuple(node.meta["val"].shape)
    while node.target in _VIEWS:
        node = node.args[0]
    return node, shape


def flat_factors(factors: CurrentFactors) -> list[torch.Tensor]:
    whitening, next_basis, next_scale = factors
    return [*whitening.tensors.values(), next_basis, next_scale]


def unflat_factors(flat: list[torch.Tensor]) -> CurrentFactors:
    return Whitening.from_list("lowrank", flat[:-2]), flat[-2], flat[-1]


def rewrite_euclidean(graph: fx.Graph, rewrite: Rewrite, namespace: str, agreed: fx.Node) -> None:
    """Replace one gradient collective by its stateless plan (a Linear weight on
    ``euclidean_dtype``, another 2-D gradient on ``embedding_dtype``), counted under its name."""
    found, plan = rewrite.found, rewrite.plan
    shape = tuple(found.collective.args[0].meta["val"].shape)
    nbytes = plan.bytes_sent(shape, world_size(found), found.collective_type)
    group = _resolve_process_group(found.group_name)

    def replacement(grad, ok):
        # grad * ok (ok = 1.0, exact for every value) orders this collective after the agreement
        reduction = euclidean_reduce(grad * ok, op=found.op, group=group, wire=plan.wire, collective=found.collective_type,
                                     gather_dtype=plan.gather_dtype)
        record_euclidean_step(namespace, found.fqn, plan.path, reduction.stats, nbytes)
        return reduction.output

    _replace(graph, found, replacement, [found.collective.args[0], agreed])


def world_size(found: GradientCollective) -> int:
    return torch.distributed.get_world_size(_resolve_process_group(found.group_name))
