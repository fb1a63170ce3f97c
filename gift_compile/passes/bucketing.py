"""Bucket the GIFT pass's gradient collectives: one ``all_to_all`` and one ``all_gather`` per
module of a block (a Llama block's attention, its feed-forward) and process group instead of
one per gradient, and one all-reduce per block for the small gradients it leaves in fp32
(docs/design.md §10).

Every quantized reduction (``collectives.py``) sends a flat uint8 message per gradient: an
``all_to_all`` with equal chunks (the reduce-scatter), and on the all-reduce route an
``all_gather`` of the re-encoded shard. One call per gradient makes the number of round trips
grow with the number of layers; on a link with latency they, not the bytes, set the step
(gloo runs a group's collectives two at a time). Merged per bucket::

    before:  m_q = all_to_all(U_q); wait; decode(m_q) ..   m_k = all_to_all(U_k); wait; decode(m_k) ..
    after:   m = all_to_all(cat(U_q.view(W, -1), U_k.view(W, -1), dim=1)); wait
             m_q, m_k = split(m.view(W, -1), dim=1); decode(m_q) ..; decode(m_k) ..

Chunk ``j`` of every member goes to rank ``j`` in one message, so each member receives the
same bytes as alone; an ``all_gather`` concatenates the members' messages and splits what
comes back per rank. The merged call goes out once the bucket's last member has its message;
what read a member's result moves after it (a stable topological sort). A member whose message
is computed from another member's result (a later phase of the same reduction) goes in a later
call, with the same phase of the bucket's other reductions. The fp32 all-reduces the pass leaves
as they are (norm weights, biases) are merged the same way, one per block: an all-reduce of a
concatenation sums each element as alone. Which layers share a bucket is
``gift_collectives.bucket_of``: a module, not a whole block: a bucket's first gradient waits for
its last, and block-wide buckets made FP8's step 20% slower on a link without added latency,
where module-wide ones cost ~nothing (docs/design.md §10).
"""

from __future__ import annotations

import torch
from torch import fx
from torch._inductor.pattern_matcher import stable_topological_sort

from gift_compile.passes.graph_utils import call_arguments, descendants, equal_chunks, splice_traced, waited_once

c10d = torch.ops._c10d_functional

BUCKET = "gift_bucket"
"""``node.meta`` key the GIFT pass sets on each collective it may bucket: the bucket's name
(``gift_collectives.bucket_of``)."""

ALL_TO_ALL = c10d.all_to_all_single.default
ALL_GATHER = c10d.all_gather_into_tensor.default
ALL_REDUCE = c10d.all_reduce.default


def bucket_gradient_collectives(graph: fx.Graph) -> int:
    """Merge the collectives marked with :data:`BUCKET` (module docstring); returns how many
    collective calls per step this removed."""
    removed = 0
    for target in (ALL_TO_ALL, ALL_GATHER, ALL_REDUCE):  # first phases first: a second phase reads their results
        buckets: dict[tuple, list[fx.Node]] = {}
        for node in graph.find_nodes(op="call_function", target=target):
            if BUCKET in node.meta and _bucketable(node):
                arguments = call_arguments(node)
                key = (node.meta[BUCKET], arguments["group_name"], arguments.get("reduce_op"), node.args[0].meta["val"].dtype)
                buckets.setdefault(key, []).append(node)
        for members in buckets.values():
            for batch in _independent(members):
                if len(batch) > 1:
                    _merge(graph, batch)
                    stable_topological_sort(graph)
                    removed += len(batch) - 1
    graph.lint()
    return removed


def _bucketable(node: fx.Node) -> bool:
    """Waited on once (``graph_utils.waited_once``), and for an ``all_to_all`` equal chunks both
    ways (what ``collectives.all_to_all`` issues)."""
    return waited_once(node) and (node.target is not ALL_TO_ALL or equal_chunks(node))


def _independent(members: list[fx.Node]) -> list[list[fx.Node]]:
    """``members`` in batches none of whose messages depends on another member's result: each
    goes one batch after the last batch holding a member it depends on, so the first phases of a
    bucket's reductions go together and their second phases together (on gloo both are
    ``all_to_all`` calls: ``collectives.all_gather``), whatever order the pass left them in."""
    order = {n: i for i, n in enumerate(members[0].graph.nodes)}
    batch_of: dict[fx.Node, int] = {}
    cones: dict[fx.Node, set[fx.Node]] = {}  # what each member's result flows into
    for member in sorted(members, key=lambda m: order[m.args[0]]):  # a member after those it depends on
        upstream = [batch_of[other] for other, cone in cones.items() if member.args[0] in cone]
        batch_of[member] = 1 + max(upstream, default=-1)
        cones[member] = descendants(member)
    batches: list[list[fx.Node]] = [[] for _ in range(max(batch_of.values()) + 1)]
    for member, batch in batch_of.items():
        batches[batch].append(member)
    return batches


def _merge(graph: fx.Graph, batch: list[fx.Node]) -> None:
    target, arguments = batch[0].target, call_arguments(batch[0])
    group_name = arguments["group_name"]
    world = torch.distributed.get_world_size(torch.distributed.distributed_c10d._resolve_process_group(group_name))
    messages = [m.args[0] for m in batch]
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(messages, key=order.__getitem__)

    def merged(*parts: torch.Tensor) -> list[torch.Tensor]:
        # rows: one chunk per destination (all_to_all), or the whole message; what comes back
        # has one row per sender (all_to_all, all_gather), or the one sum (all_reduce)
        per_rank = [p.reshape(world if target is ALL_TO_ALL else 1, -1) for p in parts]
        flat = torch.cat(per_rank, dim=1).reshape(-1)
        if target is ALL_TO_ALL:
            split = [flat.numel() // world] * world
            whole = c10d.wait_tensor(c10d.all_to_all_single(flat, split, split, group_name))
        elif target is ALL_GATHER:
            whole = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, world, group_name))
        else:
            whole = c10d.wait_tensor(c10d.all_reduce(flat, arguments["reduce_op"], group_name))
        rows = 1 if target is ALL_REDUCE else world
        pieces = torch.split(whole.reshape(rows, -1), [p.shape[1] for p in per_rank], dim=1)
        return [piece.reshape(member.meta["val"].shape) for piece, member in zip(pieces, batch)]

    present = set(graph.nodes)
    results = splice_traced(graph, merged, messages, after=last)
    (call,) = (n for n in graph.find_nodes(op="call_function", target=target) if n not in present)
    call.meta[BUCKET] = batch[0].meta[BUCKET]  # the merged call carries its bucket's name
    for member, result in zip(batch, results):
        (wait,) = member.users
        wait.replace_all_uses_with(result)
        graph.erase_node(wait)
        graph.erase_node(member)


__all__ = ["BUCKET", "bucket_gradient_collectives"]
