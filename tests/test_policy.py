"""One gradient policy (``gift_compile/policy.py``): its rule, and every route acting on it.

The rule is asserted from its statement (the module docstring), case by case; then a model
with every kind of parameter (a whitened Linear with a bias, another Linear, an embedding, a
norm) is planned by the compiler pass (the same ``plan_rewrites`` graph_trainer's joint-graph
pass calls), by FSDP2's reduce-scatter and by the eager reference, on real gloo ranks: each
parameter must get the same plan everywhere.
"""

import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

from gift_compile import GiftConfig, replicate
from gift_compile.fsdp import FsdpRoute
from gift_compile.passes.gift_collectives import plan_rewrites
from gift_compile.policy import UNCHANGED, plan
from gift_compile.reference import GiftReference
from test_fsdp import Mixed, sharded_mixed

CONFIG = GiftConfig(layers=("up",), low_rank=8, euclidean_error_feedback=True)


@pytest.mark.parametrize("gift_dtype, euclidean_dtype", [("fp8", "fp8"), ("fp4", "fp4"), ("fp4", "bf16"), ("fp8", "fp32")])
def test_the_rule(gift_dtype, euclidean_dtype):
    config = CONFIG.replace(gift_dtype=gift_dtype, euclidean_dtype=euclidean_dtype, embedding_dtype="fp4")
    whitened = plan(config, "linear", selected=True, collective="all_reduce")
    assert (whitened.kind, whitened.wire.dtype, whitened.error_feedback, whitened.gather_error_feedback) == ("gift", gift_dtype, True, True)
    other = plan(config, "linear", collective="reduce_scatter")
    quantized = euclidean_dtype in ("fp8", "fp4")  # error feedback needs a quantized wire to feed back
    assert (other.kind, other.wire.dtype, other.error_feedback) == ("euclidean+ef" if quantized else "euclidean", euclidean_dtype, quantized)
    assert other.gather_error_feedback is False  # a reduce-scatter has no second stage
    embedding = plan(config, "matrix", collective="all_reduce")
    assert (embedding.kind, embedding.wire.dtype, embedding.error_feedback) == ("euclidean", "fp4", False)
    assert plan(config, "vector") == UNCHANGED and plan(config.replace(enabled=False), "linear", selected=True) == UNCHANGED
    # HSDP's replica all-reduce: stateless, on the layer's own wire (a whitened FP4 layer stays FP4)
    replicas = plan(config, "linear", selected=True, collective="all_reduce", replicas=True)
    assert (replicas.kind, replicas.wire.dtype, replicas.error_feedback) == ("euclidean", gift_dtype, False)
    bf16_gather = plan(config.replace(all_gather_dtype="bf16"), "linear", selected=True, collective="all_reduce")
    assert bf16_gather.gather_dtype == "bf16" and not bf16_gather.gather_error_feedback


def summary(p):
    """What a route does with a parameter; a dense fp32 wire is the collective as it is."""
    if p.kind == "unchanged" or (p.kind == "euclidean" and p.wire.dtype == "fp32"):
        return "unchanged"
    return (p.kind, p.wire.dtype, p.error_feedback)


def plans_of_every_route(rank, world, config):
    tokens = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = Mixed()
    params = [name for name, _ in model.named_parameters()]

    reference = {name: summary(p) for name, p in GiftReference(copy.deepcopy(model), config).plans.items()}

    graphs = []

    def backward(gm, _):
        graphs.append(copy.deepcopy(gm.graph))
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=backward, decompositions=select_decomp_table())
    torch.compile(replicate(copy.deepcopy(model)), backend=backend, fullgraph=True)(tokens).backward()
    planned = {r.found.fqn: summary(r.plan) for r in plan_rewrites(graphs[0], config, frozenset({"up"}))}
    compiled = {name: planned.get(name.rpartition(".")[0], "unchanged") if name.endswith(".weight") else "unchanged" for name in params}

    _, _, runtime = sharded_mixed(world, config, f"policy-{config.gift_dtype}")
    route = FsdpRoute.of(runtime)
    fsdp = {segment.name: summary(route.plan(segment)) for segment in route.segments}
    return reference, compiled, fsdp


@pytest.mark.parametrize("gift_dtype", ["fp8", "fp4"])
def test_every_route_gives_each_parameter_the_same_plan(ranks, gift_dtype):
    config = CONFIG.replace(gift_dtype=gift_dtype, euclidean_dtype=gift_dtype)
    reference, compiled, fsdp = ranks(2).run(plans_of_every_route, config)[0]
    assert reference == compiled == fsdp
    assert reference == {
        "embed.weight": ("euclidean", "fp8", False),  # embedding_dtype
        "up.weight": ("gift", gift_dtype, True),
        "up.bias": "unchanged",
        "down.weight": ("euclidean+ef", gift_dtype, True),
        "norm.weight": "unchanged",
        "norm.bias": "unchanged",
    }
