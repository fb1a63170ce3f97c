"""The library against an independent float64 statement of Algorithm 1 (tests/oracle.py).

The oracle shares no code with ``gift_compile``: it forms ``A`` explicitly, applies dense
``T``, keeps the residual in whitened coordinates and moves it at every change of ``T``
(``R <- R T_old^-1 T_new``), and rounds to e4m3 from the format's definition.

Tolerance: the library computes in fp32, the oracle in float64, so the whitened payloads
differ by ~1e-7 relative and the reduced gradients agree to ~1e-6 of their norm. An FP8
rounding flips where a value lies within that distance of a rounding midpoint: rare, but
over ~10^4 roundings per test it happens (seen on one machine's BLAS, not another's). A flip
moves one element by one e4m3 step, and every transform here right-multiplies, so the
difference stays in that element's row (error feedback carries it to the row's later steps).
So each step must agree to 1e-5 of its norm in every row but at most two, and those rows to
1e-2. What the oracle exists to catch moves every row: a missing residual move ~1e-2 per
step, a stale factor ~1e-1, a wrong padded shard all of its rows.
"""

import pytest
import torch
from torch import nn

from gift_compile import GiftConfig, gift_backend, replicate
from gift_compile import comm
from gift_compile.reference import GiftReducer
from oracle import OracleLayer

D_OUT, D_IN, TOKENS, RANK = 25, 32, 48, 8  # 25 rows: the reduce-scatter pads on 2 and 3 ranks


