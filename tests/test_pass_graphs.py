"""Graph snapshots of the GIFT pass on real traced backward graphs (single process, fake PG).

AOTAutograd traces the backward with Inductor's decompositions (what the pass sees as
Inductor's ``post_grad_custom_pre_pass``); the pass rewrites a copy and the snapshot is taken
right after it, without Inductor's code generation. The fake process group lets the
functional collectives trace without peers; the numerics are checked on real gloo ranks in
test_compiled_training.py and test_oracle.py.
"""

import collections
import copy
import logging
import re

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.utils import is_cudagraph_unsafe_fx_node
from torch.testing import FileCheck
from torch.testing._internal.distributed.fake_pg import FakeStore

from gift_compile import GiftConfig, gift_backend, replicate
from gift_compile.passes.gift_collectives import gift_collectives_pass
from gift_compile.passes.graph_utils import module_fqn
from gift_compile.runtime import register_runtime
from models import MLP, LlamaBlock


@pytest.fixture(scope="module", autouse=True)
def fake_process_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def normalized_code(graph: fx.Graph) -> str:
    code = graph.python_code("self").src
    code = re.sub(r"\s*#.*", "", code)  # comments
    code = re.sub(r";  [\w\s=,]+ = None", "", code)  # "x = None" frees
    code = code.replace(f"'{dist.group.WORLD.group_name}'", "'GROUP'")
    return "\n".join(line.rstrip() for line in code.strip().splitlines())


def backward_before_and_after(model, config, namespace, selected, *inputs):
    """The backward graph of ``model`` as traced, and after the GIFT pass (the model still runs
    the original graph: the fake process group has no data to reduce)."""
    register_runtime(namespace, config)
    snapshots = []

    def backward_compiler(gm, example_inputs):
        before = normalized_code(gm.graph)
        rewritten = copy.deepcopy(gm)
        gift_collectives_pass(rewritten.graph, config, namespace, frozenset(selected))
        snapshots.append((before, normalized_code(rewritten.graph)))
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=backward_compiler, decompositions=select_decomp_table())
    torch.compile(model, backend=backend, fullgraph=True)(*inputs).sum().backward()
    assert len(snapshots) == 1
    return snapshots[0]


def test_mlp_backward_graph_before_and_after():
    torch.manual_seed(0)
    before, after = backward_before_and_after(replicate(MLP()), GiftConfig(layers=("fc2",), low_rank=4), "snap_mlp", {"fc2"}, torch.randn(4, 16))
    # The traced backward: one all_reduce per parameter, right after its gradient.
    FileCheck().check_count("_c10d_functional.all_reduce.default(", 4, exactly=True).run(before)
    FileCheck().check("aten.mm.default(permute_3, relu)").check("all_reduce.default(view_4, 'avg', 'GROUP')").run(before)
    # After, fc2 (selected): the statistics start first thing in the backward, before any
    # gradient is computed, and their all_reduce is waited on only where the gradient is sent.
    FileCheck() \
        .check("gift.begin_step.default('snap_mlp', 'fc2', 'GROUP', 8, 32, True, relu)") \
        .check("gift.load_basis.default('snap_mlp', 'fc2', 32, 4,") \
        .check("gift.input_sketch.default(relu,") \
        .check("_c10d_functional.all_reduce.default(input_sketch, 'sum', 'GROUP')") \
        .check("aten.mm.default(tangents_1") \
        .check("aten.mm.default(permute_3, relu)") \
        .check("_c10d_functional.wait_tensor.default(all_reduce_4)") \
        .check("gift.whitening_from_sketch.default") \
        .check("gift.meter.default('snap_mlp', 'fc2'") \
        .check("gift.load_residual.default('snap_mlp', 'fc2', 8, 32,") \
        .check("gift.load_gather_residual.default('snap_mlp', 'fc2', 4, 32,") \
        .check("_c10d_functional.all_to_all_single.default") \
        .check("_c10d_functional.all_gather_into_tensor.default") \
        .check("gift.end_step.default('snap_mlp', 'fc2', 'GROUP'") \
        .run(after)
    # fc1 (not selected): stateless Euclidean FP8, counted; the biases keep their all_reduce.
    FileCheck().check_count("gift.record_euclidean.default('snap_mlp', 'fc1', 'fp8'", 1, exactly=True).run(after)
    FileCheck().check_count("'avg', 'GROUP')", 2, exactly=True).run(after)
    FileCheck().check_count("_c10d_functional.all_to_all_single.default(", 2, exactly=True).run(after)


