"""Graph snapshots of the GIFT pass on real traced backward graphs (single process, fake PG).

AOTAutograd traces the backward with Inductor's decompositions (what the pass sees as
Inductor's ``post_grad_custom_pre_pass``); the pass rewrites a copy and the snapshot is taken
right after it, without Inductor's code generation. The fake process group lets the
functional collectives trace without peers; the numerics are checked on real gloo ranks in
test_compiled_training.py and test_oracle.py.

The snapshots are ``graph_render.render_gift_graph`` (its docstring explains the format: one
line per gift:: op, collective, wait and weight-gradient mm, in graph order, no node names),
checked with expecttest's ``assertExpectedInline``. After a deliberate change, regenerate them
with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_pass_graphs.py`` and review the diff.
"""

import copy
import logging
import re

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.utils import is_cudagraph_unsafe_fx_node
from torch.testing._internal.distributed.fake_pg import FakeStore

from gift_compile import GiftConfig, gift_backend, replicate
from gift_compile.passes.gift_collectives import bucket_of, gift_collectives_pass
from gift_compile.passes.overlap import overlap_gradient_collectives, prefetched_all_gathers
from gift_compile.passes.graph_utils import module_fqn
from gift_compile.runtime import register_runtime
from graph_render import render_gift_graph
from models import MLP, GPTBlock, LlamaBlock, MLPBlock, Stack


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


def backward_before_and_after(model, config, namespace, selected, *inputs) -> tuple[fx.Graph, fx.Graph]:
    """The backward graph of ``model`` as traced, and after the GIFT pass (the model still runs
    the original graph: the fake process group has no data to reduce)."""
    register_runtime(namespace, config)
    snapshots = []

    def backward_compiler(gm, example_inputs):
        before, rewritten = copy.deepcopy(gm), copy.deepcopy(gm)
        gift_collectives_pass(rewritten.graph, config, namespace, frozenset(selected))
        snapshots.append((before.graph, rewritten.graph))
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=backward_compiler,
                           decompositions=select_decomp_table(), partition_fn=min_cut_rematerialization_partition)
    # dynamic=False: an earlier test that compiled the same forward with other shapes would make these symbolic
    torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*inputs).sum().backward()
    assert len(snapshots) == 1
    return snapshots[0]


