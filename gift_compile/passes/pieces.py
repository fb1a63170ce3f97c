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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from gift_compile.collectives import all_to_all_in_pieces, pieces_for
from gift_compile.passes.graph_utils import call_arguments, equal_chunks, splice_traced, waited_once
from gift_compile.passes.overlap import GRADIENT_COMM, GRADIENT_STATISTICS, PIECE_INPUT, PIECE_OF, STATISTICS, WAIT
from gift_compile.passes.time_meter import CODEC

c10d = torch.ops._c10d_functional

ALL_TO_ALL = c10d.all_to_all_single.default


def send_in_pieces(graph: fx.Graph, piece_bytes: int) -> int:
    """On gloo groups, split every marked gradient ``all_to_all`` whose message per destination
    exceeds ``piece_bytes`` (module docstring); returns how many calls per step this added."""
    added = 0
    for node in list(graph.find_nodes(op="call_function", target=ALL_TO_ALL)):
        if not _splittable(node):
            continue
        group = _resolve_process_group(call_arguments(node)["group_name"])
        pieces = pieces_for(node.args[0].meta["val"], group, piece_bytes)
        if pieces > 1:
            _split(graph, node, dist.get_world_size(group), pieces, group.group_name)
            added += pieces - 1
    graph.lint()
    return added


def _splittable(node: fx.Node) -> bool:
    """A gradient collective (not statistics), waited on once, with equal chunks both ways (what
    ``collectives.all_to_all`` and the bucketing pass issue)."""
    if not node.meta.get(GRADIENT_COMM) or STATISTICS in node.meta or GRADIENT_STATISTICS in node.meta:
        return False
    return waited_once(node) and equal_chunks(node)


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


__all__ = ["send_in_pieces"]
