"""FP8 / FP4 / bf16 / fp32 collectives on real gloo ranks against an exact fp64 reference.

Bounds. Every rank's chunk is quantized once before the reduction (relative error per
element <= 2^-4 for e4m3, see test_numerics), so the reduce-scatter error is at most
sum_i ||x_i|| / 16 in norm. The all-reduce re-quantizes the reduced shard once more:
<= (sum_i ||x_i|| + ||sum_i x_i||) / 16. Scale-block padding adds nothing (zeros).

FP4 (E2M1, block scale s): a value v = x / s at or above 1 is off by at most half the grid's
spacing there, <= v / 4; below 1 by at most 0.25; above 6 (a scale rounded down) it saturates,
off by <= v / 4 (NVFP4: the E4M3 scale is within 2^-4, so v <= 6.4) or <= v / 3 (MXFP4: v < 8).
So |e_i| <= |x_i| / 4 + s / 4 (NVFP4; s <= block_amax / 5.65) or |x_i| / 3 + s / 4 (MXFP4;
s <= block_amax / 4), and summing over blocks of 16 / 32 with sum block_amax^2 <= ||x||^2:
||e|| <= 0.43 ||x|| (NVFP4), <= 0.69 ||x|| (MXFP4). Loose, but it holds for any input; the
codec's exact rounding is checked against the independent oracle in test_fp4.py.
"""

from datetime import timedelta

import pytest
import torch

from gift_compile.collectives import WireFormat, _chunked, _encode, all_reduce, bytes_sent, layout, reduce_scatter

SHAPES = [(10, 7), (9,), (1, 3), (300, 200), (6, 2, 3)]
WIRES = {
    "fp8": WireFormat(),
    "fp8_e5m2": WireFormat(fp8_format="e5m2"),
    "fp8_rowblock": WireFormat(scaling="row_block", block_rows=2),
    "fp8_globalmax": WireFormat(scale_mode="global_max"),
    "fp4_nvfp4": WireFormat("fp4"),
    "fp4_mxfp4": WireFormat("fp4", fp4_format="mxfp4"),
    "bf16": WireFormat("bf16"),
    "fp32": WireFormat("fp32"),
}
HALF_ULP = {"e4m3": 2.0**-4, "e5m2": 2.0**-3, "nvfp4": 0.43, "mxfp4": 0.69}  # relative norm bounds, see the docstring


def rank_input(shape, rank, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g) * (1 + rank)


def collective_cases(rank, world):
    out = {}
    for shape in SHAPES:
        x = rank_input(shape, rank)
        for name, wire in WIRES.items():
            for op in ("sum", "avg"):
                out[(shape, name, op, "all_reduce")] = all_reduce(x, op, None, wire)
                out[(shape, name, op, "reduce_scatter")] = reduce_scatter(x, op, None, wire)
    for wire in ("fp8", "fp4_nvfp4", "fp4_mxfp4"):
        zeros = torch.zeros(8, 4)
        out["zeros", wire] = (all_reduce(zeros, "sum", None, WIRES[wire]), reduce_scatter(zeros, "avg", None, WIRES[wire]))
        for bad in ("nan", "inf"):
            x = torch.randn(8, 4)
            if rank == 0:
                x[5, 1] = float(bad)
            out[bad, wire] = (all_reduce(x, "avg", None, WIRES[wire]), reduce_scatter(x, "sum", None, WIRES[wire]))
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def results(request, ranks):
    world = request.param
    return world, ranks(world).run(collective_cases)


def exact(shape, world, op):
    xs = [rank_input(shape, r).double() for r in range(world)]
    total = sum(xs)
    return (total / world if op == "avg" else total), sum(x.norm() for x in xs) / (world if op == "avg" else 1)


def expected_shard(full, rank, world):
    rows = full.shape[0]
    c = -(-rows // world)
    padded = torch.cat([full, full.new_zeros(world * c - rows, *full.shape[1:])])
    return padded[rank * c : (rank + 1) * c]


def bound(name, input_norms, output_norm, collective):
    if name == "fp32":
        return 1e-6 * input_norms
    if name == "bf16":
        # bf16 rounds inputs (2^-9 relative) and the gloo sum of bf16 values rounds again.
        return 2.0**-8 * (input_norms + output_norm) * 2
    half_ulp = HALF_ULP[next((f for f in ("e5m2", "nvfp4", "mxfp4") if f in name), "e4m3")]
    return half_ulp * (input_norms + (output_norm if collective == "all_reduce" else 0))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(WIRES))
def test_reductions_match_fp64_within_bound(results, shape, name):
    world, per_rank = results
    for op in ("sum", "avg"):
        full, input_norms = exact(shape, world, op)
        for rank, out in enumerate(per_rank):
            got_full = out[(shape, name, op, "all_reduce")]
            assert got_full.shape == torch.Size(shape) and got_full.dtype == torch.float32
            err = (got_full.double() - full).norm()
            assert err <= bound(name, input_norms, full.norm(), "all_reduce"), (rank, op, err)
            shard = out[(shape, name, op, "reduce_scatter")]
            want = expected_shard(full, rank, world)
            assert shard.shape == want.shape
            err = (shard.double() - want).norm()
            assert err <= bound(name, input_norms, 0, "reduce_scatter"), (rank, op, err)


