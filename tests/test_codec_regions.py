"""graph_trainer's codec regions (``compile_codec_regions``): each layer's codec arithmetic is
compiled as a region of its own, so that regional Inductor's partitioner cannot fuse the
encodes of several layers (every collective then waits for the last of their gradients) or a
decode with a later encode (the later layer's bytes then wait for the earlier layer's)."""

import torch
from torch import fx
from torch.fx.passes.regional_inductor import _create_inductor_marked_regions

from graph_render import ancestors

from gift_compile.passes import time_meter
from gift_compile.passes.overlap import GRADIENT_COMM
from gift_compile.titan_integration.graph_pass import compile_codec_regions, keep_codec_marks

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def two_layer_graph() -> fx.GraphModule:
    """Two gradients, each encoded, sent and decoded, in the order the overlap pass gives:
    both collectives are issued before the first wait."""
    graph = fx.Graph()

    def node(target, *args, codec=False):
        n = graph.call_function(target, args)
        n.meta["val"] = torch.empty(8)
        if codec:
            n.meta[time_meter.CODEC] = True
        return n

    inputs = [graph.placeholder(f"x{k}") for k in range(2)]
    for x in inputs:
        x.meta["val"] = torch.empty(8)
    grads = [node(aten.relu.default, x) for x in inputs]  # the backward's compute
    sent = [node(aten.mul.Tensor, g, 2.0, codec=True) for g in grads[:1]]
    comms = [node(c10d.all_to_all_single.default, sent[0], [4, 4], [4, 4], "0")]
    sent.append(node(aten.mul.Tensor, grads[1], 2.0, codec=True))
    comms.append(node(c10d.all_to_all_single.default, sent[1], [4, 4], [4, 4], "0"))
    for c in comms:  # as the GIFT pass marks them
        c.meta[time_meter.CODEC] = c.meta[GRADIENT_COMM] = True
    decoded = [node(aten.add.Tensor, node(c10d.wait_tensor.default, c), 1.0, codec=True) for c in comms]
    graph.output(tuple(decoded))
    return fx.GraphModule(torch.nn.Module(), graph)


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
        needs = ancestors(collective)
        assert [n.name for n in needs if n.op == "placeholder"] == [f"x{k}"]
        assert not [n for n in needs if n.target is c10d.wait_tensor.default]


def test_the_time_meter_counts_compiled_regions_as_codec():
    """The calls that replace the tagged arithmetic carry no meta of their own; the wrapped
    pass marks them, so the meter's ``codec`` segments include the compiled codec and its
    ``compute`` segments only the backward's own nodes."""
    gm = two_layer_graph()
    compile_codec_regions(gm.graph)
    fused = keep_codec_marks(_create_inductor_marked_regions)(gm)
    waits = time_meter.gradient_waits(fused.graph)
    kinds = {n: time_meter.kind_of(n, waits) for n in fused.graph.nodes if n.op in ("call_function", "call_module")}
    regions = [n for n in kinds if n.op == "call_module"]
    assert len(regions) == 4 and all(kinds[n] == "codec" for n in regions), kinds
    assert [n.target for n, kind in kinds.items() if kind == "compute"] == [aten.relu.default] * 2
