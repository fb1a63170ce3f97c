"""graph_trainer's codec regions (``compile_codec_regions``, ``cut_codec_regions``): each
layer's codec arithmetic is compiled as a region of its own, so that the encodes of several
layers are not fused (every collective then waits for the last of their gradients), nor a
decode with a later encode (the later layer's bytes then wait for the earlier layer's); and
same-shaped layers' regions are one compile."""

import logging

import torch
from torch import fx
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.regional_inductor import regional_inductor

from graph_render import ancestors

from gift_compile.passes import time_meter
from gift_compile.passes.overlap import GRADIENT_COMM
from gift_compile.titan_integration import graph_pass
from gift_compile.titan_integration.graph_pass import (
    REGION_PREFIX, compile_codec_regions, cut_codec_regions, keep_codec_marks,
)

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def two_layer_graph() -> fx.GraphModule:
    """Two gradients, each encoded, sent and decoded, in the order the overlap pass gives:
    both collectives are issued before the first wait."""
    graph = fx.Graph()
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())  # the values a traced joint graph carries

    def node(target, *args, codec=False):
        n = graph.call_function(target, args)
        n.meta["val"] = fake_mode.from_tensor(torch.empty(8))
        if codec:
            n.meta[time_meter.CODEC] = True
        return n

    inputs = [graph.placeholder(f"x{k}") for k in range(2)]
    for x in inputs:
        x.meta["val"] = fake_mode.from_tensor(torch.empty(8))
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


def regions_of(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith(REGION_PREFIX)]


def test_each_layer_codec_is_a_region_of_its_own_and_none_is_left_to_cut(caplog):
    gm = two_layer_graph()
    assert compile_codec_regions(gm.graph) == 4
    with caplog.at_level(logging.INFO, logger=graph_pass.__name__):
        cut = cut_codec_regions(gm)
    assert len(regions_of(cut)) == 4  # two encodes and two decodes, all unconnected
    assert "GIFT codec regions: 4, 2 distinct graphs" in caplog.text  # an encode and a decode
    assert not [n for n in cut.graph.nodes if "compile_with_inductor" in (n.meta.get("custom") or {})]


def test_same_shaped_layers_regions_are_one_compile(tmp_path, monkeypatch):
    """Inductor's cache keys a graph by its code: the two layers' regions read the same, and
    the second layer's encode and decode are cache hits of the first's (real Inductor, in an
    empty cache, with fake inputs in a tracing context as graph_trainer compiles)."""
    gm = two_layer_graph()
    compile_codec_regions(gm.graph)
    cut = cut_codec_regions(gm)
    code = [cut.get_submodule(n.target).code for n in regions_of(cut)]
    assert code[0] == code[1] and code[2] == code[3] and code[0] != code[2]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fake_mode = next(iter(cut.graph.nodes)).meta["val"].fake_mode
    counters.clear()
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        compiled = regional_inductor(cut)
    assert not regions_of(compiled)
    assert (counters["aot_autograd"]["autograd_cache_miss"], counters["aot_autograd"]["autograd_cache_hit"]) == (2, 2)


def test_each_collective_needs_only_its_own_gradient():
    """After the cut (torch's partitioner), each layer's collective depends on its own gradient
    and on no wait: its bytes can leave as soon as it exists, while the other layer's are on
    the wire. (Regional Inductor's own cut of the one region name fuses both encodes into one
    call, and layer 0's collective waits for layer 1's gradient.)"""
    gm = two_layer_graph()
    compile_codec_regions(gm.graph)
    fused = cut_codec_regions(gm)
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
    fused = keep_codec_marks(lambda cut: cut)(gm)  # the compile itself changes no node's place
    waits = time_meter.gradient_waits(fused.graph)
    kinds = {n: time_meter.kind_of(n, waits) for n in fused.graph.nodes if n.op in ("call_function", "call_module")}
    regions = [n for n in kinds if n.op == "call_module"]
    assert len(regions) == 4 and all(kinds[n] == "codec" for n in regions), kinds
    assert [n.target for n, kind in kinds.items() if kind == "compute"] == [aten.relu.default] * 2
