"""graph_trainer's codec regions (``compile_codec_regions``): each layer's codec arithmetic is
compiled as a region of its own, so that regional Inductor's partitioner cannot fuse the
encodes of several layers (every collective then waits for the last of their gradients) or a
decode with a later encode (the later layer's bytes then wait for the earlier layer's)."""

import torch
from torch import fx
from torch.fx.passes.regional_inductor import _create_inductor_marked_regions

from gift_compile import timing
from gift_compile.titan_integration.graph_pass import compile_codec_regions

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def two_layer_graph() -> fx.GraphModule:
    """Two gradients, each encoded, sent and decoded, in the order the overlap pass gives:
    both collectives are issued before the first wait."""
    graph = fx.Graph()

    def node(target, *args, codec=False):
        n = graph.call_function(target, args)
        n.meta["val"] = torch.empty(8)
        if codec:
            n.meta[timing.CODEC] = True
        return n

    grads = [graph.placeholder(f"g{k}") for k in range(2)]
    for g in grads:
        g.meta["val"] = torch.empty(8)
    sent = [node(aten.mul.Tensor, g, 2.0, codec=True) for g in grads[:1]]
    comms = [node(c10d.all_to_all_single.default, sent[0], [4, 4], [4, 4], "0")]
    sent.append(node(aten.mul.Tensor, grads[1], 2.0, codec=True))
    comms.append(node(c10d.all_to_all_single.default, sent[1], [4, 4], [4, 4], "0"))
    decoded = [node(aten.add.Tensor, node(c10d.wait_tensor.default, c), 1.0, codec=True) for c in comms]
    graph.output(tuple(decoded))
    return fx.GraphModule(torch.nn.Module(), graph)


def upstream(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for used in stack.pop().all_input_nodes:
            if used not in seen:
                seen.add(used)
                stack.append(used)
    return seen


def test_each_layer_codec_is_a_region_of_its_own():
    gm = two_layer_graph()
    assert compile_codec_regions(gm.graph) == 4
    regions = {n.name: n.meta["custom"]["compile_with_inductor"]["inductor_region"] for n in gm.graph.nodes
               if "custom" in n.meta}
    assert len(set(regions.values())) == 4, regions  # two encodes and two decodes, all unconnected


def test_each_collective_needs_only_its_own_gradient():
    """After regional Inductor's partitioning (the real partitioner), each layer's collective
    depends on its own gradient and on no wait: its bytes can leave as soon as it exists, while
    the other layer's are on the wire. (With one shared region name both encodes fuse into one
    call and layer 0's collective waits for layer 1's gradient.)"""
    gm = two_layer_graph()
    compile_codec_regions(gm.graph)
    fused = _create_inductor_marked_regions(gm)
    collectives = [n for n in fused.graph.nodes if n.target is c10d.all_to_all_single.default]
    assert len(collectives) == 2
    for k, collective in enumerate(collectives):
        needs = upstream(collective)
        assert [n.name for n in needs if n.op == "placeholder"] == [f"g{k}"]
        assert not [n for n in needs if n.target is c10d.wait_tensor.default]
