"""passes/pieces.py: large gradient messages travel over gloo in pieces, with the same bytes."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from gift_compile import collectives
from gift_compile.passes.overlap import (
    PARAMETER_GATHER, PIECE_OF, collectives_of, mark_gradient_collectives, overlap_gradient_collectives, prefetched_all_gathers,
)
from gift_compile.passes.pieces import send_in_pieces
from gift_compile.testing.ranks import run_on_ranks

c10d = torch.ops._c10d_functional


def _exchange_graph(a2a_message: torch.Tensor, gather_message: torch.Tensor) -> fx.GraphModule:
    """A quantized all-reduce's two phases as the GIFT pass traces them (``collectives.py``): an
    ``all_to_all`` of equal chunks and an all-gather, each waited on once, both marked as
    gradient collectives."""

    def exchange(a2a_in, gather_in):
        return collectives.all_to_all(a2a_in, dist.group.WORLD), collectives.all_gather(gather_in, dist.group.WORLD)

    gm = make_fx(exchange)(a2a_message, gather_message)
    mark_gradient_collectives(gm.graph.nodes)
    return gm


def _split_and_compare(rank: int, world: int) -> dict:
    generator = torch.Generator().manual_seed(rank)
    # 1,000 bytes per destination, and a (1, 600) message: each rank's own bytes
    a2a_message = torch.randint(0, 256, (2000,), dtype=torch.uint8, generator=generator)
    gather_message = torch.randint(0, 256, (1, 600), dtype=torch.uint8, generator=generator)
    gathered_by_gloo = torch.empty(2, 600, dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered_by_gloo, gather_message)  # gloo's own all-gather, eagerly
    whole = _exchange_graph(a2a_message, gather_message)
    split = _exchange_graph(a2a_message, gather_message)
    added = send_in_pieces(split.graph, 400)  # 1,000 bytes in 3 pieces, 600 in 2
    overlap_gradient_collectives(split.graph)
    split.recompile()
    calls = collectives_of(split.graph)
    one_call_each = {}
    for piece_bytes in (1000, 0):  # no message is larger than a piece; no limit
        gm = _exchange_graph(a2a_message, gather_message)
        one_call_each[piece_bytes] = (send_in_pieces(gm.graph, piece_bytes), _names(collectives_of(gm.graph)))
        gm.recompile()
        one_call_each[piece_bytes] += (_same(whole, gm, a2a_message, gather_message),)
    return {
        "whole_calls": _names(collectives_of(whole.graph)),
        "gathered_as_gloo_does": torch.equal(whole(a2a_message, gather_message)[1], gathered_by_gloo),
        "added": added,
        "calls": _names(calls),
        "later_pieces_point_to_their_first": [c.meta.get(PIECE_OF) is not None for c in calls],
        "same_bytes": _same(whole, split, a2a_message, gather_message),
        "one_call_each": one_call_each,
    }


def _names(calls: list[fx.Node]) -> list[str]:
    return [c.target.__name__ for c in calls]


def _same(a: fx.GraphModule, b: fx.GraphModule, *inputs: torch.Tensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a(*inputs), b(*inputs)))


def test_large_messages_travel_in_pieces_that_deliver_the_same_bytes():
    for result in run_on_ranks(_split_and_compare, 2):
        # On gloo the all-gather is an all_to_all (gloo's unlocked op name: collectives.py) that
        # delivers what gloo's own all-gather does.
        assert result["whole_calls"] == ["all_to_all_single.default"] * 2
        assert result["gathered_as_gloo_does"]
        # 1,000 bytes per destination at 400 a piece: 3 all_to_all calls (334, 333, 333 bytes);
        # the 600-byte all-gather: 2 calls. Every rank gets bit for bit what the one call gave.
        assert result["added"] == 2 + 1
        assert result["calls"] == ["all_to_all_single.default"] * 5
        assert result["later_pieces_point_to_their_first"] == [False, True, True, False, True]
        assert result["same_bytes"]
        # With pieces as large as the messages, or no limit, each message is one call.
        for added, calls, same in result["one_call_each"].values():
            assert (added, calls, same) == (0, ["all_to_all_single.default"] * 2, True)


def _pieces_are_one_collective_for_the_scheduler(rank: int, world: int) -> list[str]:
    """Two gradients' all_to_alls, the first sent in 2 pieces: the order the scheduler gives."""
    group_name = dist.group.WORLD.group_name

    def two_gradients(x, w0, w1):
        outputs = []
        for w in (w0, w1):
            grad = (x @ w).reshape(-1)  # each gradient's compute, then its collective
            split = [grad.numel() // 2] * 2
            outputs.append(c10d.wait_tensor(c10d.all_to_all_single(grad, split, split, group_name)) * 2)
        return outputs

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    gm = make_fx(two_gradients)(x, w, w)
    mark_gradient_collectives(gm.graph.nodes)
    send_in_pieces(gm.graph, 64)  # each gradient: 8 x 8 fp32, 128 bytes per destination, in 2 pieces
    overlap_gradient_collectives(gm.graph, lag=1)
    order = []
    for node in gm.graph.nodes:
        if node.target is c10d.all_to_all_single.default:
            order.append("piece" if PIECE_OF in node.meta else "all_to_all")
        elif node.target is c10d.wait_tensor.default:
            order.append("wait")
        elif node.target is torch.ops.aten.mm.default:
            order.append("mm")
    return order


def test_the_scheduler_issues_the_pieces_together_and_holds_their_waits_as_one():
    for order in run_on_ranks(_pieces_are_one_collective_for_the_scheduler, 2):
        # Each gradient's pieces go out together, right after its compute. With lag 1 a gradient's
        # waits become eligible once the next gradient's collective has started: the first's after
        # the second's, not after its own second piece (the pieces count as one collective); the
        # last's when nothing else is left.
        assert order == ["mm", "all_to_all", "piece", "mm", "all_to_all", "piece", "wait", "wait", "wait", "wait"], order


def _parameter_gathers(rank: int, world: int) -> dict:
    """graph_trainer's FSDP forward in small: two parameters' bucket all-gathers
    (``all_gather_into_tensor_out``, unmarked), the second issued before the first is waited on
    (its prefetch), each used by a matmul; sent in pieces, then ordered by the scheduler."""
    group_name = dist.group.WORLD.group_name

    def forward(x, p0, p1):
        gathered = []
        for p in (p0, p1):
            bucket = torch.empty(world * p.numel())
            gathered.append(c10d.all_gather_into_tensor_out(p, world, group_name, out=bucket))
        h = x @ c10d.wait_tensor(gathered[0]).reshape(8, -1)
        p1_gathered = c10d.wait_tensor(gathered[1])
        return h, h @ p1_gathered.reshape(-1, 8), p1_gathered

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8)
    p0, p1 = (torch.randn(100, generator=generator) for _ in range(2))  # 400 bytes of each parameter per rank
    by_gloo = torch.empty(world * 100)
    dist.all_gather_into_tensor(by_gloo, p1)
    whole = make_fx(forward)(x, p0, p1)
    split = make_fx(forward)(x, p0, p1)
    prefetched_before = prefetched_all_gathers(split.graph)
    added = send_in_pieces(split.graph, 0, 128)  # 400 bytes to each rank at 128 a piece: 4 calls each
    gradient_waits_moved = overlap_gradient_collectives(split.graph)
    split.recompile()
    order, gathers = [], []  # gathers: each parameter's first call, in graph order
    for node in split.graph.nodes:
        if node.target is c10d.all_to_all_single.default:
            gathers += [node] if node.meta[PARAMETER_GATHER] is node else []
            order.append(f"p{gathers.index(node.meta[PARAMETER_GATHER])}")
        elif node.target is c10d.wait_tensor.default:
            order.append("wait")
        elif node.target is torch.ops.aten.mm.default:
            order.append("mm")
    got, want = split(x, p0, p1), whole(x, p0, p1)

    def reads_the_bucket(x, p0):  # a node reading the out buffer itself, not through the wait
        bucket = torch.empty(world * p0.numel())
        gathered = c10d.all_gather_into_tensor_out(p0, world, group_name, out=bucket)
        return c10d.wait_tensor(gathered) * 2, bucket + 1

    aliased = make_fx(reads_the_bucket)(x, p0)
    # make_fx reads a tensor through the last node that wrote it (the wait): point ``bucket + 1``
    # at the buffer's own node, as a hand-built graph might
    (add,) = aliased.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
    (bucket,) = aliased.graph.find_nodes(op="call_function", target=torch.ops.aten.empty.memory_format)
    add.replace_input_with(add.args[0], bucket)
    return {
        "auto_on_loopback": collectives.parameter_piece_kib_for(dist.group.WORLD),
        "aliased_left_whole": send_in_pieces(aliased.graph, 0, 128) == 0,
        "added": added,
        "order": order,
        "prefetched": (prefetched_before, prefetched_all_gathers(split.graph)),
        "gradient_waits_moved": gradient_waits_moved,
        "same": all(torch.equal(a, b) for a, b in zip(got, want)),
        "gathered_as_gloo_does": torch.equal(got[2], by_gloo),
    }