def test_periodic_factors_are_loaded_not_computed():
    torch.manual_seed(0)
    config = GiftConfig(layers=("fc2",), low_rank=4, factor_source="periodic")
    _, after = backward_before_and_after(replicate(MLP()), config, "snap_periodic", {"fc2"}, torch.randn(4, 16))
    FileCheck().check("gift.begin_step.default('snap_periodic', 'fc2'").check("gift.load_factors.default('snap_periodic', 'fc2', 32, 4,") \
        .check("gift.end_step").run(after)
    FileCheck().check_not("gift.input_sketch").check_not("gift.whitening_from_sketch").run(after)


def test_joint_graph_sends_the_statistics_during_the_forward():
    # graph_trainer's own tracer (make_fx of forward + loss + backward, modules annotated with
    # their FQNs): fc2's input is a forward node, so the sketch and its all_reduce start in the
    # forward, before fc2 itself runs (addmm_1) and before the loss (sum_1); the wait comes
    # only after fc2's weight gradient (mm(t_3, relu)) exists, in the backward.
    from torchtitan.experiments.graph_trainer.common_utils import annotate_module_fqns
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer

    torch.manual_seed(0)
    model = replicate(MLP())
    annotate_module_fqns(model)

    def forward_backward(x):  # graph_trainer's make_fwd_bwd_step, with a sum for the loss
        loss = model(x).sum()
        params = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
        return [loss, *torch.autograd.grad(loss, params)]

    graph = minimal_fx_tracer(forward_backward, module=model)(torch.randn(4, 16)).gm.graph
    config = GiftConfig(layers=("fc2",), low_rank=4)
    register_runtime("snap_joint", config)
    assert len(gift_collectives_pass(graph, config, "snap_joint", frozenset({"fc2"}))) == 2  # fc2 whitened, fc1 FP8
    FileCheck() \
        .check("aten.relu.default") \
        .check("gift.input_sketch.default(relu,") \
        .check("_c10d_functional.all_reduce.default(input_sketch, 'sum',") \
        .check("aten.addmm.default(view_3, relu,") \
        .check("aten.sum.default(addmm_1)") \
        .check("aten.mm.default(t_3, relu)") \
        .check("_c10d_functional.wait_tensor.default(all_reduce_4)") \
        .check("gift.whitening_from_sketch.default") \
        .check("gift.end_step.default('snap_joint', 'fc2'") \
        .run(normalized_code(graph))


def count_ops(code: str) -> collections.Counter:
    return collections.Counter(re.findall(r"(_c10d_functional\.\w+|gift\.\w+)\.default\(", code))


def test_llama_block_every_collective_is_accounted_for():
    torch.manual_seed(0)
    config = GiftConfig(layers=("w2", "wo"), low_rank=4, euclidean_error_feedback=True)
    before, after = backward_before_and_after(replicate(LlamaBlock()), config, "snap_block", {"w2", "wo"}, torch.randn(2, 8, 32))
    # 9 parameters: 7 Linear weights (2 GIFT + 5 Euclidean FP8 with error feedback) and 2 RMSNorm weights (fp32).
    assert count_ops(before) == {"_c10d_functional.all_reduce": 9, "_c10d_functional.wait_tensor": 9}
    ops = count_ops(after)
    assert ops["_c10d_functional.all_to_all_single"] == 7 and ops["_c10d_functional.all_gather_into_tensor"] == 7
    assert ops["_c10d_functional.all_reduce"] == 2 + 2  # the norm weights + the two sketches
    assert ops["gift.begin_step"] == ops["gift.end_step"] == ops["gift.load_residual"] == 7
    assert ops["gift.input_sketch"] == ops["gift.whitening_from_sketch"] == ops["gift.meter"] == 2
    assert ops["gift.record_euclidean"] == 0  # every Euclidean layer keeps a residual here
    for fqn, whitened in [("wq", False), ("wk", False), ("wv", False), ("wo", True), ("w1", False), ("w2", True), ("w3", False)]:
        FileCheck().check(f"gift.begin_step.default('snap_block', '{fqn}', 'GROUP', ").check(f", {whitened}, ").run(after)


