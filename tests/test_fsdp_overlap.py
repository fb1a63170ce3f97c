"""FSDP2's parameter all-gathers beside compute on gloo (``cpu_support.overlap_fsdp_all_gathers``).

A stack of three blocks is ``fully_shard``-ed per block and at the root on 2 real gloo ranks. Every
all-gather FSDP2 issues is recorded (``dist.all_gather_single``, which FSDP2's default all-gather
calls, wrapped in the rank's process), and so is each block's compute (a forward pre-hook
registered after ``fully_shard``, so it runs once FSDP2 has waited for the block's parameters).

FSDP2 as it comes issues each block's all-gather synchronously, at that block's own pre-forward:
the host holds until the parameters have arrived, and nothing computes meanwhile. Overlapped, the
all-gathers are asynchronous and block k+1's is issued before block k computes, in the backward
too; the values are the same, bit for bit.
"""

import torch

from gift_compile.titan_integration.cpu_support import overlap_fsdp_all_gathers
from models import Stack

BLOCKS = 3


def gather_order(rank, world, overlap, steps=2):
    """Per step, the forward's and the backward's events in order (``("gather", async_op)``,
    ``("compute", block)``), the units chained, and every parameter shard and gradient at the end."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stack(blocks=BLOCKS)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    chained = overlap_fsdp_all_gathers(model) if overlap else 0
    events: list = []
    for index, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda module, args, index=index: events.append(("compute", index)))
    all_gather_single = dist.all_gather_single

    def recorded(output, input, group=None, async_op=False):
        events.append(("gather", async_op))
        return all_gather_single(output, input, group=group, async_op=async_op)

    dist.all_gather_single = recorded
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forwards, backwards = [], []
    try:
        for step in range(steps):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            events.clear()
            loss = model(x).square().sum()
            forwards.append(list(events))
            events.clear()
            loss.backward()
            backwards.append(list(events))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    finally:
        dist.all_gather_single = all_gather_single
    values = {name: p.to_local().clone() for name, p in model.named_parameters()}
    return forwards, backwards, chained, values


def test_all_gathers_overlap_the_blocks_compute_with_the_same_values(ranks):
    plain = ranks(2).run(gather_order, False)
    overlapped = ranks(2).run(gather_order, True)
    for (forwards, backwards, chained, values), (forwards_o, backwards_o, chained_o, values_o) in zip(plain, overlapped):
        assert chained == 0 and chained_o == BLOCKS + 1  # the root, then each block
        for events in forwards:
            # FSDP2 as it comes: a synchronous all-gather at each block's own turn, then its compute.
            assert events == [e for k in range(BLOCKS) for e in (("gather", False), ("compute", k))]
        for events in forwards_o:
            # Block 0's parameters are prefetched by the root, block k+1's once block k's have arrived,
            # before block k computes: each all-gather travels while the block before it computes.
            assert events == [("gather", True), ("gather", True), ("compute", 0), ("gather", True), ("compute", 1), ("compute", 2)]
        for events, events_o in zip(backwards, backwards_o):
            # The backward gathers every block again (each was resharded after its forward), each
            # asynchronously once overlapped (FSDP2's own backward prefetch then overlaps it).
            assert [e for e in events if e[0] == "gather"] == [("gather", False)] * BLOCKS
            assert [e for e in events_o if e[0] == "gather"] == [("gather", True)] * BLOCKS
        for name in values:  # the same collectives on the same values: bit for bit after 2 steps
            assert torch.equal(values[name], values_o[name]), name
