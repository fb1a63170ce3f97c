"""The compiled GIFT path on real gloo ranks against the eager reference of Algorithm 1.

Both run the same step (layer_step.py) and reduce with the same collectives, so Linear weight
gradients agree bit for bit; the pass is what is under test (right layer, right inputs, ops
in the right order, state reached at run time through a warm FX cache). The algorithm itself
is checked against an independent oracle in test_oracle.py.
Biases go through gloo's fp32 all_reduce('avg') in the compiled graph and sum-then-divide
in the reference: they agree to fp32 rounding (relative 1e-6).
"""

import copy
import functools
import os

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from gift_compile import GiftConfig, GiftReducer, GiftReference, gift_backend, replicate
from gift_compile.testing.ranks import run_on_ranks
from gift_compile.counters import LayerCounters, counters_table
from models import MLP, LlamaBlock, MLPBlock, Stack

CONFIG = GiftConfig(layers=("fc2",), low_rank=4, meter_interval=5)
PERIODIC = CONFIG.replace(factor_source="periodic", refresh_interval=5)
STEPS = 30


def batch(step, rank, width=16):
    return torch.randn(4, 6, width, generator=torch.Generator().manual_seed(1000 * step + rank))


def strip_parametrization(name):
    return name.replace(".parametrizations.", ".").replace(".original", "")


def train_side_by_side(rank, world, cache_root, steps, name, config=CONFIG):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_root  # shared by the ranks: each kernel is built once
    counters.clear()
    torch.manual_seed(0)
    model = MLP()
    reference_model = copy.deepcopy(model)
    reference = GiftReference(reference_model, config)
    backend = gift_backend(config, name=name)
    compiled = torch.compile(replicate(model), backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    worst = {"weight": 0.0, "bias": 0.0}
    dampings = []  # (compiled, reference) after each step: adaptive_damping's moves
    for step in range(steps):
        x = batch(step, rank)
        compiled(x).square().mean().backward()
        reference_model(x).square().mean().backward()
        reference.reduce_gradients()
        dampings.append((backend.runtime.state.layer("fc2").damping, reference.runtime.state.layer("fc2").damping))
        for pname, param in model.named_parameters():
            want = reference_model.get_parameter(strip_parametrization(pname)).grad
            kind = "weight" if pname.endswith("weight.original") else "bias"
            worst[kind] = max(worst[kind], ((param.grad - want).norm() / want.norm()).item())
        optimizer.step()
        optimizer.zero_grad()
        reference_model.zero_grad()
        with torch.no_grad():  # keep the reference on the compiled model's trajectory
            for pname, param in model.named_parameters():
                reference_model.get_parameter(strip_parametrization(pname)).copy_(param)
    runtime = backend.runtime
    return {
        "worst": worst,
        "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "pass_calls": sum(p.calls for p in backend.passes),
        "fc2": runtime.counters["fc2"].as_dict(),
        "fc1": runtime.counters["fc1"].as_dict(),
        "reference_fc2": reference.runtime.counters["fc2"].as_dict(),
        "checksum": runtime.state.checksum(),
        "dampings": dampings,
        "final_weight": model.fc2.weight.detach().clone(),
    }


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("inductor_cache"))


@pytest.fixture(scope="module")
def cold_run(cache_root, ranks):
    return ranks(2).run(train_side_by_side, cache_root, STEPS, "cold")


def test_compiled_gradients_match_the_eager_reference(cold_run):
    for result in cold_run:
        assert result["worst"]["weight"] == 0.0  # bit for bit, every step, both layers
        assert result["worst"]["bias"] < 1e-6


@pytest.mark.parametrize("fp4_format", ["nvfp4", "mxfp4"])
def test_fp4_compiled_gradients_match_the_eager_reference(tmp_path, ranks, fp4_format):
    # Every Linear weight on FP4: fc2 whitened (sender and shard owner in FP4, each with error
    # feedback), fc1 Euclidean FP4. Inductor fuses the E2M1 rounding and nibble packing; the
    # reference runs them eagerly: the same bits.
    config = CONFIG.replace(gift_dtype="fp4", euclidean_dtype="fp4", fp4_format=fp4_format)
    for result in ranks(2).run(train_side_by_side, str(tmp_path), 8, f"fp4-{fp4_format}", config):
        assert result["worst"]["weight"] == 0.0 and result["worst"]["bias"] < 1e-6
        assert result["fc2"]["path"] == "gift-fp4" and result["fc1"]["path"] == "fp4"
        # fc1 (32 x 16) all-reduced on 2 ranks: FP8 sends 2 x (256 + 4) bytes a step; FP4 4.5 or
        # 4.25 bits a value (2 x (128 + 16 + 4) or 2 x (128 + 8)): under 0.6x of that
        assert result["fc1"]["bytes_sent"] / 8 <= 0.6 * 2 * (256 + 4)