def test_untouched_when_euclidean_is_fp32_and_nothing_selected():
    torch.manual_seed(0)
    before, after = backward_before_and_after(
        replicate(MLP()), GiftConfig(layers=("fc2",), euclidean_dtype="fp32"), "snap_fp32", set(), torch.randn(4, 16)
    )
    assert before == after


def test_pattern_matching_nothing_lists_the_linear_layers():
    # Checked when the first backward compiles (every forward graph of the step has been seen).
    backend = gift_backend(GiftConfig(layers=("w9",)), name="bad_patterns")
    compiled = torch.compile(replicate(MLP()), backend=backend)
    loss = compiled(torch.randn(4, 16)).sum()
    with pytest.raises(Exception, match=r"\['w9'\] match no Linear layer.*\['fc1', 'fc2'\]"):
        loss.backward()


def test_graph_without_collectives_warns_once_and_trains_correctly(caplog):
    torch.manual_seed(0)
    model = MLP()
    expected = MLP()
    expected.load_state_dict(model.state_dict())
    backend = gift_backend(GiftConfig(layers=("fc2",)), name="no_collectives")
    x = torch.randn(4, 16)
    # The warning comes from the pass, which a warm FX graph cache (from an earlier run of this
    # test on the same machine) rightly skips: compile fresh.
    with caplog.at_level(logging.WARNING, logger="gift_compile"), torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(model, backend=backend)(x).sum().backward()
    warnings = [r for r in caplog.records if "no gradient collectives" in r.getMessage()]
    assert len(warnings) == 1
    expected(x).sum().backward()
    for got, want in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


STATEFUL_OPS = ["begin_step", "load_basis", "load_factors", "load_residual", "load_gather_residual", "meter", "end_step", "record_euclidean"]


@pytest.mark.parametrize("op", STATEFUL_OPS)
def test_gift_ops_are_never_captured_in_cuda_graphs(op):
    # Inductor asks this before capturing a graph ("reduce-overhead", graph partitions): a
    # replay would skip the op's Python (state hand-over, refresh, counters).
    assert is_cudagraph_unsafe_fx_node(fx.Graph().call_function(getattr(torch.ops.gift, op).default))


def test_gift_backend_is_registered_by_name():
    from torch._dynamo.backends.registry import lookup_backend

    from gift_compile.backend import default_gift_backend

    assert lookup_backend("gift") is default_gift_backend


@pytest.mark.parametrize("config", [GiftConfig(low_rank=4, factor_source="periodic"), GiftConfig(low_rank=None, factor_source="periodic"),
                                    GiftConfig(factorization="cholesky", factor_source="periodic", low_rank=3)])
def test_fake_factor_shapes_match_the_real_state(config):
    # The compiled graph is traced against the fake shapes; at run time it gets the real tensors.
    from gift_compile.state import GiftLayerState

    from gift_compile.geometry import factor_shapes

    layer = GiftLayerState("fc", 6, 10, config)
    assert factor_shapes(config.whitening_layout, 10, config.factor_rank(10)) == [tuple(t.shape) for t in layer.factor_tensors()]


@pytest.mark.parametrize(
    "dynamo_path, fqn",
    [
        ("L['self'].layers[0].feed_forward.w2", "layers.0.feed_forward.w2"),  # nn_module_stack style
        ("L['self']._modules['fc1']", "fc1"),  # placeholder source style
        ("L['self']._modules['module']._modules['fc1']", "module.fc1"),  # DDP's wrapped module
        ("L['self'].fc2.parametrizations.weight.original", "fc2"),  # replicate()'s parametrization
    ],
)
def test_dynamo_paths_become_model_fqns(dynamo_path, fqn):
    assert module_fqn(dynamo_path) == fqn
