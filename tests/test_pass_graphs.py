"""Graph snapshots of the GIFT pass on real traced backward graphs (single process, fake PG).

The fake process group lets Dynamo/AOTAutograd trace the functional collectives without
peers; the numerics are checked on real gloo ranks in test_compiled_training.py.
"""

import collections
import logging
import re

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from expecttest import assert_expected_inline
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass
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


class Recorder(CustomGraphPass):
    """Runs the GIFT pass on backward graphs and keeps their code before and after."""

    def __init__(self, config, namespace, selected):
        self.config, self.namespace, self.selected = config, namespace, frozenset(selected)
        self.before, self.after = [], []

    def __call__(self, graph):
        if not any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder")):
            return
        self.before.append(normalized_code(graph))
        gift_collectives_pass(graph, self.config, self.namespace, self.selected)
        self.after.append(normalized_code(graph))

    def uuid(self):
        return None  # tests compile with the cache off


def normalized_code(graph) -> str:
    code = graph.python_code("self").src
    code = re.sub(r"\s*#.*", "", code)  # comments
    code = re.sub(r";  [\w\s=,]+ = None", "", code)  # "x = None" frees
    code = code.replace(f"'{dist.group.WORLD.group_name}'", "'GROUP'")
    return "\n".join(line.rstrip() for line in code.strip().splitlines())


VIEWS = {"view", "reshape", "alias", "unsqueeze", "slice", "clone", "expand", "permute", "getitem", "_to_copy"}


def op_sequence(code: str) -> str:
    """The non-view ops of a graph in order, consecutive repeats collapsed: the graph's shape."""
    ops = []
    for op in re.findall(r"= torch\.ops\.([\w.]+)\(", code):
        short = op.replace("aten.", "").replace("_c10d_functional.", "c10d.").rsplit(".", 1)[0] if op.count(".") > 1 else op
        if short.split(".")[-1] in VIEWS or short.startswith("operator"):
            continue
        if ops and ops[-1][0] == short:
            ops[-1][1] += 1
        else:
            ops.append([short, 1])
    return "\n".join(f"{op} x{n}" if n > 1 else op for op, n in ops)


def compile_and_record(model, config, namespace, selected, x):
    register_runtime(namespace, config)
    recorder = Recorder(config, namespace, selected)
    patches = {"post_grad_custom_pre_pass": recorder, "fx_graph_cache": False}
    compiled = torch.compile(model, backend=lambda gm, ex: compile_fx(gm, ex, config_patches=patches), fullgraph=True)
    compiled(x).sum().backward()
    assert len(recorder.before) == 1
    return recorder.before[0], recorder.after[0]


def test_mlp_backward_graph_before_and_after():
    torch.manual_seed(0)
    before, after = compile_and_record(
        replicate(MLP()), GiftConfig(layers=("fc2",), rank=4), "snap_mlp", {"fc2"}, torch.randn(4, 16)
    )
    assert_expected_inline(before, """\
def forward(self, primals_3, primals_4, relu, tangents_1):
    permute_1 = torch.ops.aten.permute.default(primals_4, [1, 0])
    permute_2 = torch.ops.aten.permute.default(permute_1, [1, 0])
    mm = torch.ops.aten.mm.default(tangents_1, permute_2)
    permute_3 = torch.ops.aten.permute.default(tangents_1, [1, 0])
    mm_1 = torch.ops.aten.mm.default(permute_3, relu)
    sum_1 = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True)
    view_4 = torch.ops.aten.reshape.default(sum_1, [8])
    all_reduce = torch.ops._c10d_functional.all_reduce.default(view_4, 'avg', 'GROUP')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    all_reduce_1 = torch.ops._c10d_functional.all_reduce.default(mm_1, 'avg', 'GROUP')
    wait_tensor_1 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_1)
    le = torch.ops.aten.le.Scalar(relu, 0)
    full_default = torch.ops.aten.full.default([], 0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    where = torch.ops.aten.where.self(le, full_default, mm)
    permute_6 = torch.ops.aten.permute.default(where, [1, 0])
    mm_2 = torch.ops.aten.mm.default(permute_6, primals_3)
    sum_2 = torch.ops.aten.sum.dim_IntList(where, [0], True)
    view_5 = torch.ops.aten.reshape.default(sum_2, [32])
    all_reduce_2 = torch.ops._c10d_functional.all_reduce.default(view_5, 'avg', 'GROUP')
    wait_tensor_2 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_2)
    all_reduce_3 = torch.ops._c10d_functional.all_reduce.default(mm_2, 'avg', 'GROUP')
    wait_tensor_3 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_3)
    return (wait_tensor_3, wait_tensor_2, None, wait_tensor_1, wait_tensor)""")
    assert_expected_inline(op_sequence(after), """\
mm x2
sum
c10d.all_reduce
c10d.wait_tensor
gift.begin_step
gift.load_factors
gift.load_residual
mul
mm
mul
mm
add x2
abs
amax
clamp_min
div x2
clamp_min
clamp_max
prims.convert_element_type x2
mul
cat
c10d.all_to_all_single
c10d.wait_tensor
prims.convert_element_type
mul
sum
div
prims.convert_element_type
abs
ge
sum
eq
ne
bitwise_and
sum
prims.convert_element_type x2
sub
pow
sum
pow
sum
cat
abs
amax
clamp_min
div x2
clamp_min
clamp_max
prims.convert_element_type
cat
c10d.all_gather_into_tensor
c10d.wait_tensor
prims.convert_element_type
mul
sub
abs
ne
eq
mul
full
where
mul
mm
mul
mm
add
gift.end_step
le
full
where
mm
sum
c10d.all_reduce
c10d.wait_tensor
abs
amax
clamp_min
div x2
clamp_min
clamp_max
prims.convert_element_type x2
mul
cat
c10d.all_to_all_single
c10d.wait_tensor
prims.convert_element_type
mul
sum
div
prims.convert_element_type
abs
ge
sum
eq
ne
bitwise_and
sum
prims.convert_element_type x2
sub
pow
sum
pow
sum
cat
abs
amax
clamp_min
div x2
clamp_min
clamp_max
prims.convert_element_type
cat
c10d.all_gather_into_tensor
c10d.wait_tensor
prims.convert_element_type
mul
gift.record_euclidean""")
    # Every original gradient collective is accounted for: 4 all_reduces (2 weights, 2 biases)
    # became 2 untouched bias all_reduces + 2 FP8 weight reductions (all_to_all + all_gather).
    FileCheck().check_count("_c10d_functional.all_reduce.default(", 4, exactly=True).run(before)
    FileCheck().check_count("_c10d_functional.all_reduce.default(", 2, exactly=True).run(after)
    FileCheck().check_count("_c10d_functional.all_to_all_single.default(", 2, exactly=True).run(after)
    FileCheck().check_count("_c10d_functional.all_gather_into_tensor.default(", 2, exactly=True).run(after)
    FileCheck().check("gift.begin_step.default('snap_mlp', 'fc2'").check("gift.end_step.default('snap_mlp', 'fc2'").run(after)
    FileCheck().check_count("gift.record_euclidean.default('snap_mlp', 'fc1', 'fp8'", 1, exactly=True).run(after)