@pytest.mark.usefixtures("fake_process_group")
class TestPassSnapshots(expecttest.TestCase):
    maxDiff = None  # a failing snapshot shows its whole diff

    def test_mlp_backward_graph_before_and_after(self):
        torch.manual_seed(0)
        before, after = backward_before_and_after(replicate(MLP()), GiftConfig(layers=("fc2",), low_rank=4), "snap_mlp", {"fc2"}, torch.randn(4, 16))
        # The traced backward: one all_reduce per parameter, right after its gradient.
        self.assertExpectedInline(render_gift_graph(before), """\
fc2         mm -> grad float32[8, 32]
fc2.bias    all_reduce(avg, GROUP) float32[8] -> wait  (original)
fc2.weight  all_reduce(avg, GROUP) float32[8, 32] -> wait  (original)
fc1         mm -> grad float32[32, 16]
fc1.bias    all_reduce(avg, GROUP) float32[32] -> wait  (original)
fc1.weight  all_reduce(avg, GROUP) float32[32, 16] -> wait  (original)""")
        # After, fc2 (selected): the statistics' first half only begins the step; where fc2's
        # reduction was, its gradient is sketched (G^T G Q, the same 130 floats an input sketch
        # sends), the sketch summed and waited on, and the Nystrom factorization runs before the
        # meter and the encoding (FP8 bytes: all_to_all, then the owners' all_gather). fc1 (not
        # selected): stateless Euclidean FP8, counted; the biases keep their all_reduce.
        self.assertExpectedInline(render_gift_graph(after), """\
*         gift::agree(NS, GROUP, description=...)
fc2       gift::begin_step(NS, fc2, GROUP, d_out=8, d_in=32, whitened=True)
fc2       mm -> grad float32[8, 32]
fc2.bias  all_reduce(avg, GROUP) float32[8] -> wait  (original)
fc2       gift::load_basis(NS, fc2, d_in=32, low_rank=4)
fc2       gift::input_sketch()
fc2       all_reduce(sum, GROUP) float32[130] -> wait
fc2       gift::whitening_from_sketches(nystrom=True)
fc2       gift::meter(NS, fc2, GROUP, collective=all_reduce, op=avg)
fc2       gift::load_residual(NS, fc2, d_out=8, d_in=32)
fc2       gift::load_gather_residual(NS, fc2, rows=4, cols=32)
fc2       all_to_all_single(GROUP) uint8[264] -> wait
fc2       all_gather_into_tensor(GROUP) uint8[1, 132] -> wait
fc2       gift::end_step(NS, fc2, GROUP, bytes_sent=264, stats_bytes=520)
fc1       mm -> grad float32[32, 16]
fc1.bias  all_reduce(avg, GROUP) float32[32] -> wait  (original)
fc1       all_to_all_single(GROUP) uint8[520] -> wait
fc1       all_gather_into_tensor(GROUP) uint8[1, 260] -> wait
fc1       gift::record_euclidean(NS, fc1, path=fp8, bytes_sent=520)""")

    def test_fp4_wire_sends_half_of_fp8s_bytes(self):
        # gift_dtype = euclidean_dtype = "fp4" (NVFP4): the same ops as FP8 (compare the MLP
        # snapshot above), with messages of 4 bits a value plus a block scale byte per 16 values
        # and the sender's fp32 scale: fc2's 4 x 32 chunk is 64 + 8 + 4 = 76 bytes (FP8: 132).
        torch.manual_seed(0)
        config = GiftConfig(layers=("fc2",), low_rank=4, gift_dtype="fp4", euclidean_dtype="fp4")
        _, after = backward_before_and_after(replicate(MLP()), config, "snap_fp4", {"fc2"}, torch.randn(4, 16))
        self.assertExpectedInline(render_gift_graph(after), """\
*         gift::agree(NS, GROUP, description=...)
fc2       gift::begin_step(NS, fc2, GROUP, d_out=8, d_in=32, whitened=True)
fc2       mm -> grad float32[8, 32]
fc2.bias  all_reduce(avg, GROUP) float32[8] -> wait  (original)
fc2       gift::load_basis(NS, fc2, d_in=32, low_rank=4)
fc2       gift::input_sketch()
fc2       all_reduce(sum, GROUP) float32[130] -> wait
fc2       gift::whitening_from_sketches(nystrom=True)
fc2       gift::meter(NS, fc2, GROUP, collective=all_reduce, op=avg)
fc2       gift::load_residual(NS, fc2, d_out=8, d_in=32)
fc2       gift::load_gather_residual(NS, fc2, rows=4, cols=32)
fc2       all_to_all_single(GROUP) uint8[152] -> wait
fc2       all_gather_into_tensor(GROUP) uint8[1, 76] -> wait
fc2       gift::end_step(NS, fc2, GROUP, bytes_sent=152, stats_bytes=520)
fc1       mm -> grad float32[32, 16]
fc1.bias  all_reduce(avg, GROUP) float32[32] -> wait  (original)
fc1       all_to_all_single(GROUP) uint8[296] -> wait
fc1       all_gather_into_tensor(GROUP) uint8[1, 148] -> wait
fc1       gift::record_euclidean(NS, fc1, path=fp4, bytes_sent=296)""")

    def test_input_statistics_are_sketched_before_the_gradient(self):
        # stats_source="inputs" (K-FAC's A): fc2's statistics start first thing in the backward,
        # before any gradient is computed, and their all_reduce is waited on only where the
        # gradient is sent; the factorization needs no gradient (compare the MLP snapshot).
        torch.manual_seed(0)
        config = GiftConfig(layers=("fc2",), low_rank=4, stats_source="inputs")
        _, after = backward_before_and_after(replicate(MLP()), config, "snap_input_stats", {"fc2"}, torch.randn(4, 16))
        self.assertExpectedInline(render_gift_graph(after), """\
*         gift::agree(NS, GROUP, description=...)
fc2       gift::begin_step(NS, fc2, GROUP, d_out=8, d_in=32, whitened=True)
fc2       gift::load_basis(NS, fc2, d_in=32, low_rank=4)
fc2       gift::input_sketch(max_tokens=8192)
fc2       all_reduce(sum, GROUP) float32[130]
fc2       mm -> grad float32[8, 32]
fc2.bias  all_reduce(avg, GROUP) float32[8] -> wait  (original)
fc2       wait_tensor(all_reduce)
fc2       gift::whitening_from_sketches()
fc2       gift::meter(NS, fc2, GROUP, collective=all_reduce, op=avg)
fc2       gift::load_residual(NS, fc2, d_out=8, d_in=32)
fc2       gift::load_gather_residual(NS, fc2, rows=4, cols=32)
fc2       all_to_all_single(GROUP) uint8[264] -> wait
fc2       all_gather_into_tensor(GROUP) uint8[1, 132] -> wait
fc2       gift::end_step(NS, fc2, GROUP, bytes_sent=264, stats_bytes=520)
fc1       mm -> grad float32[32, 16]
fc1.bias  all_reduce(avg, GROUP) float32[32] -> wait  (original)
fc1       all_to_all_single(GROUP) uint8[520] -> wait
fc1       all_gather_into_tensor(GROUP) uint8[1, 260] -> wait
fc1       gift::record_euclidean(NS, fc1, path=fp8, bytes_sent=520)""")

    def test_periodic_factors_are_loaded_not_computed(self):
        # factor_source="periodic": the factors come from the state (load_factors); no sketch,
        # no statistics all_reduce, no whitening_from_sketch, no next basis for end_step.
        torch.manual_seed(0)
        config = GiftConfig(layers=("fc2",), low_rank=4, factor_source="periodic")
        _, after = backward_before_and_after(replicate(MLP()), config, "snap_periodic", {"fc2"}, torch.randn(4, 16))
        self.assertExpectedInline(render_gift_graph(after), """\
*         gift::agree(NS, GROUP, description=...)
fc2       gift::begin_step(NS, fc2, GROUP, d_out=8, d_in=32, whitened=True)
fc2       mm -> grad float32[8, 32]
fc2.bias  all_reduce(avg, GROUP) float32[8] -> wait  (original)
fc2       gift::load_factors(NS, fc2, d_in=32, low_rank=4)
fc2       gift::meter(NS, fc2, GROUP, collective=all_reduce, op=avg)
fc2       gift::load_residual(NS, fc2, d_out=8, d_in=32)
fc2       gift::load_gather_residual(NS, fc2, rows=4, cols=32)
fc2       all_to_all_single(GROUP) uint8[264] -> wait
fc2       all_gather_into_tensor(GROUP) uint8[1, 132] -> wait
fc2       gift::end_step(NS, fc2, GROUP, next_basis=None, next_scale=None, bytes_sent=264, stats_bytes=0)
fc1       mm -> grad float32[32, 16]
fc1.bias  all_reduce(avg, GROUP) float32[32] -> wait  (original)
fc1       all_to_all_single(GROUP) uint8[520] -> wait
fc1       all_gather_into_tensor(GROUP) uint8[1, 260] -> wait
fc1       gift::record_euclidean(NS, fc1, path=fp8, bytes_sent=520)""")

    def test_joint_graph_sends_the_input_statistics_during_the_forward(self):
        # graph_trainer's own tracer (make_fx of forward + loss + backward, modules annotated
        # with their FQNs), input statistics: fc2's input is a forward node, so the sketch and its all_reduce
        # start in the forward, before fc2 itself runs; the wait comes only after fc2's weight
        # gradient exists, in the backward.
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
        config = GiftConfig(layers=("fc2",), low_rank=4, stats_source="inputs")
        register_runtime("snap_joint", config)
        assert len(gift_collectives_pass(graph, config, "snap_joint", frozenset({"fc2"}))) == 2  # fc2 whitened, fc1 FP8
        self.assertExpectedInline(render_gift_graph(graph), """\
*         gift::agree(NS, GROUP, description=...)
fc1       linear (forward) -> float32[4, 32]
fc2       gift::begin_step(NS, fc2, GROUP, d_out=8, d_in=32, whitened=True)
fc2       gift::load_basis(NS, fc2, d_in=32, low_rank=4)
fc2       gift::input_sketch(max_tokens=8192)
fc2       all_reduce(sum, GROUP) float32[130]
fc2       linear (forward) -> float32[4, 8]
-- backward --
fc2       mm -> grad float32[8, 32]
fc2.bias  all_reduce(avg, GROUP) float32[8] -> wait  (original)
fc2       wait_tensor(all_reduce)
fc2       gift::whitening_from_sketches()
fc2       gift::meter(NS, fc2, GROUP, collective=all_reduce, op=avg)
fc2       gift::load_residual(NS, fc2, d_out=8, d_in=32)
fc2       gift::load_gather_residual(NS, fc2, rows=4, cols=32)
fc2       all_to_all_single(GROUP) uint8[264] -> wait
fc2       all_gather_into_tensor(GROUP) uint8[1, 132] -> wait
fc2       gift::end_step(NS, fc2, GROUP, bytes_sent=264, stats_bytes=520)
fc1       mm -> grad float32[32, 16]
fc1.bias  all_reduce(avg, GROUP) float32[32] -> wait  (original)
fc1       all_to_all_single(GROUP) uint8[520] -> wait
fc1       all_gather_into_tensor(GROUP) uint8[1, 260] -> wait
fc1       gift::record_euclidean(NS, fc1, path=fp8, bytes_sent=520)""")

    def test_overlap_issues_each_collective_before_the_remaining_backward(self):
        # passes/overlap.py after the rewrite (as the backend and graph_trainer run it): every
        # gradient collective is issued as soon as its input exists, and its wait comes only
        # after the next gradient collective's issue, with the next layer's backward (its mm)
        # in between. Each layer's gradient sketch goes out as soon as its gradient exists and
        # is waited on after the next layer's gradient is computed and sketched.
        torch.manual_seed(0)
        attention = ("wq", "wk", "wv", "wo")
        config = GiftConfig(layers=attention, low_rank=4)
        _, after = backward_before_and_after(replicate(LlamaBlock()), config, "snap_overlap", set(attention), torch.randn(2, 8, 32))
        assert overlap_gradient_collectives(after) > 0
        self.assertExpectedInline(render_gift_graph(after), """\
*                      gift::agree(NS, GROUP, description=...)
wq                     gift::begin_step(NS, wq, GROUP, d_out=32, d_in=32, whitened=True)
wk                     gift::begin_step(NS, wk, GROUP, d_out=32, d_in=32, whitened=True)
wv                     gift::begin_step(NS, wv, GROUP, d_out=32, d_in=32, whitened=True)
wo                     gift::begin_step(NS, wo, GROUP, d_out=32, d_in=32, whitened=True)
w2                     mm -> grad float32[32, 64]
w2                     all_to_all_single(GROUP) uint8[2056]
w2                     gift::record_euclidean(NS, w2, path=fp8, bytes_sent=2056)
w3                     mm -> grad float32[64, 32]
w3                     all_to_all_single(GROUP) uint8[2056]
w2                     wait_tensor(all_to_all_single)
w2                     all_gather_into_tensor(GROUP) uint8[1, 1028]
w3                     gift::record_euclidean(NS, w3, path=fp8, bytes_sent=2056)
w1                     mm -> grad float32[64, 32]
w1                     all_to_all_single(GROUP) uint8[2056]
w3                     wait_tensor(all_to_all_single)
w3                     all_gather_into_tensor(GROUP) uint8[1, 1028]
w1                     gift::record_euclidean(NS, w1, path=fp8, bytes_sent=2056)
ffn_norm.weight        all_reduce(avg, GROUP) float32[32]  (original)
w2                     wait_tensor(all_gather_into_tensor)
w1                     wait_tensor(all_to_all_single)
w1                     all_gather_into_tensor(GROUP) uint8[1, 1028]
wo                     mm -> grad float32[32, 32]
wo                     gift::load_basis(NS, wo, d_in=32, low_rank=4)
wo                     gift::input_sketch()
wo                     all_reduce(sum, GROUP) float32[130]
w3                     wait_tensor(all_gather_into_tensor)
ffn_norm.weight        wait_tensor(all_reduce)
wv                     mm -> grad float32[32, 32]
wv                     gift::load_basis(NS, wv, d_in=32, low_rank=4)
wv                     gift::input_sketch()
wv                     all_reduce(sum, GROUP) float32[130]
w1                     wait_tensor(all_gather_into_tensor)
wo                     wait_tensor(all_reduce)
wo                     gift::whitening_from_sketches(nystrom=True)
wo                     gift::meter(NS, wo, GROUP, collective=all_reduce, op=avg)
wo                     gift::load_residual(NS, wo, d_out=32, d_in=32)
wo                     gift::load_gather_residual(NS, wo, rows=16, cols=32)
wo                     all_to_all_single(GROUP) uint8[1032]
wk                     mm -> grad float32[32, 32]
wk                     gift::load_basis(NS, wk, d_in=32, low_rank=4)
wk                     gift::input_sketch()
wk                     all_reduce(sum, GROUP) float32[130]
wv                     wait_tensor(all_reduce)
wv                     gift::whitening_from_sketches(nystrom=True)
wv                     gift::meter(NS, wv, GROUP, collective=all_reduce, op=avg)
wv                     gift::load_residual(NS, wv, d_out=32, d_in=32)
wv                     gift::load_gather_residual(NS, wv, rows=16, cols=32)
wv                     all_to_all_single(GROUP) uint8[1032]
wq                     mm -> grad float32[32, 32]
wq                     gift::load_basis(NS, wq, d_in=32, low_rank=4)
wq                     gift::input_sketch()
wq                     all_reduce(sum, GROUP) float32[130]
wo                     wait_tensor(all_to_all_single)
wo                     all_gather_into_tensor(GROUP) uint8[1, 516]
wk                     wait_tensor(all_reduce)
wk                     gift::whitening_from_sketches(nystrom=True)
wk                     gift::meter(NS, wk, GROUP, collective=all_reduce, op=avg)
wk                     gift::load_residual(NS, wk, d_out=32, d_in=32)
wk                     gift::load_gather_residual(NS, wk, rows=16, cols=32)
wk                     all_to_all_single(GROUP) uint8[1032]
attention_norm.weight  all_reduce(avg, GROUP) float32[32]  (original)
wv                     wait_tensor(all_to_all_single)
wv                     all_gather_into_tensor(GROUP) uint8[1, 516]
wq                     wait_tensor(all_reduce)
wq                     gift::whitening_from_sketches(nystrom=True)
wq                     gift::meter(NS, wq, GROUP, collective=all_reduce, op=avg)
wq                     gift::load_residual(NS, wq, d_out=32, d_in=32)
wq                     gift::load_gather_residual(NS, wq, rows=16, cols=32)
wq                     all_to_all_single(GROUP) uint8[1032]
wo                     wait_tensor(all_gather_into_tensor)
wo                     gift::end_step(NS, wo, GROUP, bytes_sent=1032, stats_bytes=520)
wk                     wait_tensor(all_to_all_single)
wk                     all_gather_into_tensor(GROUP) uint8[1, 516]
attention_norm.weight  wait_tensor(all_reduce)
wv                     wait_tensor(all_gather_into_tensor)
wv                     gift::end_step(NS, wv, GROUP, bytes_sent=1032, stats_bytes=520)
wk                     wait_tensor(all_gather_into_tensor)
wk                     gift::end_step(NS, wk, GROUP, bytes_sent=1032, stats_bytes=520)
wq                     wait_tensor(all_to_all_single)
wq                     all_gather_into_tensor(GROUP) uint8[1, 516] -> wait
wq                     gift::end_step(NS, wq, GROUP, bytes_sent=1032, stats_bytes=520)""")

    def test_a_block_sends_its_gradients_in_one_all_to_all_and_one_all_gather(self):
        # passes/bucketing.py: two blocks (layers.0, layers.1), each with fc2 whitened and fc1 on
        # Euclidean FP8. Per block, the two weight gradients' messages travel in one all_to_all
        # (520 + 520 bytes: fc2's and fc1's messages) and the re-encoded shards in one
        # all_gather, sent once the block's last gradient (fc1's) is encoded; everything that
        # reads their results (the decodes, fc2's end_step) comes after. The biases' fp32
        # all_reduces, which the pass leaves as they are, go in one per block too (16 + 32 floats).
        # With the inputs' statistics, both blocks' factorizations run back to back, before the
        # first of them is needed (gift_collectives.gather_factorizations), not each after its
        # layer's GEMM (the gradients' statistics, the default, exist only after it).
        torch.manual_seed(0)
        config = GiftConfig(layers=("fc2",), low_rank=4, stats_source="inputs")
        selected = {"layers.0.fc2", "layers.1.fc2"}
        _, after = backward_before_and_after(replicate(Stack(MLPBlock)), config, "snap_bucket", selected, torch.randn(4, 16))
        self.assertExpectedInline(render_gift_graph(after), """\
*             gift::agree(NS, GROUP, description=...)
layers.0.fc2  gift::begin_step(NS, layers.0.fc2, GROUP, d_out=16, d_in=32, whitened=True)
layers.0.fc2  gift::load_basis(NS, layers.0.fc2, d_in=32, low_rank=4)
layers.0.fc2  gift::input_sketch(max_tokens=8192)
layers.0.fc2  all_reduce(sum, GROUP) float32[130]
layers.1.fc2  gift::begin_step(NS, layers.1.fc2, GROUP, d_out=16, d_in=32, whitened=True)
layers.1.fc2  gift::load_basis(NS, layers.1.fc2, d_in=32, low_rank=4)
layers.1.fc2  gift::input_sketch(max_tokens=8192)
layers.1.fc2  all_reduce(sum, GROUP) float32[130]
layers.1.fc2  mm -> grad float32[16, 32]
layers.1.fc2  wait_tensor(all_reduce)
layers.1.fc2  gift::whitening_from_sketches()
layers.0.fc2  wait_tensor(all_reduce)
layers.0.fc2  gift::whitening_from_sketches()
layers.1.fc2  gift::meter(NS, layers.1.fc2, GROUP, collective=all_reduce, op=avg)
layers.1.fc2  gift::load_residual(NS, layers.1.fc2, d_out=16, d_in=32)
layers.1.fc2  gift::load_gather_residual(NS, layers.1.fc2, rows=8, cols=32)
layers.1.fc1  mm -> grad float32[32, 16]
layers.1.*    all_reduce(avg, GROUP) float32[48] -> wait  (original)
layers.1.*    all_to_all_single(GROUP) uint8[1040] -> wait
layers.1.*    all_gather_into_tensor(GROUP) uint8[520] -> wait
layers.1.fc2  gift::end_step(NS, layers.1.fc2, GROUP, bytes_sent=520, stats_bytes=520)
layers.1.fc1  gift::record_euclidean(NS, layers.1.fc1, path=fp8, bytes_sent=520)
layers.0.fc2  mm -> grad float32[16, 32]
layers.0.fc2  gift::meter(NS, layers.0.fc2, GROUP, collective=all_reduce, op=avg)
layers.0.fc2  gift::load_residual(NS, layers.0.fc2, d_out=16, d_in=32)
layers.0.fc2  gift::load_gather_residual(NS, layers.0.fc2, rows=8, cols=32)
layers.0.fc1  mm -> grad float32[32, 16]
layers.0.*    all_reduce(avg, GROUP) float32[48] -> wait  (original)
layers.0.*    all_to_all_single(GROUP) uint8[1040] -> wait
layers.0.*    all_gather_into_tensor(GROUP) uint8[520] -> wait
layers.0.fc2  gift::end_step(NS, layers.0.fc2, GROUP, bytes_sent=520, stats_bytes=520)
layers.0.fc1  gift::record_euclidean(NS, layers.0.fc1, path=fp8, bytes_sent=520)""")

    def test_a_blocks_factorizations_of_one_shape_run_as_one_op(self):
        # Gradient statistics with wv and wo whitened, both d_in = 32, in one bucket (the block,
        # layers.0): their sketches are summed in one all_reduce of 2 x 130 floats once wv's
        # gradient exists, and their factors come from one gift::whitening_from_sketches call
        # (batch_factorizations), after that wait and before either layer's meter. (fc1 and fc2
        # in the test above have different d_in, so each keeps its own call.)
        torch.manual_seed(0)
        config = GiftConfig(layers=("wv", "wo"), low_rank=4)
        _, after = backward_before_and_after(replicate(Stack(LlamaBlock, blocks=1)), config, "snap_factor_batch",
                                             {"layers.0.wv", "layers.0.wo"}, torch.randn(2, 8, 32))
        self.assertExpectedInline(render_gift_graph(after), """\
*            gift::agree(NS, GROUP, description=...)
layers.0.wv  gift::begin_step(NS, layers.0.wv, GROUP, d_out=32, d_in=32, whitened=True)
layers.0.wo  gift::begin_step(NS, layers.0.wo, GROUP, d_out=32, d_in=32, whitened=True)
layers.0.w2  mm -> grad float32[32, 64]
layers.0.w2  gift::record_euclidean(NS, layers.0.w2, path=fp8, bytes_sent=2056)
layers.0.w3  mm -> grad float32[64, 32]
layers.0.w3  gift::record_euclidean(NS, layers.0.w3, path=fp8, bytes_sent=2056)
layers.0.w1  mm -> grad float32[64, 32]
layers.0.w1  gift::record_euclidean(NS, layers.0.w1, path=fp8, bytes_sent=2056)
layers.0.wo  mm -> grad float32[16, 32]
layers.0.wo  gift::load_basis(NS, layers.0.wo, d_in=32, low_rank=4)
*            gift::input_sketch()
layers.0.wv  mm -> grad float32[32, 32]
layers.0.wv  gift::load_basis(NS, layers.0.wv, d_in=32, low_rank=4)
*            gift::input_sketch()
layers.0.*   all_reduce(sum, GROUP) float32[260] -> wait
*            gift::whitening_from_sketches(nystrom=True)
layers.0.wo  gift::meter(NS, layers.0.wo, GROUP, collective=all_reduce, op=avg)
layers.0.wo  gift::load_residual(NS, layers.0.wo, d_out=32, d_in=32)
layers.0.wo  gift::load_gather_residual(NS, layers.0.wo, rows=16, cols=32)
layers.0.wv  gift::meter(NS, layers.0.wv, GROUP, collective=all_reduce, op=avg)
layers.0.wv  gift::load_residual(NS, layers.0.wv, d_out=32, d_in=32)
layers.0.wv  gift::load_gather_residual(NS, layers.0.wv, rows=16, cols=32)
layers.0.wk  mm -> grad float32[32, 32]
layers.0.wk  gift::record_euclidean(NS, layers.0.wk, path=fp8, bytes_sent=1032)
layers.0.wq  mm -> grad float32[32, 32]
layers.0.*   all_to_all_single(GROUP) uint8[10296] -> wait
layers.0.*   all_gather_into_tensor(GROUP) uint8[5148] -> wait
layers.0.wo  gift::end_step(NS, layers.0.wo, GROUP, bytes_sent=1032, stats_bytes=520)
layers.0.wv  gift::end_step(NS, layers.0.wv, GROUP, bytes_sent=1032, stats_bytes=520)
layers.0.wq  gift::record_euclidean(NS, layers.0.wq, path=fp8, bytes_sent=1032)
layers.0.wo  all_reduce(avg, GROUP) float32[64] -> wait""")

    def test_a_block_sums_its_gradient_sketches_in_one_all_reduce(self):
        # The default, gradient statistics, with both Linear layers of each block whitened: a
        # block's messages travel together once its last gradient (fc1's) is encoded, so its
        # gradient sketches are summed together once fc1's exists (one all_reduce of 2 x 130
        # floats per block, batch_gradient_statistics); fc2's factors, meter and encoding move
        # after that wait, then fc1's.
        torch.manual_seed(0)
        config = GiftConfig(layers=("fc1", "fc2"), low_rank=4)
        selected = {"layers.0.fc1", "layers.0.fc2", "layers.1.fc1", "layers.1.fc2"}
        _, after = backward_before_and_after(replicate(Stack(MLPBlock)), config, "snap_gradient_batch", selected, torch.randn(4, 16))
        self.assertExpectedInline(render_gift_graph(after), """\
*             gift::agree(NS, GROUP, description=...)
layers.0.fc1  gift::begin_step(NS, layers.0.fc1, GROUP, d_out=32, d_in=16, whitened=True)
layers.0.fc2  gift::begin_step(NS, layers.0.fc2, GROUP, d_out=16, d_in=32, whitened=True)
layers.1.fc1  gift::begin_step(NS, layers.1.fc1, GROUP, d_out=32, d_in=16, whitened=True)
layers.1.fc2  gift::begin_step(NS, layers.1.fc2, GROUP, d_out=16, d_in=32, whitened=True)
layers.1.fc2  mm -> grad float32[16, 32]
layers.1.fc2  gift::load_basis(NS, layers.1.fc2, d_in=32, low_rank=4)
*             gift::input_sketch()
layers.1.fc1  mm -> grad float32[32, 16]
layers.1.*    all_reduce(avg, GROUP) float32[48] -> wait  (original)
layers.1.fc1  gift::load_basis(NS, layers.1.fc1, d_in=16, low_rank=4)
*             gift::input_sketch()
layers.1.*    all_reduce(sum, GROUP) float32[196] -> wait
*             gift::whitening_from_sketches(nystrom=True)
layers.1.fc2  gift::meter(NS, layers.1.fc2, GROUP, collective=all_reduce, op=avg)
layers.1.fc2  gift::load_residual(NS, layers.1.fc2, d_out=16, d_in=32)
layers.1.fc2  gift::load_gather_residual(NS, layers.1.fc2, rows=8, cols=32)
*             gift::whitening_from_sketches(nystrom=True)
layers.1.fc1  gift::meter(NS, layers.1.fc1, GROUP, collective=all_reduce, op=avg)
layers.1.fc1  gift::load_residual(NS, layers.1.fc1, d_out=32, d_in=16)
layers.1.fc1  gift::load_gather_residual(NS, layers.1.fc1, rows=16, cols=16)
layers.1.*    all_to_all_single(GROUP) uint8[1040] -> wait
layers.1.*    all_gather_into_tensor(GROUP) uint8[520] -> wait
layers.1.fc2  gift::end_step(NS, layers.1.fc2, GROUP, bytes_sent=520, stats_bytes=520)
layers.1.fc1  gift::end_step(NS, layers.1.fc1, GROUP, bytes_sent=520, stats_bytes=264)
layers.0.fc2  mm -> grad float32[16, 32]
layers.0.fc2  gift::load_basis(NS, layers.0.fc2, d_in=32, low_rank=4)
*             gift::input_sketch()
layers.0.fc1  mm -> grad float32[32, 16]
layers.0.*    all_reduce(avg, GROUP) float32[48] -> wait  (original)
layers.0.fc1  gift::load_basis(NS, layers.0.fc1, d_in=16, low_rank=4)
*             gift::input_sketch()
layers.0.*    all_reduce(sum, GROUP) float32[196] -> wait
*             gift::whitening_from_sketches(nystrom=True)
layers.0.fc2  gift::meter(NS, layers.0.fc2, GROUP, collective=all_reduce, op=avg)
layers.0.fc2  gift::load_residual(NS, layers.0.fc2, d_out=16, d_in=32)
layers.0.fc2  gift::load_gather_residual(NS, layers.0.fc2, rows=8, cols=32)
*             gift::whitening_from_sketches(nystrom=True)
layers.0.fc1  gift::meter(NS, layers.0.fc1, GROUP, collective=all_reduce, op=avg)
layers.0.fc1  gift::load_residual(NS, layers.0.fc1, d_out=32, d_in=16)
layers.0.fc1  gift::load_gather_residual(NS, layers.0.fc1, rows=16, cols=16)
layers.0.*    all_to_all_single(GROUP) uint8[1040] -> wait
layers.0.*    all_gather_into_tensor(GROUP) uint8[520] -> wait
layers.0.fc2  gift::end_step(NS, layers.0.fc2, GROUP, bytes_sent=520, stats_bytes=520)
layers.0.fc1  gift::end_step(NS, layers.0.fc1, GROUP, bytes_sent=520, stats_bytes=264)""")

    def test_llama_block_every_collective_is_accounted_for(self):
        # 9 parameters: 7 Linear weights (the 4 attention projections GIFT, w1/w2/w3 Euclidean
        # FP8 with error feedback: a residual, no statistics, no record_euclidean) and the 2
        # RMSNorm weights (their original fp32 all_reduce).
        torch.manual_seed(0)
        attention = ("wq", "wk", "wv", "wo")
        config = GiftConfig(layers=attention, low_rank=4, euclidean_error_feedback=True)
        before, after = backward_before_and_after(replicate(LlamaBlock()), config, "snap_block", set(attention), torch.randn(2, 8, 32))
        traced = render_gift_graph(before)
        assert traced.count("(original)") == 9 and traced.count("mm -> grad") == 7
        self.assertExpectedInline(render_gift_graph(after), """\
*                      gift::agree(NS, GROUP, description=...)
wq                     gift::begin_step(NS, wq, GROUP, d_out=32, d_in=32, whitened=True)
wk                     gift::begin_step(NS, wk, GROUP, d_out=32, d_in=32, whitened=True)
wv                     gift::begin_step(NS, wv, GROUP, d_out=32, d_in=32, whitened=True)
wo                     gift::begin_step(NS, wo, GROUP, d_out=32, d_in=32, whitened=True)
w1                     gift::begin_step(NS, w1, GROUP, d_out=64, d_in=32, whitened=False)
w3                     gift::begin_step(NS, w3, GROUP, d_out=64, d_in=32, whitened=False)
w2                     gift::begin_step(NS, w2, GROUP, d_out=32, d_in=64, whitened=False)
w2                     mm -> grad float32[32, 64]
w2                     gift::load_residual(NS, w2, d_out=32, d_in=64)
w2                     gift::load_gather_residual(NS, w2, rows=16, cols=64)
w2                     all_to_all_single(GROUP) uint8[2056] -> wait
w2                     all_gather_into_tensor(GROUP) uint8[1, 1028] -> wait
w2                     gift::end_step(NS, w2, GROUP, next_basis=None, next_scale=None, bytes_sent=2056, stats_bytes=0)
w3                     mm -> grad float32[64, 32]
w3                     gift::load_residual(NS, w3, d_out=64, d_in=32)
w3                     gift::load_gather_residual(NS, w3, rows=32, cols=32)
w3                     all_to_all_single(GROUP) uint8[2056] -> wait
w3                     all_gather_into_tensor(GROUP) uint8[1, 1028] -> wait
w3                     gift::end_step(NS, w3, GROUP, next_basis=None, next_scale=None, bytes_sent=2056, stats_bytes=0)
w1                     mm -> grad float32[64, 32]
w1                     gift::load_residual(NS, w1, d_out=64, d_in=32)
w1                     gift::load_gather_residual(NS, w1, rows=32, cols=32)
w1                     all_to_all_single(GROUP) uint8[2056] -> wait
w1                     all_gather_into_tensor(GROUP) uint8[1, 1028] -> wait
w1                     gift::end_step(NS, w1, GROUP, next_basis=None, next_scale=None, bytes_sent=2056, stats_bytes=0)
ffn_norm.weight        all_reduce(avg, GROUP) float32[32] -> wait  (original)
wo                     mm -> grad float32[32, 32]
wo                     gift::load_basis(NS, wo, d_in=32, low_rank=4)
wo                     gift::input_sketch()
wo                     all_reduce(sum, GROUP) float32[130] -> wait
wo                     gift::whitening_from_sketches(nystrom=True)
wo                     gift::meter(NS, wo, GROUP, collective=all_reduce, op=avg)
wo                     gift::load_residual(NS, wo, d_out=32, d_in=32)
wo                     gift::load_gather_residual(NS, wo, rows=16, cols=32)
wo                     all_to_all_single(GROUP) uint8[1032] -> wait
wo                     all_gather_into_tensor(GROUP) uint8[1, 516] -> wait
wo                     gift::end_step(NS, wo, GROUP, bytes_sent=1032, stats_bytes=520)
wv                     mm -> grad float32[32, 32]
wv                     gift::load_basis(NS, wv, d_in=32, low_rank=4)
wv                     gift::input_sketch()
wv                     all_reduce(sum, GROUP) float32[130] -> wait
wv                     gift::whitening_from_sketches(nystrom=True)
wv                     gift::meter(NS, wv, GROUP, collective=all_reduce, op=avg)
wv                     gift::load_residual(NS, wv, d_out=32, d_in=32)
wv                     gift::load_gather_residual(NS, wv, rows=16, cols=32)
wv                     all_to_all_single(GROUP) uint8[1032] -> wait
wv                     all_gather_into_tensor(GROUP) uint8[1, 516] -> wait
wv                     gift::end_step(NS, wv, GROUP, bytes_sent=1032, stats_bytes=520)
wk                     mm -> grad float32[32, 32]
wk                     gift::load_basis(NS, wk, d_in=32, low_rank=4)
wk                     gift::input_sketch()
wk                     all_reduce(sum, GROUP) float32[130] -> wait
wk                     gift::whitening_from_sketches(nystrom=True)
wk                     gift::meter(NS, wk, GROUP, collective=all_reduce, op=avg)
wk                     gift::load_residual(NS, wk, d_out=32, d_in=32)
wk                     gift::load_gather_residual(NS, wk, rows=16, cols=32)
wk                     all_to_all_single(GROUP) uint8[1032] -> wait
wk                     all_gather_into_tensor(GROUP) uint8[1, 516] -> wait
wk                     gift::end_step(NS, wk, GROUP, bytes_sent=1032, stats_bytes=520)
wq                     mm -> grad float32[32, 32]
wq                     gift::load_basis(NS, wq, d_in=32, low_rank=4)
wq                     gift::input_sketch()
wq                     all_reduce(sum, GROUP) float32[130] -> wait
wq                     gift::whitening_from_sketches(nystrom=True)
wq                     gift::meter(NS, wq, GROUP, collective=all_reduce, op=avg)
wq                     gift::load_residual(NS, wq, d_out=32, d_in=32)
wq                     gift::load_gather_residual(NS, wq, rows=16, cols=32)
wq                     all_to_all_single(GROUP) uint8[1032] -> wait
wq                     all_gather_into_tensor(GROUP) uint8[1, 516] -> wait
wq                     gift::end_step(NS, wq, GROUP, bytes_sent=1032, stats_bytes=520)
attention_norm.weight  all_reduce(avg, GROUP) float32[32] -> wait  (original)""")

    def test_gpt_block_fused_qkv(self):
        # GPT-2 names and shapes: the fused qkv projection attn.c_attn (32 -> 96) is one layer,
        # whitened on its 32 inputs like attn.c_proj; the MLP's Linear layers take Euclidean
        # FP8; every bias and both LayerNorms (weight and bias) keep their all_reduce.
        torch.manual_seed(0)
        attention = ("attn.c_attn", "attn.c_proj")
        config = GiftConfig(layers=attention, low_rank=4)
        _, after = backward_before_and_after(replicate(GPTBlock()), config, "snap_gpt", set(attention), torch.randn(2, 8, 32))
        self.assertExpectedInline(render_gift_graph(after), """\
*                 gift::agree(NS, GROUP, description=...)
attn.c_attn       gift::begin_step(NS, attn.c_attn, GROUP, d_out=96, d_in=32, whitened=True)
attn.c_proj       gift::begin_step(NS, attn.c_proj, GROUP, d_out=32, d_in=32, whitened=True)
mlp.c_proj        mm -> grad float32[32, 128]
mlp.c_proj.bias   all_reduce(avg, GROUP) float32[32] -> wait  (original)
mlp.c_proj        all_to_all_single(GROUP) uint8[4104] -> wait
mlp.c_proj        all_gather_into_tensor(GROUP) uint8[1, 2052] -> wait
mlp.c_proj        gift::record_euclidean(NS, mlp.c_proj, path=fp8, bytes_sent=4104)
mlp.c_fc          mm -> grad float32[128, 32]
mlp.c_fc.bias     all_reduce(avg, GROUP) float32[128] -> wait  (original)
mlp.c_fc          all_to_all_single(GROUP) uint8[4104] -> wait
mlp.c_fc          all_gather_into_tensor(GROUP) uint8[1, 2052] -> wait
mlp.c_fc          gift::record_euclidean(NS, mlp.c_fc, path=fp8, bytes_sent=4104)
ln_2.bias         all_reduce(avg, GROUP) float32[32] -> wait  (original)
ln_2.weight       all_reduce(avg, GROUP) float32[32] -> wait  (original)
attn.c_proj       mm -> grad float32[32, 32]
attn.c_proj.bias  all_reduce(avg, GROUP) float32[32] -> wait  (original)
attn.c_proj       gift::load_basis(NS, attn.c_proj, d_in=32, low_rank=4)
attn.c_proj       gift::input_sketch()
attn.c_proj       all_reduce(sum, GROUP) float32[130] -> wait
attn.c_proj       gift::whitening_from_sketches(nystrom=True)
attn.c_proj       gift::meter(NS, attn.c_proj, GROUP, collective=all_reduce, op=avg)
attn.c_proj       gift::load_residual(NS, attn.c_proj, d_out=32, d_in=32)
attn.c_proj       gift::load_gather_residual(NS, attn.c_proj, rows=16, cols=32)
attn.c_proj       all_to_all_single(GROUP) uint8[1032] -> wait
attn.c_proj       all_gather_into_tensor(GROUP) uint8[1, 516] -> wait
attn.c_proj       gift::end_step(NS, attn.c_proj, GROUP, bytes_sent=1032, stats_bytes=520)
attn.c_attn       mm -> grad float32[96, 32]
attn.c_attn.bias  all_reduce(avg, GROUP) float32[96] -> wait  (original)
attn.c_attn       gift::load_basis(NS, attn.c_attn, d_in=32, low_rank=4)
attn.c_attn       gift::input_sketch()
attn.c_attn       all_reduce(sum, GROUP) float32[130] -> wait
attn.c_attn       gift::whitening_from_sketches(nystrom=True)
attn.c_attn       gift::meter(NS, attn.c_attn, GROUP, collective=all_reduce, op=avg)
attn.c_attn       gift::load_residual(NS, attn.c_attn, d_out=96, d_in=32)
attn.c_attn       gift::load_gather_residual(NS, attn.c_attn, rows=48, cols=32)
attn.c_attn       all_to_all_single(GROUP) uint8[3080] -> wait
attn.c_attn       all_gather_into_tensor(GROUP) uint8[1, 1540] -> wait
attn.c_attn       gift::end_step(NS, attn.c_attn, GROUP, bytes_sent=3080, stats_bytes=520)
ln_1.bias         all_reduce(avg, GROUP) float32[32] -> wait  (original)
ln_1.weight       all_reduce(avg, GROUP) float32[32] -> wait  (original)""")