def test_input_statistics_compiled_match_the_eager_reference(cache_root, ranks):
    # stats_source = "inputs": the graph sketches each selected layer's input after the
    # forward and sums it while the backward runs (with the default, the gradients' statistics,
    # it sketches the gradient where its reduction was: the tests above); the reference does
    # the same eagerly (the numbers themselves: test_oracle.py). Bit for bit, every step.
    config = CONFIG.replace(stats_source="inputs")
    for result in ranks(2).run(train_side_by_side, cache_root, 10, "input-stats", config):
        assert result["worst"]["weight"] == 0.0 and result["worst"]["bias"] < 1e-6
        assert result["fc2"]["stats_bytes"] == result["reference_fc2"]["stats_bytes"] > 0


def test_adaptive_damping_moves_the_same_way_compiled_and_eager(cache_root, ranks):
    # The damping is state, read by the graph at run time (gift::load_basis) and moved from the
    # summed meter readings: compiled and eager move it identically, every rank alike, and the
    # gradients stay bit for bit the reference's while it moves.
    config = CONFIG.replace(adaptive_damping=True)
    results = ranks(2).run(train_side_by_side, cache_root, STEPS, "adaptive", config)
    for result in results:
        assert result["worst"]["weight"] == 0.0
        compiled, reference = zip(*result["dampings"])
        assert compiled == reference and len(set(compiled)) >= 3  # 6 readings: it moved
    assert results[0]["dampings"] == results[1]["dampings"]


def test_counters_report_every_step(cold_run):
    for result in cold_run:
        fc2, fc1 = result["fc2"], result["fc1"]
        assert fc2["path"] == "gift" and fc1["path"] == "fp8"
        assert fc2["steps"] == STEPS and fc1["steps"] == STEPS
        assert fc2["bytes_sent"] == STEPS * fc2["bytes_sent"] // fc2["steps"] > 0
        assert fc2["stats_bytes"] > 0 and fc1["stats_bytes"] == 0  # the current-step sketch all-reduce
        assert 0 < fc2["last_rel_error"] < 2.0**-4  # one e4m3 rounding, in the gradient's coordinates
        assert fc2["error_vs_fp8"] is not None and fc1["error_vs_fp8"] is None
        # The meter in the graph (gift::meter before the reduction, end_step after it) reads what
        # the eager reference reads: same sketch, same shadow, bit-identical delivered gradients.
        reference = result["reference_fc2"]
        assert (fc2["error_vs_fp8"], fc2["accumulated_vs_fp8"]) == (reference["error_vs_fp8"], reference["accumulated_vs_fp8"])
        assert fc2["accumulated_vs_fp8"] is not None  # error feedback is on
    assert cold_run[0]["checksum"] == cold_run[1]["checksum"]  # same basis on both ranks
    assert torch.equal(cold_run[0]["final_weight"], cold_run[1]["final_weight"])


def test_a_single_rank_with_periodic_factors_matches_the_reference(tmp_path, ranks):
    # One process on one GPU is a common first run: every collective is then a local copy
    # and the FP8 messages of the all-to-all sit back to back in one row.
    (result,) = ranks(1).run(train_side_by_side, str(tmp_path), 12, "single", PERIODIC)
    assert result["worst"]["weight"] == 0.0 and result["worst"]["bias"] < 1e-6
    assert result["fc2"]["path"] == "gift" and result["fc2"]["refreshes"] == 3
    assert result["fc2"]["last_refresh_step"] == 10