def test_parameter_all_gathers_travel_in_pieces_where_they_were_issued_and_waited():
    results = run_on_ranks(_parameter_gathers, 2)
    assert results[0]["auto_on_loopback"] == results[1]["auto_on_loopback"]  # every rank chooses alike
    for result in results:
        # Each parameter's 400 bytes go to every rank in 4 calls of at most 128 bytes (all_to_alls:
        # collectives.all_gather on gloo), 8 calls where there were 2.
        assert result["added"] == 6
        # The prefetch is kept: both parameters' calls go out before the first is waited on, and
        # each parameter's waits stand where its all-gather's wait stood (the scheduler moves no
        # unmarked collective; there is no gradient collective here to move).
        assert result["order"] == ["p0"] * 4 + ["p1"] * 4 + ["wait"] * 4 + ["mm"] + ["wait"] * 4 + ["mm"], result["order"]
        assert result["prefetched"] == (1, 1) and result["gradient_waits_moved"] == 0
        # Bit for bit what the one call gave, and what gloo's own all-gather gives.
        assert result["same"] and result["gathered_as_gloo_does"]
        # Where a node reads the bucket buffer itself, the pieces (which gather elsewhere) would
        # leave it unfilled: that all-gather stays one call.
        assert result["aliased_left_whole"]
        # parameter_piece_kib = "auto" on loopback: one 1 MiB all_to_all takes ~1-3 ms (several
        # Gbit/s), far above SLOW_LINK_MBIT (300): one call each (the slow branch, on a shaped
        # link: tests/test_shaped_link.py).
        kib, rate = result["auto_on_loopback"]
        assert kib == 0 and rate > 300, rate
