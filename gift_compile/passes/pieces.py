"""Send large gradient messages over gloo as ``all_to_all`` calls of at most ``wire_piece_kib``
per destination: several pieces instead of one call.

Gloo moves one large ``all_to_all`` at a fraction of a slow link's rate, and the same bytes in
pieces at nearly all of it (``benchmarks/gloo_link.py`` on the shaped link of
``shaped_link.py``, 50 Mbit/s, 1-4 MiB per direction: one all-to-all call 25-26 Mbit/s, in 128
KiB pieces 43-46; an all-reduce, which gloo pipelines in segments itself, 45-47; docs/design.md
§10). So each marked gradient ``all_to_all`` whose message per destination is larger than the
piece size becomes ``k`` calls on column slices of its per-destination rows, and their results
are concatenated back::

    before:  m = all_to_all(U)                       U: W rows (one per destination) of c bytes
             wait(m)
    after:   m_i = all_to_all(U[:, i c/k : (i+1) c/k])  for i < k      (issued together)
             wait(m_0) .. wait(m_k-1); m = cat(m_0 .. m_k-1, dim=1)

Every rank receives the same bytes in the same place as from the one call, so the result is
bit-identical. The pieces carry the collective's marks, so the overlap scheduler
(``passes/overlap.py``) issues them together and holds their waits as one collective's
(:data:`PIECE_OF`). Only gloo groups are split: NCCL pipelines a large message itself, and more
calls would only add launches. On gloo the all-reduce route's all-gather is an ``all_to_all``
too (``collectives.all_gather``: gloo's race on an all-gather's op name), so it is split the
same way. The split itself is ``collectives.all_to_all_in_pieces``, which the standard
trainer's eager exchanges (``fsdp.py``) call directly.

graph_trainer's FSDP parameter all-gathers (``all_gather_into_tensor_out`` into its per-block
bucket buffers) are the forward's traffic, and gloo moves them at 70-80% of a slow link's rate
with two in flight (FSDP's prefetch) against ~100% in 128 KiB pieces (``gloo_link.py``). With
``parameter_piece_kib`` above 0 (by default ``"auto"``: the session probes the link at start-up
and splits only on a slow one, as from 1 Gbit/s up the calls' fixed cost outweighs it), each
becomes ``collectives.all_gather`` in pieces: on gloo ``all_to_all``s carrying the same bytes,
issued where the all-gather was and waited where it was waited, so FSDP's prefetch depth and
memory profile stay as torchtitan set them::

    before:  g = all_gather_into_tensor_out(x, W, group, out=bucket)   ...   wait(g)
    after:   m_i = all_to_all(piece i of x, once per rank)  for i < k ...   wait(m_0) .. wait(m_k-1); cat
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from gift_compile.collectives import all_gather, all_gather_pieces, all_to_all_in_pieces, pieces_for
from gift_compile.passes.graph_utils import call_arguments, equal_chunks, splice_traced, waited_once
from gift_compile.passes.overlap import (
    GRADIENT_COMM, GRADIENT_STATISTICS, PARAMETER_GATHER, PIECE_INPUT, PIECE_OF, STATISTICS, WAIT,
)
from gift_compile.passes.time_meter import CODEC

c10d = torch.ops._c10d_functional

ALL_TO_ALL = c10d.all_to_all_single.default
ALL_GATHER_OUT = c10d.all_gather_into_tensor_out.default


def send_in_pieces(graph: fx.Graph, piece_bytes: int, parameter_piece_bytes: int = 0) -> int:
    """On gloo groups, split every marked gradient ``all_to_all`` whose message per destination
    exceeds ``piece_bytes``, and every parameter all-gather whose part per rank exceeds
    ``parameter_piece_bytes`` (module docstring); returns how many calls per step this added."""
    added = 0
    for node in list(graph.find_nodes(op="call_function", target=ALL_TO_ALL)):
        if not _splittable(node):
            continue
        group = _resolve_process_group(call_arguments(node)["group_name"])
        pieces = pieces_for(node.args[0].meta["val"], group, piece_bytes)
        if pieces > 1:
            _split(graph, node, dist.get_world_size(group), pieces, group.group_name)
            added += pieces - 1
    for node in list(graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)):
        if node.meta.get(GRADIENT_COMM) or not waited_once(node) or not _bucket_read_through_wait(node):
            continue
        group = _resolve_process_group(call_arguments(node)["group_name"])
        if all_gather_pieces(node.args[0].meta["val"], group, parameter_piece_bytes) > 1:
            added += _split_parameter_gather(graph, node, group, parameter_piece_bytes) - 1
    graph.lint()
    return added


def _splittable(node: fx.Node) -> bool:
    """A gradient collective (not statistics), waited on once, with equal chunks both ways (what
    ``collectives.all_to_all`` and the bucketing pass issue)."""
    if not node.meta.get(GRADIENT_COMM) or STATISTICS in node.meta or GRADIENT_STATISTICS in node.meta:
        return False
    return waited_once(node) and equal_chunks(node)


def _bucket_read_through_wait(gather: fx.Node) -> bool:
    """Nothing reads the all-gather's ``out`` buffer but the all-gather (its input may be a view
    of it): the gathered values are read only through the wait, which the split replaces. A
    node reading the buffer itself would see it unfilled once the pieces gather elsewhere."""
    bucket = call_arguments(gather)["out"]
    part = gather.args[0]
    return all(user is gather or (user is part and set(part.users) == {gather}) for user in bucket.users)


def _split(graph: fx.Graph, node: fx.Node, world: int, pieces: int, group_name: str) -> None:
    present = set(graph.nodes)
    result = splice_traced(graph, lambda message: all_to_all_in_pieces(message, world, pieces, group_name), [node.args[0]], after=node)
    added = [n for n in graph.nodes if n not in present]
    calls = [n for n in added if n.target is ALL_TO_ALL]
    for call in calls:  # the collective's marks: the scheduler's, the bucket's, the time meter's
        call.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
    for call in calls[1:]:
        call.meta[PIECE_OF] = calls[0]
    for other in added:  # the slices the pieces are cut from (everything before the first wait)
        if other.target is WAIT:
            break
        if other not in calls:
            other.meta[PIECE_INPUT] = True
    if CODEC in node.meta:  # the slices and the concatenation are the codec's, for the time meter
        for other in added:
            other.meta.setdefault(CODEC, node.meta[CODEC])
    (wait,) = node.users
    wait.replace_all_uses_with(result)
    graph.erase_node(wait)
    graph.erase_node(node)


def _split_parameter_gather(graph: fx.Graph, node: fx.Node, group: dist.ProcessGroup, piece_bytes: int) -> int:
    """Replace a parameter all-gather by ``collectives.all_gather`` in pieces: the calls where it
    was issued, their waits and the concatenation where it was waited on; returns the calls."""
    (wait,) = node.users
    present = set(graph.nodes)
    result = splice_traced(graph, lambda part: all_gather(part, group, piece_bytes), [node.args[0]], after=node)
    added = [n for n in graph.nodes if n not in present]
    calls = [n for n in added if n.op == "call_function" and n.target is ALL_TO_ALL]
    for call in calls:
        call.meta[PARAMETER_GATHER] = calls[0]
    first_wait = next(i for i, n in enumerate(added) if n.target is WAIT)
    for received in added[first_wait:]:  # in order, each just before the all-gather's own wait
        wait.prepend(received)
    wait.replace_all_uses_with(result)
    graph.erase_node(wait)
    graph.erase_node(node)
    return len(calls)


__all__ = ["send_in_pieces"]