def test_counters_sum_hits_and_keep_the_last_error():
    counter = LayerCounters("gift")
    assert counter.saturated == 0 and counter.last_rel_error is None
    # [saturated, flushed, ||err||^2, ||sent||^2] on the wire, then the same in G's coordinates,
    # then the residuals the guard dropped
    stats = torch.tensor([3.0, 5.0, 9.0, 9.0, 4.0, 16.0, 2.0])
    counter.add_step(stats, bytes_sent=100, stats_bytes=10)
    stats.copy_(torch.tensor([1.0, 0.0, 9.0, 9.0, 1.0, 100.0, 1.0]))  # the graph may reuse its stats buffer
    assert counter.last_rel_error == 0.5
    counter.add_step(stats, bytes_sent=100, stats_bytes=10)
    assert (counter.steps, counter.bytes_sent, counter.stats_bytes, counter.saturated, counter.flushed) == (2, 200, 20, 4, 5)
    assert counter.last_rel_error == 0.1 and counter.residuals_dropped == 3
    assert counter.as_dict()["flushed"] == 5 and "residuals dropped" in counters_table({"fc": counter})


def test_warm_cache_in_a_new_process_still_matches(cold_run, cache_root):
    # New processes, the same cache dir: Inductor replays the cached graphs without
    # running the pass, and the state is still reached (and refreshed) at run time.
    warm = run_on_ranks(train_side_by_side, 2, cache_root, 12, "cold")
    # The cold run ran the pass (the module's cache starts empty): on both ranks, or on one
    # while the other found the graphs its peer had just written.
    assert all(r["pass_calls"] + r["cache_hits"] == 2 for r in cold_run)  # forward and backward graphs
    assert sum(r["pass_calls"] for r in cold_run) >= 2
    for result in warm:
        assert result["cache_hits"] == 2 and result["pass_calls"] == 0
        assert result["worst"]["weight"] == 0.0 and result["fc2"]["stats_bytes"] > 0


def stacked_steps(rank, world, cache_root, layers, variants, block=MLPBlock, blocks=3, steps=3):
    """Blocks ``layers.i`` with ``layers`` whitened and the other on Euclidean FP8, trained from the
    same start once per variant (a name and its config overrides); per variant, the gradients of
    each step and the collectives the pass issued."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_root
    grads, calls = {}, {}
    for name, overrides in variants.items():
        torch.manual_seed(0)
        model = Stack(block, blocks)
        backend = gift_backend(CONFIG.replace(layers=layers, **overrides), name=f"stack-{'-'.join(layers)}-{name}")
        compiled = torch.compile(replicate(model), backend=backend, fullgraph=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        grads[name] = []
        for step in range(steps):
            compiled(batch(step, rank, width=model.layers[0].fc1.in_features)).square().mean().backward()
            grads[name].append({n: p.grad.clone() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        calls[name] = sum(c for p in backend.passes for c in p.collective_calls)
    return grads, calls


BLOCKS = 3
WIDE_BLOCK = functools.partial(MLPBlock, 64, 128)
"""64 -> 128 -> 64: each block's bucket carries fc1's and fc2's 8,192 FP8 codes, so 8 KiB and a
few scale bytes per destination in its all_to_all and per rank in its all-gather (an all_to_all
on gloo either way); alone, each gradient's message is half that. Both stay whole at the
default ``wire_piece_kib`` (128)."""


@pytest.fixture(scope="module")
def fc2_stacks(tmp_path_factory, ranks):
    """Three wide blocks with ``fc2`` whitened, trained three ways from one start (one compile
    each, shared by the tests below): one collective per gradient, bucketed per block, and
    bucketed with every message in 4 KiB pieces."""
    variants = {"alone": {"bucket": False}, "bucketed": {}, "pieces": {"wire_piece_kib": 4}}
    return ranks(2).run(stacked_steps, str(tmp_path_factory.mktemp("stacks")), ("fc2",), variants, WIDE_BLOCK, BLOCKS)


def assert_same_gradients(grads, a, b):
    """Every gradient of variant ``a`` equals variant ``b``'s bit for bit, at every step."""
    for left, right in zip(grads[a], grads[b], strict=True):
        assert left.keys() == right.keys()
        for name in left:
            assert torch.equal(left[name], right[name]), (a, b, name)


def assert_bucketed(results, fewer):
    for grads, calls in results:
        assert_same_gradients(grads, "bucketed", "alone")
        assert calls["alone"] - calls["bucketed"] == fewer * BLOCKS
    for name, grad in results[0][0]["bucketed"][-1].items():
        assert torch.equal(grad, results[1][0]["bucketed"][-1][name]), name  # the ranks agree