def test_llama_block_every_collective_is_accounted_for():
    torch.manual_seed(0)
    linears = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    before, after = compile_and_record(
        replicate(LlamaBlock()), GiftConfig(layers=("w2", "wo"), rank=4), "snap_block", {"w2", "wo"}, torch.randn(2, 8, 32)
    )
    counts = lambda code: collections.Counter(re.findall(r"(_c10d_functional\.\w+|gift\.\w+)\.default\(", code))
    assert_expected_inline(str(sorted(counts(before).items())), """[('_c10d_functional.all_reduce', 9), ('_c10d_functional.wait_tensor', 9)]""")
    assert_expected_inline(str(sorted(counts(after).items())), """[('_c10d_functional.all_gather_into_tensor', 7), ('_c10d_functional.all_reduce', 2), ('_c10d_functional.all_to_all_single', 7), ('_c10d_functional.wait_tensor', 16), ('gift.begin_step', 2), ('gift.end_step', 2), ('gift.load_factors', 2), ('gift.load_residual', 2), ('gift.record_euclidean', 5)]""")
    # 9 parameters: 7 Linear weights (2 GIFT + 5 Euclidean FP8) and 2 RMSNorm weights (fp32).
    for fqn in linears:
        FileCheck().check(f"'{fqn}'").run(after)
    assert counts(after)["_c10d_functional.all_reduce"] == 2


def test_untouched_when_euclidean_is_fp32_and_nothing_selected():
    torch.manual_seed(0)
    before, after = compile_and_record(
        replicate(MLP()), GiftConfig(layers=("fc2",), euclidean_dtype="fp32"), "snap_fp32", set(), torch.randn(4, 16)
    )
    assert before == after


def test_pattern_matching_nothing_lists_the_linear_layers():
    backend = gift_backend(GiftConfig(layers=("w9",)), name="bad_patterns")
    compiled = torch.compile(replicate(MLP()), backend=backend)
    with pytest.raises(Exception, match=r"\['w9'\] match no Linear layer.*\['fc1', 'fc2'\]"):
        compiled(torch.randn(4, 16))


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


@pytest.mark.parametrize("op", ["begin_step", "load_factors", "load_residual", "end_step", "record_euclidean"])
def test_gift_ops_are_never_captured_in_cuda_graphs(op):
    # Inductor asks this before capturing a graph ("reduce-overhead", graph partitions): a
    # replay would skip the op's Python (refresh, residual hand-over, counters).
    assert is_cudagraph_unsafe_fx_node(fx.Graph().call_function(getattr(torch.ops.gift, op).default))


def test_gift_backend_is_registered_by_name():
    from torch._dynamo.backends.registry import lookup_backend

    from gift_compile.backend import default_gift_backend

    assert lookup_backend("gift") is default_gift_backend


@pytest.mark.parametrize("config", [GiftConfig(rank=4), GiftConfig(rank=None), GiftConfig(side="diag"), GiftConfig(side="both", factorization="cholesky", rank=3)])
def test_fake_factor_shapes_match_the_real_state(config):
    # The compiled graph is traced against factor_shapes; at run time it gets the real tensors.
    from gift_compile.state import GiftLayerState, factor_shapes

    layer = GiftLayerState("fc", 6, 10, config)
    assert factor_shapes(config, 6, 10) == [tuple(t.shape) for t in layer.factor_tensors()]


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
