"""GIFT's FSDP2 reduce-scatter against the eager reference, on real gloo ranks.

A model mixing a selected Linear (with a bias), an unselected Linear, an embedding and a norm
is ``fully_shard``-ed with one parameter group per submodule and one for the root; its
gradients come back sharded by FSDP through :class:`gift_compile.fsdp.GiftReduceScatter`.
The reference reduces each rank's full local gradient (from an unsharded replica) with the
library's eager path. Both run the same per-layer step, so selected and FP8 weights agree bit
for bit; 1-D parameters keep the reduce dtype (fp32: exact to rounding).
"""

import copy

import pytest
import torch
from torch import nn

from gift_compile import GiftConfig
from gift_compile.collectives import WireFormat
from gift_compile.comm import euclidean_reduce
from gift_compile.fsdp import install
from gift_compile.reference import GiftReducer
from gift_compile.runtime import register_runtime
from models import LlamaBlock


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.up = nn.Linear(24, 37)  # 37 rows: padding on 2 and 3 ranks
        self.down = nn.Linear(37, 24, bias=False)
        self.norm = nn.LayerNorm(24)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.norm(self.down(torch.relu(self.up(h)))).square().sum()


def sharded_mixed(world, config, namespace, reduce_dtype=torch.float32, selected=("up",), **install_options):
    """``(Mixed fully_shard-ed per submodule with GIFT installed, unsharded replica, runtime)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Mixed()
    replica = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for name in ("embed", "up", "down", "norm"):
        fully_shard(getattr(model, name), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    runtime = register_runtime(namespace, config)
    install(model, runtime, namespace, set(selected), **install_options)
    return model, replica, runtime


def tokens_of(step, rank):
    return torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(100 * step + rank))


def fsdp_steps(rank, world, reduce_dtype, euclidean, steps=4, stats_source=None):
    from torch._dynamo.utils import counters as dynamo_counters

    torch._dynamo.reset()
    dynamo_counters.clear()
    euclidean_error_feedback = euclidean.endswith("+ef")
    wire = euclidean.removesuffix("+ef")
    config = GiftConfig(layers=("up",), low_rank=8, fallback=False, euclidean_dtype=wire, euclidean_error_feedback=euclidean_error_feedback,
                        gift_dtype="fp4" if wire == "fp4" else "fp8", embedding_dtype="fp4" if wire == "fp4" else "fp8",
                        stats_source=stats_source)
    model, replica, runtime = sharded_mixed(world, config, f"fsdp-{world}-{reduce_dtype}-{euclidean}-{stats_source}", reduce_dtype)

    reference = GiftReducer(config)
    inputs = {}
    for name in ("up", "down"):
        replica.get_submodule(name).register_forward_hook(lambda m, args, out, name=name: inputs.__setitem__(name, args[0].detach()))
    worst, graphs = {}, []
    for step in range(steps):
        tokens = tokens_of(step, rank)
        with torch.no_grad():  # an evaluation forward in between must not feed the statistics
            model(tokens.flip(0))
        model(tokens).backward()
        replica(tokens).backward()
        for name, param in model.named_parameters():
            local = replica.get_parameter(name).grad.to(reduce_dtype)
            if name == "up.weight" or (name == "down.weight" and euclidean_error_feedback):  # FSDP2 averages
                layer = name.removesuffix(".weight")
                want = reference.reduce_layer(layer, local, inputs[layer].reshape(-1, local.shape[1]), op="avg",
                                              collective="reduce_scatter", whitened=layer == "up")
            else:
                dense = WireFormat("bf16" if reduce_dtype == torch.bfloat16 else "fp32")
                wire = WireFormat(config.euclidean_dtype if name == "down.weight" else config.embedding_dtype) if local.dim() == 2 else dense
                want = euclidean_reduce(local, op="avg", group=None, wire=wire, collective="reduce_scatter").output
            got = param.grad.to_local()
            want = want[: got.shape[0]].to(got.dtype)
            error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
            worst[name] = max(worst.get(name, 0.0), error)
        model.zero_grad()
        replica.zero_grad()
        graphs.append(dynamo_counters["stats"]["unique_graphs"])  # the model is eager: these are the codec's
    counters = {fqn: c.as_dict() for fqn, c in runtime.counters.items()}
    return worst, counters, graphs


@pytest.mark.parametrize(
    "world, reduce_dtype, euclidean",
    [(2, torch.float32, "fp8"), (3, torch.float32, "fp8"), (2, torch.bfloat16, "fp8"), (2, torch.float32, "fp8+ef"), (2, torch.float32, "fp32"),
     (2, torch.float32, "fp4+ef")],
)
def test_fsdp_reduce_scatter_matches_the_reference(ranks, world, reduce_dtype, euclidean):
    # FSDP runs the codec compiled (Inductor), the reference eagerly: the same arithmetic, so
    # the FP8 paths must still agree bit for bit.
    for worst, counters, graphs in ranks(world).run(fsdp_steps, reduce_dtype, euclidean):
        # Each FP8 parameter (up whitened, down, embed) compiled at the first step, never again.
        assert graphs[0] >= (2 if euclidean == "fp32" else 3) and graphs == [graphs[0]] * len(graphs)
        assert worst["up.weight"] == 0.0  # GIFT: the same step as the reference, bit for bit
        assert worst["embed.weight"] == 0.0  # Euclidean FP8
        # 1-D (and an fp32 wire): the reduce dtype's own sum (gloo's order vs the reference's): rounding only.
        limit = 1e-2 if reduce_dtype == torch.bfloat16 else 1e-6
        assert worst["up.bias"] < limit and worst["norm.weight"] < limit and worst["norm.bias"] < limit
        assert worst["down.weight"] < limit if euclidean == "fp32" else worst["down.weight"] == 0.0  # FP8: bit for bit (+ef: a state)
        fp4 = euclidean.startswith("fp4")  # then every 2-D wire is FP4
        assert counters["up"]["path"] == ("gift-fp4" if fp4 else "gift") and counters["up"]["steps"] == 4 and counters["up"]["stats_bytes"] > 0
        assert counters["down"]["path"] == euclidean and counters["embed"]["path"] == ("fp4" if fp4 else "fp8")
        assert counters["down"]["bytes_sent"] > 0  # every wire is counted, fp32 too (the bytes metrics)
        assert counters["up"]["error_vs_fp8"] is not None


def test_fsdp_input_statistics_match_the_reference(ranks):
    # stats_source = "inputs": up's forward hook sketches its input and starts the sum, which
    # the reduce-scatter waits for (with the default, the gradients' statistics, the
    # reduce-scatter sketches up's local, unsharded gradient itself: the test above), as the
    # reference does: bit for bit, with the statistics counted.
    for worst, counters, _ in ranks(2).run(fsdp_steps, torch.float32, "fp8", 4, "inputs"):
        assert worst["up.weight"] == 0.0 and worst["embed.weight"] == 0.0
        assert counters["up"]["stats_bytes"] > 0


def with_and_without_peeks(rank, world, factor_source):
    """The reduced ``up.weight`` shard over 3 steps, once plainly and once with a train-mode
    forward before each step whose output is dropped (no backward)."""
    config = GiftConfig(layers=("up",), low_rank=8, fallback=False, factor_source=factor_source, refresh_interval=2)
    runs = []
    for peek in (False, True):
        model, _, _ = sharded_mixed(world, config, f"peek-{factor_source}-{peek}", compile_codec=False)
        grads = []
        for step in range(3):
            if peek:
                model(tokens_of(step + 50, rank) * 0 + 7)  # other tokens, grad enabled, never backpropagated
            model(tokens_of(step, rank)).backward()
            grads.append(model.up.weight.grad.to_local().clone())
            model.zero_grad()
        runs.append(grads)
    return [torch.equal(a, b) for a, b in zip(*runs)]


@pytest.mark.parametrize("factor_source", ["current_step", "periodic"])
def test_a_forward_without_backward_changes_nothing(ranks, factor_source):
    # Before: the statistics of the first forward of a step were kept, so a "peek" forward set
    # the next real step's whitening (the layer's error went from 1.03x to 1.32x FP8's). Now the
    # latest forward before the reduce-scatter counts, and a periodic refresh redone in the same
    # step starts from the same moment: bit for bit the run without the peeks.
    for same in ranks(2).run(with_and_without_peeks, factor_source):
        assert same == [True, True, True]


def timed_fsdp_steps(rank, world, compile_codec, delay=0.5):
    """The time meter on the FSDP route (timing.py): per rank, timed steps, in the last of which
    rank 1's first codec call sleeps ``delay`` seconds; with the eager codec first a step outside
    ``timed_step`` (compiled, that step would trace a codec without the timed waits, and the
    timed steps would compile it again), compiled a first timed step that compiles the codec (a
    rank that compiles faster waits for the other there) and is not returned."""
    import time

    from gift_compile import timing
    from gift_compile.fsdp import FsdpRoute

    namespace = f"timed-{compile_codec}"
    # Only the embedding on a quantized wire: one small codec graph to compile (the meter's
    # ticks do not depend on the path; the titan tests time GIFT's).
    config = GiftConfig(layers=(), euclidean_dtype="fp32", embedding_dtype="fp8")
    model, _, runtime = sharded_mixed(world, config, namespace, selected=(), compile_codec=compile_codec)
    route, cpu = FsdpRoute.of(runtime), torch.device("cpu")
    meter = timing.timer(namespace)
    untimed = None
    if not compile_codec:
        model(tokens_of(0, rank)).backward()
        untimed = meter.take()["step"]
    seconds = []
    steps = ((1, False), (2, False), (3, rank == 1)) if compile_codec else ((1, False), (2, rank == 1))
    for step, sleeps in steps:
        codec, slept = route.codec, []

        def late_encode(*args, **kwargs):
            if sleeps and not slept:
                slept.append(time.sleep(delay))  # inside the reduce-scatter hook: codec time, and a wait for the peer
            return codec.encode(*args, **kwargs)

        route.codec = codec._replace(encode=late_encode)
        start = time.perf_counter()
        with timing.timed_step(namespace, cpu):
            model(tokens_of(step, rank)).backward()
        wall = time.perf_counter() - start
        route.codec = codec
        seconds.append({**meter.take(), "wall": wall})
    return untimed, seconds[-2:]


@pytest.mark.parametrize("compile_codec", [True, False])
def test_the_time_meter_splits_the_reduce_scatter_into_codec_and_waiting(ranks, compile_codec):
    # The standard trainer runs no graph of ours, so the time meter's ticks come from its hooks
    # and from gift::timed_wait, which on the compiled codec runs inside the Inductor call.
    # Rank 1 sleeps 0.5 s in its codec: rank 0 must see that as waiting for communication (it
    # blocks in its first collective with rank 1 after the sleep began), rank 1 as codec.
    delay = 0.5
    (untimed0, (plain0, late0)), (untimed1, (plain1, late1)) = ranks(2).run(timed_fsdp_steps, compile_codec, delay)
    if not compile_codec:
        assert untimed0 == untimed1 == 0.0  # no step opened: the hooks ticked nothing
    for seconds in (plain0, late0, plain1, late1):
        assert seconds["codec"] > 0 and seconds["wait"] >= 0 and seconds["compute"] > 0
        # the segments tile the step: from its opening tick to its closing one
        assert abs(seconds["step"] - seconds["wall"]) < 0.01 * seconds["wall"] + 1e-3
    # 0.8 x delay: rank 0 may have been a little behind rank 1 when the sleep began
    assert late0["wait"] >= 0.8 * delay and late0["codec"] < late0["wait"]
    assert late1["codec"] >= delay and late1["wait"] < 0.5 * delay
    assert plain0["wait"] < 0.5 * delay  # no sleep: no such wait


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(24, 48), nn.Linear(48, 24)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def compiled_blocks(rank, world, steps=4):
    # torchtitan's standard trainer: each block compiled with fullgraph=True, then fully_shard.
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        block.compile(backend="aot_eager", fullgraph=True)  # a graph break would raise
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    runtime = register_runtime("fsdp-compiled", GiftConfig(layers=("up",), low_rank=8))
    install(model, runtime, "fsdp-compiled", {"0.up", "1.up"})
    graphs = []
    for step in range(steps):
        x = torch.randn(6, 24, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs, {fqn: c.as_dict()["steps"] for fqn, c in runtime.counters.items()}


def test_statistics_hook_traces_into_compiled_blocks_without_recompiling(ranks):
    for graphs, steps in ranks(2).run(compiled_blocks):
        assert graphs[0] >= 2 and graphs == [graphs[0]] * len(graphs)  # compiled once, never again
        assert steps["0.up"] == steps["1.up"] == 4  # each step found its forward statistics


def hsdp_steps(rank, world, wire, steps=3):
    # HSDP on a 2 x 2 mesh: fully_shard over the shard dimension, GIFT's all-reduce hook over
    # the replicas (gift_compile.fsdp). Returns per-parameter errors, whether the replicas agree
    # and the counters. The codec runs eagerly: compiled, it equals the eager one bit for bit
    # (test_fsdp_reduce_scatter_matches_the_reference), and four ranks on two cores would
    # otherwise spend a minute compiling six graphs each.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Mixed()
    replica = copy.deepcopy(model)
    config = GiftConfig(layers=("up",), low_rank=8, fallback=False, euclidean_error_feedback=False, gift_dtype=wire,
                        euclidean_dtype=wire, embedding_dtype=wire)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard_group, replicate_group = mesh["shard"].get_group(), mesh["replicate"].get_group()
    for name in ("embed", "up", "down", "norm"):
        fully_shard(getattr(model, name), mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    runtime = register_runtime(f"fsdp-hsdp-{wire}", config)
    install(model, runtime, f"fsdp-hsdp-{wire}", {"up"}, replicate_group=replicate_group, compile_codec=False)

    reference = GiftReducer(config, group=shard_group)
    inputs = {}
    replica.up.register_forward_hook(lambda m, args, out: inputs.__setitem__("up", args[0].detach()))
    library, exact, replicas_equal = {}, {}, True
    for step in range(steps):
        tokens = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(100 * step + rank))
        model(tokens).backward()
        replica(tokens).backward()
        for name, param in model.named_parameters():
            local = replica.get_parameter(name).grad
            got = param.grad.to_local()
            # The library's own composition: the shard group's step, then the replicas' all-reduce.
            if name == "up.weight":
                shard = reference.reduce_layer("up", local, inputs["up"].reshape(-1, 24), op="avg", collective="reduce_scatter")
            else:
                shard = euclidean_reduce(local, op="avg", group=shard_group, wire=WireFormat(wire if local.dim() == 2 else "fp32"),
                                         collective="reduce_scatter").output
            want = euclidean_reduce(shard, op="avg", group=replicate_group, wire=WireFormat(wire if local.dim() == 2 else "fp32"),
                                    collective="all_reduce").output[: got.shape[0]]
            library[name] = max(library.get(name, 0.0), ((got - want).norm() / want.norm()).item())
            # Independent: the fp32 mean of all four ranks' gradients, this rank's rows.
            mean = local.clone()
            dist.all_reduce(mean)
            mean = mean.div(world).chunk(world // 2)[dist.get_rank(shard_group)]  # FSDP's dim-0 shard
            exact[name] = max(exact.get(name, 0.0), ((got - mean).norm() / mean.norm()).item())
            # The replicas hold the same shard, bit for bit.
            peers = [torch.empty_like(got) for _ in range(2)]
            dist.all_gather(peers, got.contiguous(), group=replicate_group)
            replicas_equal &= torch.equal(peers[0], peers[1])
        model.zero_grad()
        replica.zero_grad()
    counters = {fqn: c.as_dict() for fqn, c in runtime.counters.items()}
    return library, exact, replicas_equal, counters


@pytest.mark.parametrize("wire", ["fp8", "fp4"])
def test_hsdp_all_reduces_the_replicas_on_the_wire(ranks, wire):
    for library, exact, replicas_equal, counters in ranks(4).run(hsdp_steps, wire):
        assert replicas_equal
        # The hook is the library's own reduce-scatter then all-reduce, compiled vs eager: the
        # same arithmetic, bit for bit (1-D: gloo's fp32 sums, rounding only).
        assert library["up.weight"] == library["down.weight"] == library["embed.weight"] == 0.0, library
        assert max(library[n] for n in ("up.bias", "norm.weight", "norm.bias")) < 1e-6, library
        # Against the exact fp32 mean: 1-D parameters travel in fp32 (rounding only); 2-D ones go
        # through three e4m3 roundings (reduce-scatter, the replicas' reduce-scatter, the owner's
        # all-gather), each at most 2^-4 of an element's magnitude, so under 3 * 2^-4 in norm.
        # (FP4's numerics against its definition: test_oracle.py / test_fp4.py.)
        assert max(exact[n] for n in ("up.bias", "norm.weight", "norm.bias")) < 1e-6, exact
        if wire == "fp8":
            assert max(exact[n] for n in ("up.weight", "down.weight", "embed.weight")) < 3 * 2**-4, exact
        assert counters["up"]["path"] == ("gift" if wire == "fp8" else "gift-fp4") and counters["up"]["steps"] == 3
        for fqn in ("up", "down", "embed"):  # the replicate dimension: the same wire, counted on its own row
            assert counters[f"{fqn}@replicate"]["path"] == wire and counters[f"{fqn}@replicate"]["bytes_sent"] > 0


def native_hsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Mixed()
    fully_shard(model, mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    try:
        install(model, register_runtime("fsdp-native-hsdp", GiftConfig(layers=("up",))), "fsdp-native-hsdp", {"up"})
    except ValueError as error:
        return str(error)
    return None


def test_native_hsdp_is_refused_with_the_way_out(ranks):
    for message in ranks(4).run(native_hsdp):
        assert message is not None and "2-D (HSDP) mesh" in message and "replicate_group" in message


LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def fsdp_llama_steps(rank, world, steps=3):
    """A Llama block (q, k, v read one input; w1, w3 another), every Linear whitened, under
    FSDP2 and layer by layer in the reference with no sharing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = GiftConfig(low_rank=4, meter_interval=2, stats_source="inputs")  # sharing is for input statistics
    model = LlamaBlock()
    replica = copy.deepcopy(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    runtime = register_runtime("fsdp-llama", config)
    install(model, runtime, "fsdp-llama", set(LINEARS), compile_codec=False)
    reference, inputs, worst = GiftReducer(config), {}, 0.0
    for fqn in LINEARS:
        replica.get_submodule(fqn).register_forward_hook(lambda m, args, out, fqn=fqn: inputs.__setitem__(fqn, args[0].detach()))
    for step in range(steps):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        replica(x).square().mean().backward()
        for fqn in LINEARS:
            local = replica.get_submodule(fqn).weight.grad
            want = reference.reduce_layer(fqn, local, inputs[fqn].reshape(-1, local.shape[1]), collective="reduce_scatter")
            got = model.get_submodule(fqn).weight.grad.to_local()
            worst = max(worst, (got - want[: got.shape[0]]).abs().max().item())
        model.zero_grad()
        replica.zero_grad()
    return worst, {fqn: runtime.counters[fqn].stats_bytes for fqn in LINEARS}, {fqn: reference.runtime.counters[fqn].stats_bytes for fqn in LINEARS}


def test_fsdp_layers_reading_one_input_send_one_sketch(ranks):
    # The forward hooks of q, k and v see one input tensor: the first sketches it, the others
    # take its statistics (layer_step.py: the same numbers), so the gradients equal the
    # reference's that sketches every layer alone, bit for bit, and 3 of 7 sketches are not sent.
    for worst, stats, alone in ranks(2).run(fsdp_llama_steps):
        assert worst == 0.0
        assert {fqn for fqn, b in stats.items() if b > 0} == {"wq", "wo", "w1", "w2"}
        assert all(stats[fqn] == alone[fqn] for fqn in ("wq", "wo", "w1", "w2"))


class CollectiveCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional collectives issued under it, by op name."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] != "wait_tensor":
            name = func.__name__.split(".")[0]
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def fsdp_block_bucketed_or_not(rank, world, bucket, replicas=1, steps=3, piece_kib=128):
    """A Llama block under FSDP2 (one parameter group): q, k, v and w2 whitened, wo, w1 and w3
    on Euclidean FP8, the norms in fp32; every gradient shard per step and the collectives each
    backward issued. ``replicas=2``: HSDP, sharded over ``world / 2`` ranks, GIFT's all-reduce
    hook across the two replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = GiftConfig(layers=("wq", "wk", "wv", "w2"), low_rank=4, meter_interval=2, bucket=bucket, wire_piece_kib=piece_kib)
    model = LlamaBlock()
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh["shard"])
    namespace = f"fsdp-bucket-{bucket}"
    install(model, register_runtime(namespace, config), namespace, set(config.layers),
            replicate_group=mesh["replicate"].get_group(), compile_codec=False)
    grads, calls = [], []
    for step in range(steps):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        with CollectiveCount() as count:
            loss.backward()
        calls.append(count.calls)
        grads.append({name: p.grad.to_local().clone() for name, p in model.named_parameters()})
        model.zero_grad()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    return grads, calls, shapes


def test_a_bucketed_fsdp_block_sends_the_same_gradients_in_three_collectives(ranks):
    # FSDP2 hands GIFT a block's gradients in one buffer. Bucketed, the whitened layers'
    # gradient sketches are summed in one all_reduce, every parameter is encoded and the
    # quantized messages travel in one all_to_all, the fp32 norm weights in one
    # reduce-scatter; each parameter receives the bytes (and sums) it would alone, so every
    # gradient shard (state, residuals and factors included, over 3 steps) is bit for bit the same.
    for (bucketed, calls, shapes), (alone, calls_alone, _) in zip(ranks(2).run(fsdp_block_bucketed_or_not, True),
                                                                  ranks(2).run(fsdp_block_bucketed_or_not, False)):
        for step, (got, want) in enumerate(zip(bucketed, alone)):
            for name in want:
                assert torch.equal(got[name], want[name]), f"{name} differs at step {step}"
        matrices = sum(len(shape) == 2 for shape in shapes.values())  # 7 Linear weights
        vectors = len(shapes) - matrices  # 2 norm weights
        whitened = 4  # wq, wk, wv, w2: a gradient sketch each
        for step in range(len(calls)):
            assert calls_alone[step] == {"all_reduce": whitened, "all_to_all_single": matrices, "reduce_scatter_tensor": vectors}
            assert calls[step] == {"all_reduce": 1, "all_to_all_single": 1, "reduce_scatter_tensor": 1}


def test_a_bucketed_hsdp_block_sends_the_same_gradients_in_six_collectives(ranks):
    # HSDP (2 replicas x 2 shards): after the shard group's three collectives, the replicate
    # all-reduce hook reduces each shard across the replicas: quantized, an all_to_all and then
    # the owners' all-gather per matrix (on gloo an all_to_all too: collectives.all_gather); the
    # norm weights an fp32 all-reduce. Bucketed, each phase sends the whole block in one call,
    # with bit-identical shards over 3 steps.
    for (bucketed, calls, shapes), (alone, calls_alone, _) in zip(ranks(4).run(fsdp_block_bucketed_or_not, True, 2),
                                                                  ranks(4).run(fsdp_block_bucketed_or_not, False, 2)):
        for step, (got, want) in enumerate(zip(bucketed, alone)):
            for name in want:
                assert torch.equal(got[name], want[name]), f"{name} differs at step {step}"
        matrices = sum(len(shape) == 2 for shape in shapes.values())
        vectors = len(shapes) - matrices
        whitened = 4  # a gradient sketch each, summed over the shard group
        for step in range(len(calls)):
            assert calls_alone[step] == {"all_to_all_single": 3 * matrices, "reduce_scatter_tensor": vectors,
                                         "all_reduce": whitened + vectors}
            assert calls[step] == {"all_to_all_single": 3, "reduce_scatter_tensor": 1, "all_reduce": 2}


def test_the_standard_trainers_messages_travel_in_pieces_with_the_same_gradients(ranks):
    # wire_piece_kib = 1: the block's quantized messages go as several all_to_all calls each,
    # the shard group's exchange and the replicate all-reduce's two phases alike
    # (collectives.all_to_all_in_pieces, eagerly). The block's 7 matrices hold 4 * 32 * 32 +
    # 3 * 32 * 64 = 10,240 FP8 codes: the shard group's exchange sends half of them and their
    # scales to each of 2 ranks (5,120 bytes and more: 6 pieces of at most 1 KiB); each rank's
    # shard (5,120 codes) is all-reduced over 2 replicas, a quarter and its scales to each peer,
    # then the reduced quarter to both (2,560 bytes and more: 3 pieces each). Every gradient shard
    # is the same bit for bit as with one call per message, and only the all_to_all count grows.
    for (pieces, calls, shapes), (whole, calls_whole, _) in zip(ranks(4).run(fsdp_block_bucketed_or_not, True, 2, 2, 1),
                                                                ranks(4).run(fsdp_block_bucketed_or_not, True, 2, 2, 0)):
        for step, (got, want) in enumerate(zip(pieces, whole)):
            for name in want:
                assert torch.equal(got[name], want[name]), f"{name} differs at step {step}"
        for step in range(len(calls)):
            assert calls_whole[step]["all_to_all_single"] == 3
            assert calls[step]["all_to_all_single"] == 6 + 3 + 3
            assert {k: v for k, v in calls[step].items() if k != "all_to_all_single"} == \
                   {k: v for k, v in calls_whole[step].items() if k != "all_to_all_single"}