# One all_to_all and one all_gather per block carry the bytes each gradient's own would
# (passes/bucketing.py), and one fp32 all_reduce the two biases: every gradient the same bit for
# bit at every step (the whitened layers with their state and error feedback too; two ranks add
# each bias element in one order either way), on both ranks, with three collectives fewer per
# block than one per gradient (fc1's and fc2's all_to_all and all_gather: 4 -> 2; the biases'
# all_reduce: 2 -> 1).
def test_bucketed_blocks_deliver_the_same_gradients_in_fewer_collectives(fc2_stacks):
    assert_bucketed(fc2_stacks, fewer=3)


def test_bucketed_blocks_with_both_layers_whitened_sum_their_sketches_together(tmp_path, ranks):
    # With both layers whitened, their gradient sketches are summed in one all_reduce too (2 -> 1): four fewer.
    variants = {"alone": {"bucket": False}, "bucketed": {}}
    assert_bucketed(ranks(2).run(stacked_steps, str(tmp_path), ("fc1", "fc2"), variants), fewer=4)


def test_messages_sent_in_pieces_deliver_the_same_gradients(fc2_stacks):
    # With wire_piece_kib = 4 each block's 8 KiB messages go in 3 calls (passes/pieces.py): 4 more
    # per block. The gradients are those of one call per message, bit for bit, at every step
    # (tests/test_pieces.py compares the all-gather with gloo's own).
    for grads, calls in fc2_stacks:
        assert_same_gradients(grads, "pieces", "bucketed")
        assert calls["pieces"] - calls["bucketed"] == 4 * BLOCKS


def train_with_checkpoint(rank, world, cache_root):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_root

    def fresh(name):
        torch.manual_seed(0)
        model = replicate(MLP())
        backend = gift_backend(CONFIG, name=name)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        return model, compiled, torch.optim.Adam(model.parameters(), lr=1e-2), backend

    def run(model, compiled, optimizer, steps):
        losses = []
        for step in steps:
            loss = compiled(batch(step, rank)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    model, compiled, optimizer, backend = fresh("straight")
    straight = run(model, compiled, optimizer, range(4))
    snapshot = copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict(), "gift": backend.state.state_dict()})
    straight += run(model, compiled, optimizer, range(4, 10))

    model, compiled, optimizer, backend = fresh("resumed")
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optim"])
    backend.state.load_state_dict(snapshot["gift"])
    resumed = run(model, compiled, optimizer, range(4, 10))
    return straight[4:], resumed


def test_checkpoint_and_resume_reproduces_the_losses(cache_root, ranks):
    for straight, resumed in ranks(2).run(train_with_checkpoint, cache_root):
        assert straight == resumed  # exact: same state, same ops, same order


class DTensorLinear(nn.Linear):
    """A Linear whose parameters are Replicate DTensors with Partial('avg') gradients (SimpleFSDP style)."""

    def forward(self, x):
        from torch.distributed.tensor import Partial, Replicate

        def local(p):
            return p.redistribute(p.device_mesh, [Replicate()]).to_local(grad_placements=[Partial("avg")])

        return nn.functional.linear(x, local(self.weight), local(self.bias))


