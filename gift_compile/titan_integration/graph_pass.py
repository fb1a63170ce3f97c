"""The ``gift`` pass pipeline for torchtitan's graph_trainer (``--compile.pass_pipeline gift``).

graph_trainer traces forward + loss + backward into one joint FX graph with ``make_fx`` and
then runs a list of passes on it. With SimpleFSDP every parameter's gradient leaves through
its own collective, which is what ``gift_collectives_pass`` rewrites::

    fully_shard:  mm(t(dY), X) -> t -> t -> view -> reduce_scatter_tensor(., 'sum', W, g) -> wait_tensor
    replicate:    mm(t(dY), X) -> t -> t -> view -> all_reduce(., 'sum', g)                -> wait_tensor
    HSDP:         both, one per mesh dimension

``meta['custom']['module_fqn']`` on the ``mm`` names the Linear layer. The pipeline puts
:func:`gift_joint_graph_pass` *before* torchtitan's default passes, so it sees the raw traced
graph and every later pass (dead-code elimination, memory policy, regional Inductor) sees the
rewritten one. The pass:

1. plans the rewrites of ``gift_collectives`` (``policy.plan``): the session's selected layers
   whitened, the other Linear weight gradients on ``euclidean_dtype``, the other 2-D
   gradients (the token embedding) on ``embedding_dtype``;
2. applies them all behind one agreement of the ranks;
3. records the bytes every gradient collective puts on the wire, for the metrics.

With ``[gift] enabled = false`` the pipeline is exactly ``construct_default_graph_passes``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import fx

from gift_compile.collectives import WireFormat, bytes_sent
from gift_compile.config import GiftConfig
from gift_compile.passes import gift_collectives as gc
from gift_compile.passes import time_meter
from gift_compile.passes.overlap import (
    collectives_of, mark_gradient_collectives, overlap_gradient_collectives, prefetched_all_gathers, statistics_on_own_group,
)
from gift_compile.passes.pieces import send_in_pieces
from gift_compile.runtime import get_runtime

log = logging.getLogger(__name__)

PIPELINE_NAME = "gift"
NAMESPACE = "titan"  # the GiftRuntime (runtime.py registry) the session and this pass share


@dataclass
class GraphAccounting:
    """Bytes one rank sends per step for the gradients of one traced graph."""

    fp32_bytes: int = 0
    """What every gradient collective of the graph would send in fp32 (the baseline)."""
    linear_fp32_bytes: int = 0
    """The same for the Linear weight gradients alone."""
    untouched_bytes: int = 0
    """What the collectives the pass left alone send (norm weights, fp32 paths)."""
    untouched_linear_bytes: int = 0
    """The part of it that is Linear weight gradients (fp32 paths: no counter records them)."""
    collectives: int = 0
    rewritten_gift: list[str] = field(default_factory=list)
    rewritten_euclidean: list[str] = field(default_factory=list)
    linear_candidates: list[str] = field(default_factory=list)
    numel: dict[str, int] = field(default_factory=dict)
    overlapped: int = 0
    """Gradient waits the overlap pass moved past a later gradient collective."""
    collective_calls: int = 0
    """Collectives the final graph issues per step (parameter all-gathers, gradients, statistics)."""
    collective_calls_traced: int = 0
    """The same in the graph as traced, before any pass (graph_trainer's bucketing merges many)."""


@dataclass
class PassContext:
    """What the pass needs from the trainer's GIFT session, looked up by namespace."""

    namespace: str
    config: GiftConfig
    selected: frozenset[str]
    compile_codec: bool = True
    """Tag the codec's arithmetic for regional Inductor (``compile_codec_regions``)."""
    accounting: GraphAccounting = field(default_factory=GraphAccounting)


def set_pass_context(context: PassContext) -> None:
    get_runtime(context.namespace).integration = context


def get_pass_context(namespace: str) -> PassContext:
    try:
        context = get_runtime(namespace).integration
    except RuntimeError:
        context = None
    if not isinstance(context, PassContext):
        raise RuntimeError(
            f"no GIFT session {namespace!r} in this process: the 'gift' pass pipeline needs the trainer "
            "from gift_compile.titan_integration (GiftGraphTrainer) with [gift] enabled = true"
        )
    return context


CODEC_REGION = "gift_codec"
"""The ``inductor_region`` of the codec's tagged nodes (``cut_codec_regions`` cuts them)."""
REGION_PREFIX = "__marked_inductor_submod"
"""The submodules torch's regional Inductor compiles are the ones named with this prefix."""


def compile_codec_regions(graph: fx.Graph) -> int:
    """Tag the codec's tensor arithmetic for graph_trainer's ``regional_inductor_pass``, which
    compiles tagged regions with Inductor (fused, bit for bit the eager numerics) while the rest
    of the joint graph runs as FX Python. Collectives, waits and ``gift::`` ops stay outside, so
    the overlap pass can still move them. :func:`cut_codec_regions` cuts the tagged nodes into
    regions before the pass runs. Returns the nodes tagged."""
    codec = [node for node in graph.nodes
             if node.meta.get(time_meter.CODEC) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
             and node.target.namespace in ("aten", "prims")]
    for node in codec:
        node.meta.setdefault("custom", {})["compile_with_inductor"] = {"inductor_region": CODEC_REGION}
    return len(codec)


def _layout(value) -> str:
    """What of a region's input its compile depends on (a tensor's shape, strides and dtype)."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.stride()} {value.dtype}"
    return repr(value)


def cut_codec_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Cut the codec's tagged nodes into the submodules regional Inductor compiles, before it
    does, in the way that keeps the communication overlapped and the compile cheap:

    - Pieces join only along their own edges (a node with its users), so a region never spans
      two layers' arithmetic that no edge joins (one layer's encode, or its decode with the
      next phase's encode, is one region or a few). Regional Inductor's own cut fuses every
      piece of one region name it can without a cycle, e.g. layer k's decode (after k's wait)
      with layer j's encode (before j's collective): the fused call runs after k's wait, so
      j's bytes could not leave before k's arrived and the communication would run serially
      after all. One partitioner pass for all pieces: one per region name cost
      O(regions x nodes), ~24 s on the debug model.
    - Each region's nodes are renamed ``n0, n1, ...`` in graph order, without stack traces.
      Inductor's caches key a graph by its code, names included: under the joint graph's
      names every region was a compile of its own (84 on the debug model), under canonical
      names the regions of same-shaped layers share one (106 regions, 16 distinct graphs,
      18 compiles), and more layers add cache hits.
    - The cut copies the tags onto the regions' outputs; they are removed, so regional
      Inductor finds nothing left to cut (its own regions, e.g. FlexAttention's, keep their
      tags) and compiles the submodules as they are."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    def is_codec(node: fx.Node) -> bool:
        tag = (node.meta.get("custom") or {}).get("compile_with_inductor")
        return isinstance(tag, dict) and tag.get("inductor_region") == CODEC_REGION

    support = create_op_support(lambda _modules, node: node.op == "call_function" and is_codec(node))
    partitions = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True,
                                            skip_horizontal_fusion=True).propose_partitions()
    if not partitions:
        return gm
    prefix = f"{REGION_PREFIX}_{CODEC_REGION}_"
    gm = fuse_by_partitions(gm, [p.nodes for p in partitions], prefix=prefix, always_return_tuple=True)
    graphs = set()  # what a region's compile depends on: its code and its inputs' layouts
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target.startswith(prefix):
            region = gm.get_submodule(node.target)
            for i, inner in enumerate(region.graph.nodes):  # two rounds: a new name may be an old one
                inner._rename(f"gift_tmp_{i}")
            for i, inner in enumerate(region.graph.nodes):
                inner._rename(f"n{i}")
                if inner.op == "placeholder":  # its target is the argument's name
                    inner.target = inner.name
                inner.meta.pop("stack_trace", None)
            region.recompile()
            graphs.add((region.code, *map(_layout, (x.meta.get("val") for x in node.all_input_nodes))))
        elif is_codec(node):  # a region's output: a new dict, the region's nodes share this one
            node.meta["custom"] = {k: v for k, v in node.meta["custom"].items() if k != "compile_with_inductor"}
    gm.recompile()
    log.info("GIFT codec regions: %d, %d distinct graphs to compile", len(partitions), len(graphs))
    return gm


def keep_codec_marks(regional_pass):
    """``regional_pass`` (graph_trainer's regional Inductor) run on the regions
    :func:`cut_codec_regions` cuts, such that the time meter still knows the codec: the
    compiled calls that replace GIFT's tagged arithmetic carry no meta of their own, so a new
    node is marked as codec when it reads from or feeds a codec node or a gradient wait
    (repeated until nothing changes: a region may feed another). A region of someone else's
    next to GIFT's would be counted as codec too; graph_trainer's own regions (FlexAttention)
    touch no gradient collective."""

    def run(gm: fx.GraphModule, *args, **kwargs) -> fx.GraphModule:
        before = {n.name for n in gm.graph.nodes}  # by name: the pass may rebuild the graph from copies
        gm = regional_pass(cut_codec_regions(gm), *args, **kwargs)
        waits = time_meter.gradient_waits(gm.graph)
        new = [n for n in gm.graph.nodes if n.name not in before and n.op in ("call_function", "call_module")]
        changed = True
        while changed:
            changed = False
            for node in new:
                if not node.meta.get(time_meter.CODEC) and any(
                        x.meta.get(time_meter.CODEC) or x in waits for x in (*node.all_input_nodes, *node.users)):
                    node.meta[time_meter.CODEC] = changed = True
        return gm

    run.__name__ = getattr(regional_pass, "func", regional_pass).__name__  # the pass keeps its name in graph_trainer's log
    return run


def _dense_wire(dtype: torch.dtype) -> WireFormat:
    return WireFormat("bf16" if dtype == torch.bfloat16 else "fp32")


def gift_joint_graph_pass(gm: fx.GraphModule, example_inputs=None, *, namespace: str) -> fx.GraphModule:
    """Rewrite the gradient collectives of graph_trainer's joint graph (module docstring)."""
    ctx = get_pass_context(namespace)
    graph = gm.graph
    found = gc.find_gradient_collectives(graph)
    if not found:  # one rank: nothing to communicate, so nothing to rewrite
        log.info("GIFT: the traced graph has no gradient collectives (one rank has nothing to communicate); it runs unchanged")
        ctx.accounting = GraphAccounting()
        return gm
    accounting = GraphAccounting(collectives=len(found))
    accounting.collective_calls_traced = len(collectives_of(graph))
    accounting.linear_candidates = [g.fqn for g in found if g.fqn is not None]
    missing = sorted(ctx.selected - set(accounting.linear_candidates))
    if missing:
        raise ValueError(
            f"GIFT layers {missing} have no weight-gradient collective in the traced graph; "
            f"Linear layers with one: {accounting.linear_candidates}"
        )
    for g in found:
        shape = tuple(g.collective.args[0].meta["val"].shape)
        fp32 = bytes_sent(shape, gc.world_size(g), WireFormat("fp32"), g.collective_type)
        accounting.fp32_bytes += fp32
        accounting.linear_fp32_bytes += fp32 if g.fqn is not None else 0
        if g.fqn is not None:
            accounting.numel[g.fqn] = int(torch.Size(shape).numel())

    rewrites = gc.plan_rewrites(graph, ctx.config, ctx.selected)
    mark_gradient_collectives(g.collective for g in found)  # the overlap pass moves those left as they are too
    for r in rewrites:
        (accounting.rewritten_gift if r.plan.whitened else accounting.rewritten_euclidean).append(r.found.fqn)
        accounting.numel[r.found.fqn] = int(r.found.collective.args[0].meta["val"].numel())
    done = {id(r.found.collective) for r in rewrites}
    for g in found:
        if id(g.collective) not in done:
            val = g.collective.args[0].meta["val"]
            nbytes = bytes_sent(tuple(val.shape), gc.world_size(g), _dense_wire(val.dtype), g.collective_type)
            accounting.untouched_bytes += nbytes
            accounting.untouched_linear_bytes += nbytes if g.fqn is not None else 0
    gc.apply_rewrites(graph, rewrites, ctx.config, namespace)
    compiled = compile_codec_regions(graph) if ctx.compile_codec else 0

    graph.lint()
    gm.recompile()
    ctx.accounting = accounting
    log.info(
        "GIFT pass: %d gradient collectives; whitened %s: %d %s; Euclidean %s/%s: %d; unchanged: %d; %s",
        accounting.collectives, ctx.config.gift_dtype, len(accounting.rewritten_gift), accounting.rewritten_gift,
        ctx.config.euclidean_dtype, ctx.config.embedding_dtype, len(accounting.rewritten_euclidean),
        accounting.collectives - len(accounting.rewritten_gift) - len(accounting.rewritten_euclidean),
        f"codec compiled ({compiled} ops in regions)" if compiled else "codec eager",
    )
    return gm


# graph_trainer passes that cannot run beside GIFT: a CUDA graph replays captured kernels
# without the Python of the gift:: ops (refresh, residual hand-over, counters).
INCOMPATIBLE_PASSES = ("cudagraph_pass",)


def disable_incompatible_passes(compile_config) -> list[str]:
    """Add :data:`INCOMPATIBLE_PASSES` to ``compile_config.disable_passes``; returns those added."""
    added = [name for name in INCOMPATIBLE_PASSES if name not in compile_config.disable_passes]
    compile_config.disable_passes.extend(added)
    return added


def gift_overlap_pass(gm: fx.GraphModule, example_inputs=None, *, namespace: str) -> fx.GraphModule:
    """The last pass: on gloo, send gradient messages as ``all_to_all`` calls in pieces
    (``passes/pieces.py``; before the scheduler, which issues a message's pieces together), order
    the final graph so gradient communication overlaps the backward (``passes/overlap.py``;
    graph_trainer runs the joint graph as ordered), then put the time meter's ticks in
    (``timing.py``)."""
    ctx = get_pass_context(namespace)
    # "auto" is resolved by the session, with a collective at start-up; a pass run without one splits nothing
    parameter_kib = ctx.config.parameter_piece_kib if ctx.config.parameter_piece_kib != "auto" else 0
    pieces = send_in_pieces(gm.graph, ctx.config.wire_piece_kib * 1024, parameter_kib * 1024)
    if pieces:
        log.info("GIFT pieces: %d more collectives per step, each gradient message at most %d KiB per destination, "
                 "each parameter all-gather at most %s KiB per rank", pieces, ctx.config.wire_piece_kib, parameter_kib or "any")
    if ctx.config.overlap:
        ctx.accounting.overlapped = overlap_gradient_collectives(gm.graph)
        log.info("GIFT overlap: %d gradient waits now come after a later gradient collective's issue", ctx.accounting.overlapped)
    ctx.accounting.collective_calls = len(collectives_of(gm.graph))
    statistics, on_own_group = statistics_on_own_group(gm.graph)
    log.info("GIFT final graph: %d collectives per step, %d parameter all-gathers prefetched, "
             "%d of %d statistics all-reduces on a group of their own", ctx.accounting.collective_calls,
             prefetched_all_gathers(gm.graph), on_own_group, statistics)
    time_meter.instrument(gm.graph, namespace)
    gm.recompile()
    return gm


def gift_pass_pipeline(traced_result, config, *, parallel_dims=None) -> list:
    """``(TracedResult, GraphTrainer.Config, parallel_dims=) -> [pass]``: GIFT first, then
    torchtitan's, then GIFT's overlap scheduling of the final graph."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    passes = construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
    gift = getattr(config, "gift", None)
    if gift is None or not gift.enabled:
        return passes
    passes = [keep_codec_marks(p) if getattr(p, "func", p).__name__ == "regional_inductor_pass" else p for p in passes]
    return [functools.partial(gift_joint_graph_pass, namespace=NAMESPACE), *passes,
            functools.partial(gift_overlap_pass, namespace=NAMESPACE)]


def before_train_step(trainer) -> None:
    """graph_trainer's pre-step hook for the ``gift`` pipeline: the session's ``auto`` switch."""
    session = getattr(trainer, "gift_session", None)
    if session is not None:
        session.before_step(trainer.step)


def register_pipeline() -> None:
    """Register :func:`gift_pass_pipeline` and its pre-step hook under ``"gift"`` (idempotent)."""
    from torchtitan.experiments.graph_trainer.registry import register_pass_pipeline, register_pre_train_step_hook

    register_pass_pipeline(PIPELINE_NAME)(gift_pass_pipeline)
    register_pre_train_step_hook(PIPELINE_NAME)(before_train_step)


__all__ = ["INCOMPATIBLE_PASSES", "NAMESPACE", "PIPELINE_NAME", "GraphAccounting", "disable_incompatible_passes", "PassContext", "before_train_step", "gift_joint_graph_pass", "gift_pass_pipeline", "register_pipeline"]