def step_data(rank, step):
    """Correlated inputs whose distribution changes every 5 steps, and a gradient with a
    persistent per-rank component (so rounding errors are systematic from step to step)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    mixing = torch.linspace(3, 0.05, D_IN)[:, None] * torch.randn(D_IN, D_IN, generator=torch.Generator().manual_seed(99 + step // 5))
    x = torch.randn(TOKENS, D_IN, generator=g) @ mixing
    grad_out = torch.randn(TOKENS, D_OUT, generator=torch.Generator().manual_seed(rank)) + 0.3 * torch.randn(TOKENS, D_OUT, generator=g)
    return grad_out, x


def config_for(factor_source, error_feedback=True):
    return GiftConfig(low_rank=RANK, damping=0.3, factor_source=factor_source, refresh_interval=3,
                      error_feedback=error_feedback, fallback=False)


def eager_steps(rank, world, config, collective, steps):
    reducer = GiftReducer(config)
    outputs = []
    for step in range(steps):
        grad_out, x = step_data(rank, step)
        outputs.append(reducer.reduce_layer("fc", grad_out.T @ x, x, collective=collective))
    return outputs


def oracle_outputs(world, config, collective, steps, rank=RANK):
    wire = config.fp4_format if config.gift_dtype == "fp4" else config.fp8_format
    oracle = OracleLayer(D_OUT, D_IN, world, rank, config.damping, error_feedback=config.error_feedback,
                         factor_source=config.factor_source, statistics=config.statistics,
                         refresh_interval=config.refresh_interval, collective=collective, wire=wire)
    outputs = []
    for step in range(steps):
        data = [step_data(r, step) for r in range(world)]
        outputs.append(oracle.reduce([g.double().T @ x.double() for g, x in data], [x for _, x in data]))
    return outputs


def assert_agrees(got, want, what, flip=1e-2):
    """Each step's reduced gradient agrees with the oracle's to 1e-5 of its norm, row by row,
    but for at most two rows per step (rounding flips: see the module docstring), which
    must still agree to ``flip``: 1e-2 for an e4m3 step; an FP4 flip moves an element by up to
    two E2M1 steps of its block (~a third of the block's largest element: ~1e-1 of the norm)."""
    for step, (g, w) in enumerate(zip(got, want)):
        diff = g.double() - w
        error = (diff.norm() / w.norm()).item()
        rows = (diff.norm(dim=1) / w.norm() > 1e-5).nonzero().flatten().tolist()
        assert len(rows) <= 2 and error < flip, f"{what}: step {step} differs from the oracle by {error:.2e} in rows {rows}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("factor_source", ["current_step", "periodic"])
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_eager_path_matches_the_oracle(world, factor_source, collective, ranks):
    # Error feedback on 2 ranks (8 steps, refreshes at 0/3/6 when periodic); without it on 3
    # ranks, whose uneven rows pad the last shard.
    config = config_for(factor_source, error_feedback=world == 2)
    steps = 8
    outputs = ranks(world).run(eager_steps, config, collective, steps)
    got = [torch.cat([o[s] for o in outputs])[:D_OUT] if collective == "reduce_scatter" else outputs[0][s] for s in range(steps)]
    assert_agrees(got, oracle_outputs(world, config, collective, steps), f"{world} ranks, {factor_source}, {collective}")



@pytest.mark.parametrize("fp4_format", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_fp4_wire_matches_the_oracle(fp4_format, collective, ranks):
    # Whitened FP4 (E2M1 rounding and block scales from the formats' definitions in the oracle),
    # with error feedback, the all-reduce's owners re-encoding their shards in FP4 too.
    config = config_for("current_step").replace(gift_dtype="fp4", fp4_format=fp4_format)
    outputs = ranks(2).run(eager_steps, config, collective, 6)
    got = [torch.cat([o[s] for o in outputs])[:D_OUT] if collective == "reduce_scatter" else outputs[0][s] for s in range(6)]
    assert_agrees(got, oracle_outputs(2, config, collective, 6), f"FP4 {fp4_format}, {collective}", flip=1e-1)


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_gradient_statistics_match_the_oracle(collective, ranks):
    # stats_source = "gradients": T from the Nystrom approximation of sum_k G_k^T G_k on the
    # previous basis (the oracle forms it densely, with a pseudo-inverse, and eigh's it whole),
    # with error feedback; 3 ranks, so the reduce-scatter pads the last shard.
    config = config_for("current_step").replace(stats_source="gradients")
    outputs = ranks(3).run(eager_steps, config, collective, 6)
    got = [torch.cat([o[s] for o in outputs])[:D_OUT] if collective == "reduce_scatter" else outputs[0][s] for s in range(6)]
    assert_agrees(got, oracle_outputs(3, config, collective, 6), f"gradient statistics, {collective}")
    # ... and it is not the input statistics' transform: the oracle's two answers differ by far
    # more than the agreement's tolerance (a wrong source would fail above).
    inputs = oracle_outputs(3, config.replace(stats_source="inputs"), collective, 6)
    assert all(((g.double() - w).norm() / w.norm()).item() > 1e-3 for g, w in zip(got[1:], inputs[1:]))


def test_a_low_rank_above_the_input_dimension_means_full_rank(ranks):
    # low_rank 10 x d_in must neither fail (on every rank, after the model is built) nor build a
    # wider basis: it is the full A^-1/2, as the oracle computes it with rank = d_in.
    config = config_for("current_step").replace(low_rank=10 * D_IN)
    outputs = ranks(2).run(eager_steps, config, "reduce_scatter", 4)
    got = [torch.cat([o[s] for o in outputs])[:D_OUT] for s in range(4)]
    assert_agrees(got, oracle_outputs(2, config, "reduce_scatter", 4, rank=D_IN), "low_rank > d_in")

class Probe(nn.Module):
    """One Linear layer whose weight gradient is exactly ``grad_out^T x`` for a chosen ``grad_out``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, D_OUT, bias=False)

    def forward(self, x, grad_out):
        return (self.fc(x) * grad_out).sum()


def compiled_steps(rank, world, config, steps):
    torch.manual_seed(0)
    model = replicate(Probe())
    compiled = torch.compile(model, backend=gift_backend(config.replace(layers=("fc",)), name=f"oracle-{config.factor_source}"), fullgraph=True)
    outputs = []
    for step in range(steps):
        grad_out, x = step_data(rank, step)
        compiled(x, grad_out).backward()
        outputs.append(model.fc.parametrizations.weight.original.grad.clone())
        model.zero_grad()
    return outputs


@pytest.mark.parametrize("factor_source, wire", [("current_step", "fp8"), ("periodic", "fp8"), ("current_step", "fp4")])
def test_compiled_path_matches_the_oracle(factor_source, wire, ranks):
    # replicate() averages with an all_reduce in the compiled backward: whitened FP8 (or FP4)
    # reduce-scatter, owner re-quantization with error feedback, all-gather on the same wire.
    config = config_for(factor_source).replace(gift_dtype=wire)
    outputs = ranks(2).run(compiled_steps, config, 8)
    assert_agrees(outputs[0], oracle_outputs(2, config, "all_reduce", 8), f"compiled, {factor_source}, {wire}",
                  flip=1e-1 if wire == "fp4" else 1e-2)


def residual_across_a_refresh(rank, world):
    """Spy on what the reduce-scatter is asked to send at a refresh step and the step before."""
    sent = []
    original = comm.reduce_scattered

    def spy(encoded, incoming, shape, op, group, wire):
        result = original(encoded, incoming, shape, op, group, wire)
        # one rank, one scale: the only chunk is what was encoded, unpadded
        sent.append((encoded.chunks.reshape(shape).clone(), result.sent.clone()))
        return result

    comm.reduce_scattered = spy
    try:
        reducer = GiftReducer(config_for("periodic"))
        factors, grads = [], []
        for step in range(4):  # refreshes at steps 0 and 3
            grad_out, x = step_data(rank, step)
            grads.append(grad_out.T @ x)
            reducer.reduce_layer("fc", grads[-1], x, collective="reduce_scatter")
            factors.append([t.clone() for t in reducer.state.layer("fc").factor_tensors()])
    finally:
        comm.reduce_scattered = original
    return sent, factors, grads


def test_residual_moves_into_the_new_coordinates_at_a_refresh(ranks):
    # R_old = V_2 - deq(Q(V_2)) in step 2's coordinates; step 3 refreshes T, and what it sends
    # must be G_3 T_new + R_old T_old^-1 T_new (the paper's move), checked in float64.
    (sent, factors, grads), = ranks(1).run(residual_across_a_refresh)
    dense = [_dense(f) for f in factors]
    (t_old, t_old_inv), (t_new, _) = dense[2], dense[3]
    assert (t_new - t_old).norm() > 0.1 * t_old.norm()  # the refresh really changed T
    residual_old = sent[2][0].double() - sent[2][1].double()
    expected = grads[3].double() @ t_new + residual_old @ t_old_inv @ t_new
    error = (sent[3][0].double() - expected).norm() / residual_old.norm()
    assert error < 1e-4, f"the residual was not moved into the new coordinates (relative error {error:.2e})"


def _dense(factors):
    """Dense float64 T, T^-1 of low-rank factors [basis, coef, coef_inv, scale, scale_inv], as the
    wire uses them: T / scale and T^-1 * scale (oracle.symmetric_transform)."""
    basis, coef, coef_inv, scale, scale_inv = (t.double() for t in factors)
    eye = torch.eye(basis.shape[0], dtype=torch.float64)
    return (eye * scale + (basis * coef) @ basis.T) / scale, (eye * scale_inv + (basis * coef_inv) @ basis.T) * scale


class TwiceUsed(nn.Module):
    """One Linear layer used twice in a forward; each use's gradient part is ``grad_out_k^T x_k``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, D_OUT, bias=False)

    def forward(self, x1, g1, x2, g2):
        return (self.fc(x1) * g1).sum() + (self.fc(x2) * g2).sum()


def second_use(rank, step):
    grad_out, x = step_data(rank, step + 100)
    return grad_out, x[: TOKENS // 2] * 0.5


def twice_used_steps(rank, world, steps):
    torch.manual_seed(0)
    model = replicate(TwiceUsed())
    backend = gift_backend(config_for("current_step").replace(layers=("fc",)), name="twice")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    outputs = []
    for step in range(steps):
        (g1, x1), (g2, x2) = step_data(rank, step), second_use(rank, step)
        compiled(x1, g1[: x1.shape[0]], x2, g2[: x2.shape[0]]).backward()
        outputs.append(model.fc.parametrizations.weight.original.grad.clone())
        model.zero_grad()
    return outputs, {fqn: c.as_dict()["steps"] for fqn, c in backend.runtime.counters.items()}


def test_a_layer_used_twice_reduces_each_use_with_its_own_state(ranks):
    # replicate() all-reduces each use's part of the gradient; each part gets its own GIFT state
    # (its own statistics, its own residual): the sum must equal two independent oracles.
    steps = 6
    outputs, counters = ranks(2).run(twice_used_steps, steps)[0]
    assert counters == {"fc": steps, "fc#2": steps}  # one GIFT step per backward for each use
    statistics = config_for("current_step").statistics
    oracles = [OracleLayer(D_OUT, D_IN, 2, RANK, 0.3, collective="all_reduce", statistics=statistics) for _ in range(2)]
    want = []
    for step in range(steps):
        total = 0
        for oracle, use in zip(oracles, (step_data, second_use)):
            data = [use(r, step) for r in range(2)]
            grads = [g[: x.shape[0]].double().T @ x.double() for g, x in data]
            total = total + oracle.reduce(grads, [x for _, x in data])
        want.append(total)
    assert_agrees(outputs, want, "a layer used twice")