def dtensor_step(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.manual_seed(0)
    reference_model = MLP()
    model = MLP()
    model.fc1 = DTensorLinear(16, 32)
    model.fc2 = DTensorLinear(32, 8)
    mesh = init_device_mesh("cpu", (world,))
    for (pname, param), ref in zip(model.named_parameters(), reference_model.parameters()):
        module = model.get_submodule(pname.rsplit(".", 1)[0])
        setattr(module, pname.rsplit(".", 1)[1], nn.Parameter(distribute_tensor(ref.detach().clone(), mesh, [Replicate()])))
    reference = GiftReference(reference_model, CONFIG)
    compiled = torch.compile(model, backend=gift_backend(CONFIG, name="dtensor"), fullgraph=True)
    x = batch(0, rank)
    compiled(x).square().mean().backward()
    reference_model(x).square().mean().backward()
    reference.reduce_gradients()
    return {n: (p.grad.to_local() - r.grad).abs().max().item() for (n, p), r in zip(model.named_parameters(), reference_model.parameters())}


def test_dtensor_replicate_route_matches_the_reference(ranks):
    for diffs in ranks(2).run(dtensor_step):
        assert diffs["fc1.weight"] == 0.0 and diffs["fc2.weight"] == 0.0
        assert diffs["fc1.bias"] < 1e-5 and diffs["fc2.bias"] < 1e-5


def non_finite_step(rank, world):
    torch.manual_seed(0)
    compiled = torch.compile(replicate(MLP()), backend=gift_backend(CONFIG, name="nan"), fullgraph=True)
    x = batch(0, rank)
    if rank == 0:
        x[0, 0, 0] = float("nan")
    compiled(x).square().mean().backward()
    model = compiled._orig_mod
    return {n: bool(torch.isfinite(p.grad).all()) for n, p in model.named_parameters()}


def test_non_finite_gradients_propagate_to_every_rank(ranks):
    for finite in ranks(2).run(non_finite_step):
        assert not any(finite.values())  # every reduced gradient shows the NaN, no crash


def ddp_compiled_autograd_steps(rank, world, cache_root, steps=3, blocks=3):
    """DDP with the python reducer: its all_reduces live in the compiled-autograd graph."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_root
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    torch.manual_seed(0)
    model = Stack(MLPBlock, blocks)
    reference_model = copy.deepcopy(model)
    reference = GiftReference(reference_model, CONFIG)
    backend = gift_backend(CONFIG, name="ddp")
    ddp = nn.parallel.DistributedDataParallel(model)

    @torch.compile(backend=backend)
    def train_step(x):
        ddp(x).square().mean().backward()

    diffs = []
    for step in range(steps):
        x = batch(step, rank)
        train_step(x)
        reference_model(x).square().mean().backward()
        reference.reduce_gradients()
        diffs.append({n: (p.grad - r.grad).abs().max().item() for (n, p), r in zip(model.named_parameters(), reference_model.parameters())})
        model.zero_grad()
        reference_model.zero_grad()
    paths = {fqn: (c.path, c.steps) for fqn, c in backend.runtime.counters.items()}
    return diffs, paths, sum(c for p in backend.passes for c in p.collective_calls)


def test_ddp_compiled_autograd_route_matches_the_reference(cache_root, ranks):
    for diffs, paths, collectives in ranks(2).run(ddp_compiled_autograd_steps, cache_root):
        # Layers are found through the parameters the compiled-autograd graph accumulates into;
        # DDP's FQNs carry its "module." prefix, which the trailing-component pattern "fc2" matches.
        assert paths == {f"module.layers.{i}.{fc}": (path, 3) for i in range(3) for fc, path in (("fc1", "fp8"), ("fc2", "gift"))}
        for step in diffs:  # same codec and transforms as the reference: bit-exact weights
            for name, diff in step.items():
                # DDP divides by the world size before its fp32 sum, the reference after: rounding only.
                assert diff == 0.0 if name.endswith("weight") else diff < 1e-5, name
        # Per block one all_to_all and one all_gather carry fc1's and fc2's bytes (bucketed:
        # passes/bucketing.py, while the reference sends each alone), one all_reduce the
        # statistics, and the two biases their own fp32 all_reduce.
        assert collectives == 3 * (2 + 1 + 2)


class BrokenMLP(MLP):
    """fc1 and fc2 in two Dynamo graphs (a graph break between them), as real models often are."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h)


def graph_break_steps(rank, world, layers):
    torch.manual_seed(0)
    backend = gift_backend(GiftConfig(layers=layers, low_rank=4), name=f"break-{layers}")
    compiled = torch.compile(replicate(BrokenMLP()), backend=backend)
    try:
        for step in range(3):
            compiled(batch(step, rank)).square().mean().backward()
    except Exception as error:  # the pattern check surfaces from the first backward's compile
        return str(error), len(backend.passes)
    return {fqn: (c.path, c.steps) for fqn, c in backend.runtime.counters.items()}, len(backend.passes)


def test_a_graph_break_keeps_the_selection_per_model(ranks):
    for paths, graphs in ranks(2).run(graph_break_steps, ("fc2",)):
        assert graphs == 2  # two forward graphs: fc1's and fc2's
        assert paths == {"fc1": ("fp8", 3), "fc2": ("gift", 3)}
    for message, _ in ranks(2).run(graph_break_steps, ("nomatch",)):
        # One error for the model, naming the Linear layers of every graph (not a per-graph one).
        assert "['nomatch'] match no Linear layer" in message and "['fc1', 'fc2']" in message


SHARED = GiftConfig(low_rank=4, meter_interval=2, stats_source="inputs")  # every Linear whitened; sharing is for input statistics
SHARED_STEPS = 5


class Gated(nn.Module):
    """up and gate read one input. Every op between the loss and a weight gradient is exact
    elementwise (relu's mask, a product) or the weight-gradient mm, so the compiled and eager
    local gradients are equal and the reductions can agree bit for bit."""

    def __init__(self):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * self.gate(x))