def _forward_all_gathers(prefetch: bool) -> fx.Graph:
    """Two parameters all-gathered and used in turn: each waited where it is issued, or the
    second issued before the first's wait (graph_trainer's FSDP prefetch order)."""
    graph, c10d = fx.Graph(), torch.ops._c10d_functional
    x, p0, p1 = (graph.placeholder(name) for name in ("x", "p0", "p1"))
    gather = lambda p: graph.call_function(c10d.all_gather_into_tensor.default, (p, 2, "GROUP"))
    wait = lambda g: graph.call_function(c10d.wait_tensor.default, (g,))
    if prefetch:
        g0, g1 = gather(p0), gather(p1)
        h = graph.call_function(torch.ops.aten.mm.default, (x, wait(g0)))
        out = graph.call_function(torch.ops.aten.mm.default, (h, wait(g1)))
    else:
        h = graph.call_function(torch.ops.aten.mm.default, (x, wait(gather(p0))))
        out = graph.call_function(torch.ops.aten.mm.default, (h, wait(gather(p1))))
    graph.output(out)
    return graph


def test_prefetched_all_gathers_counts_those_in_flight_before_an_earlier_wait():
    # The figure graph_trainer's final graph is logged with: 0 when every all-gather is waited
    # right where it is issued, 1 when the second goes out before the first is waited on.
    assert prefetched_all_gathers(_forward_all_gathers(prefetch=False)) == 0
    assert prefetched_all_gathers(_forward_all_gathers(prefetch=True)) == 1


def test_untouched_when_euclidean_is_fp32_and_nothing_selected():
    torch.manual_seed(0)
    before, after = backward_before_and_after(
        replicate(MLP()), GiftConfig(layers=("fc2",), euclidean_dtype="fp32"), "snap_fp32", set(), torch.randn(4, 16)
    )
    assert normalized_code(before) == normalized_code(after)


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


@pytest.mark.parametrize(
    "fqn, bucket",
    [
        ("layers.3.attention.qkv_linear.wqkv", "layers.3.attention"),  # torchtitan's Llama: the attention's
        ("layers.3.attention.wo", "layers.3.attention"),  # two Linears travel together,
        ("layers.3.feed_forward.w2", "layers.3.feed_forward"),  # the feed-forward's three apart from them
        ("h.2.attn.c_attn", "h.2.attn"),  # Hugging Face GPT-2
        ("layers.0.fc1", "layers.0"),  # a Linear directly in its block
        ("output", "output"),  # outside any block: alone (the output projection's gradient is the
        ("tok_embeddings", "tok_embeddings"),  # backward's first, the embedding's its last)
    ],
)
def test_a_gradient_travels_with_the_other_layers_of_its_block_module(fqn, bucket):
    assert bucket_of(fqn) == bucket