def test_all_reduce_is_bit_identical_on_every_rank(results):
    world, per_rank = results
    for key, value in per_rank[0].items():
        if isinstance(key, tuple) and len(key) == 4 and key[3] == "all_reduce":
            for other in per_rank[1:]:
                assert torch.equal(other[key], value), key


@pytest.mark.parametrize("wire", ["fp8", "fp4_nvfp4", "fp4_mxfp4"])
def test_zero_gradients_reduce_to_exact_zeros(results, wire):
    _, per_rank = results
    for full, shard in (out["zeros", wire] for out in per_rank):
        assert torch.equal(full, torch.zeros(8, 4)) and not bool(shard.any())


@pytest.mark.parametrize("wire", ["fp8", "fp4_nvfp4", "fp4_mxfp4"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_gradient_is_non_finite_on_every_rank(results, bad, wire):
    # FP4 has no NaN code: the block's (MXFP4) or sender's (NVFP4) scale carries it
    _, per_rank = results
    for full, shard in (out[bad, wire] for out in per_rank):
        assert not bool(torch.isfinite(full).all()) and not bool(torch.isfinite(shard).all())


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("shape", [(256, 256), (1024, 64), (65536,), (4096, 4096)], ids=str)
def test_fp8_bytes_are_at_most_26_percent_of_fp32(world, shape):
    for collective in ("reduce_scatter", "all_reduce"):
        fp8 = bytes_sent(shape, world, WIRES["fp8"], collective)
        fp32 = bytes_sent(shape, world, WIRES["fp32"], collective)
        assert fp8 <= 0.26 * fp32, (collective, fp8 / fp32)
        # FP4: 4 bits plus one byte per block of 16 (NVFP4, + 4 bytes per sender) or 32 (MXFP4):
        # 0.1406x and 0.1328x fp32, plus the zero rows of an uneven split (256 rows on 3 ranks)
        assert bytes_sent(shape, world, WIRES["fp4_nvfp4"], collective) <= 0.1425 * fp32
        assert bytes_sent(shape, world, WIRES["fp4_mxfp4"], collective) <= 0.135 * fp32


@pytest.mark.parametrize("name", ["fp8_rowblock", "fp4_nvfp4", "fp4_mxfp4"])
def test_byte_count_matches_the_message(name):
    wire = WireFormat(scaling="row_block", block_rows=16) if name == "fp8_rowblock" else WIRES[name]
    x = torch.randn(100, 30)
    lay = layout(x.shape, 4, wire)
    messages, _, _ = _encode(_chunked(x, lay), lay, wire, None)
    assert bytes_sent(x.shape, 4, wire, "reduce_scatter") == 3 * messages[0].numel()
    assert bytes_sent(x.shape, 4, wire, "all_reduce") == 6 * messages[0].numel()


def whitened_reductions(rank, world, wire, collective, nan, factorization="lowrank"):
    """A whitened reduction with error feedback (both stages), rank 0's gradient with a NaN where
    ``nan``, eagerly and compiled: the ``comm.Reduction`` of each. ``factorization``:
    ``geometry.factorize``'s (``"symmetric"`` with a rank: a low-rank ``T``; else a dense one)."""
    from gift_compile.comm import gather_residual_shape, quantized_reduce
    from gift_compile.geometry import factorize

    g = rank_input((12, 16), rank)
    if rank == 0 and nan:
        g[5, 3] = float("nan")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(7)) * torch.linspace(0.1, 3, 16)
    whitening = factorize(x.T @ x / 64, factorization=factorization, rank=4, damping=0.1)
    residual = torch.randn(12, 16, generator=torch.Generator().manual_seed(rank)) * 0.01
    gather_residual = torch.zeros(gather_residual_shape((12, 16), None)) if collective == "all_reduce" else None

    def reduce(g, residual, gather_residual):
        return tuple(quantized_reduce(g, whitening, residual, gather_residual, op="avg", group=None, wire=WIRES[wire],
                                      collective=collective))

    return [reduce(g, residual, gather_residual), torch.compile(reduce, fullgraph=True)(g, residual, gather_residual)]


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("wire", ["fp8", "fp4_nvfp4"])
def test_a_non_finite_step_leaves_finite_residuals(ranks, wire, collective):
    """The NaN reaches every rank's output, but no residual keeps it (it would poison every
    later step): the sender's scale is NaN, so its whole round trip is dropped (zeros), while
    the other rank's residual is its ordinary, finite error. Eager and compiled alike (the
    compiled codec zeroes in whitened coordinates, inside the encoder's kernel)."""
    for rank, runs in enumerate(ranks(2).run(whitened_reductions, wire, collective, True)):
        for output, residual, gather_residual, _ in runs:
            assert not bool(torch.isfinite(output).all())
            assert bool(torch.isfinite(residual).all())
            assert (not bool(residual.any())) if rank == 0 else bool(residual.any())
            if gather_residual is not None:  # every reduced shard holds the NaN: nothing kept
                assert torch.equal(gather_residual, torch.zeros_like(gather_residual))


@pytest.mark.parametrize("wire", ["fp8", "fp4_nvfp4"])
def test_the_reported_error_is_the_residual_norm(ranks, wire):
    """With a low-rank ``T`` the counters' ``error_sq`` comes from an identity (the wire error's
    projection and the encoder's own ``|E|^2``, comm.reduce_received), not from ``R'`` itself: it
    must equal ``|R'|^2`` summed directly, in float64. Bound 1e-4 relative: two fp32 sums of 192
    squares (~1e-6 each) and an fp32 basis orthonormal to ~1e-7, with ``T^-1``'s coefficients
    positive here (no cancellation). The reduce-scatter route: the all-reduce's first stage is the
    same code (comm.reduce_received)."""
    from gift_compile.comm import STATS
    from gift_compile.geometry import factorize

    assert factorize(torch.eye(16), factorization="symmetric", rank=4, damping=0.1).layout == "lowrank"
    for runs in ranks(2).run(whitened_reductions, wire, "reduce_scatter", False, "symmetric"):
        for _, residual, _, stats in runs:
            direct = float(residual.double().square().sum())
            assert direct > 0
            assert float(stats[STATS.index("error_sq")]) == pytest.approx(direct, rel=1e-4)


def statistics_groups(rank, world):
    """``separate_statistics_group`` on a world-spanning group and on ranks {0, 1} alone (only
    they call it): where each layer's statistics all-reduce goes, and what it sums to."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.fx.experimental.proxy_tensor import make_fx

    from gift_compile.collectives import separate_statistics_group, statistics_group_name
    from gift_compile.config import GiftConfig
    from gift_compile.geometry import input_sketch
    from gift_compile.layer_step import LayerPlan, sketch_all_reduce

    everyone, pair = dist.new_group(list(range(world))), dist.new_group([0, 1])  # fresh: no other test's groups
    groups = {"everyone": everyone} if rank > 1 else {"everyone": everyone, "pair": pair}
    basis, scale = torch.linalg.qr(torch.randn(6, 2, generator=torch.Generator().manual_seed(0))).Q, torch.ones(())
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, group in groups.items():
        before = statistics_group_name(group.group_name)
        separate_statistics_group(group)
        own = statistics_group_name(group.group_name)
        separate_statistics_group(group)  # a second call keeps the first group
        plan = LayerPlan.of("fc", 3, 6, GiftConfig(low_rank=2), whitened=True, collective="all_reduce", op="sum",
                            group_name=group.group_name)
        traced = make_fx(lambda x, b, s: sketch_all_reduce(plan, x, b, s))(x, basis, scale)
        (reduce,) = traced.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default)
        summed = torch.ops._c10d_functional.wait_tensor(sketch_all_reduce(plan, x, basis, scale))
        exact = input_sketch(x, basis, scale)
        dist.all_reduce(exact, group=group)  # the same sum, on the gradients' group
        out[name] = dict(before=before, own=own, again=statistics_group_name(group.group_name), gradients=group.group_name,
                         traced=reduce.args[2], ranks=dist.get_process_group_ranks(_resolve_process_group(own)),
                         group_ranks=dist.get_process_group_ranks(group), equal=torch.equal(summed, exact))
    # the statistics group waits as long as its gradient group: at creation, and after a change
    from gift_compile.collectives import match_statistics_timeouts

    backend = lambda g: g._get_backend(torch.device("cpu"))  # noqa: E731
    own_group = _resolve_process_group(out["everyone"]["own"])
    created = backend(own_group).options._timeout == backend(everyone).options._timeout
    everyone.set_timeout(timedelta(seconds=17))
    match_statistics_timeouts()
    out["everyone"]["timeouts"] = (created, backend(own_group).options._timeout)
    # a destroyed statistics group is forgotten: the gradients' group again, never a dead name
    dist.destroy_process_group(_resolve_process_group(out["everyone"]["own"]))
    out["everyone"]["after_destroy"] = statistics_group_name(everyone.group_name)
    return out


def test_statistics_travel_on_a_group_of_their_own(ranks):
    # world 3: the pair's group leaves rank 2 out, which never calls separate_statistics_group for it
    results = ranks(3).run(statistics_groups)
    for rank, out in enumerate(results):
        assert set(out) == ({"everyone", "pair"} if rank < 2 else {"everyone"})
        for group in out.values():
            assert group["before"] == group["gradients"]  # nothing registered: the gradients' group
            assert group["own"] != group["gradients"] and group["again"] == group["own"]
            assert group["traced"] == group["own"]  # the graph's all-reduce names the statistics' group
            assert group["ranks"] == group["group_ranks"]
            assert group["equal"]  # summed there, the sketch is what the gradients' group sums
    assert all(out["everyone"]["after_destroy"] == out["everyone"]["gradients"] for out in results)
    assert all(out["everyone"]["timeouts"] == (True, timedelta(seconds=17)) for out in results)
    # every member names the new group alike (the functional collectives resolve it by name)
    assert len({out["everyone"]["own"] for out in results}) == 1 and results[0]["pair"]["own"] == results[1]["pair"]["own"]