def shared_input_steps(rank, world, model_type):
    """Layers that read one input (up and gate; or a Llama block's q, k, v and w1, w3), every
    Linear whitened: compiled, in the eager reference (which shares statistics the same way),
    and layer by layer with no sharing at all."""
    torch.manual_seed(0)
    model = model_type()
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    reference_model, alone_model = copy.deepcopy(model), copy.deepcopy(model)
    reference, alone = GiftReference(reference_model, SHARED), GiftReducer(SHARED)
    inputs = {}
    for fqn in linears:
        alone_model.get_submodule(fqn).register_forward_hook(lambda m, args, out, fqn=fqn: inputs.__setitem__(fqn, args[0].detach()))
    backend = gift_backend(SHARED, name=f"shared-{model_type.__name__}")
    compiled = torch.compile(replicate(model), backend=backend, fullgraph=True)
    worst = {"compiled vs reference": 0.0, "reference vs alone": 0.0}
    for step in range(SHARED_STEPS):
        x = torch.randn(2, 8, model.get_submodule(linears[0]).in_features, generator=torch.Generator().manual_seed(100 * step + rank))
        for m in (compiled, reference_model, alone_model):
            m(x).square().mean().backward()
        reference.reduce_gradients()
        for fqn in linears:
            grad = alone_model.get_submodule(fqn).weight.grad
            delivered = alone.reduce_layer(fqn, grad, inputs[fqn].reshape(-1, grad.shape[1]))
            want = reference_model.get_submodule(fqn).weight.grad
            got = model.get_parameter(f"{fqn}.parametrizations.weight.original").grad
            worst["compiled vs reference"] = max(worst["compiled vs reference"], ((got - want).norm() / want.norm()).item())
            worst["reference vs alone"] = max(worst["reference vs alone"], (delivered - want).abs().max().item())
        for m in (model, reference_model, alone_model):
            m.zero_grad()
    stats = {name: {fqn: r.counters[fqn].stats_bytes for fqn in linears}
             for name, r in (("compiled", backend.runtime), ("reference", reference.runtime), ("alone", alone.runtime))}
    return worst, stats


@pytest.mark.parametrize("model_type, readers", [(Gated, [{"up", "gate"}]), (LlamaBlock, [{"wq", "wk", "wv"}, {"w1", "w3"}])])
def test_layers_reading_one_input_send_one_sketch_and_get_the_same_gradients(ranks, model_type, readers):
    # Sharing changes no number (the sketches, sums and subspace iterations of layers with one
    # input are equal, layer_step.py): the reference and the layer-by-layer steps agree bit for
    # bit, and so does the compiled model where its local gradients equal eager's (Gated).
    # The Llama block's compiled attention and norms round differently from eager, which moves
    # a few gradient elements across an FP8 rounding boundary (one FP8 step, <= 1/8 of the
    # element, each; error feedback carries it on): measured 4.8e-3 relative over 5 steps, where
    # the codec's own error against the exact average is 4-6% here. The bound, 1.5e-2, is a
    # quarter of that: using another layer's factors would still deliver an average, but not this one.
    # What sharing changes is that one layer of each group sends the statistics.
    for worst, stats in ranks(2).run(shared_input_steps, model_type):
        assert worst["reference vs alone"] == 0.0
        assert worst["compiled vs reference"] == 0.0 if model_type is Gated else worst["compiled vs reference"] < 1.5e-2
        saved = 0
        for group in readers:
            one_sketch = stats["alone"][next(iter(group))]
            assert one_sketch > 0 and all(stats["alone"][fqn] == one_sketch for fqn in group)
            saved += (len(group) - 1) * one_sketch
            for route in ("compiled", "reference"):
                assert sorted(stats[route][fqn] for fqn in group) == [0] * (len(group) - 1) + [one_sketch], (route, stats[route])
        for route in ("compiled", "reference"):
            assert sum(stats[route].values()) == sum(stats["alone"].values()) - saved
