"""Per-layer state, the live meter and the eager reference, on real gloo ranks."""

import datetime
import functools
import math
from typing import NamedTuple
from unittest import mock

import oracle
import pytest
import torch
import torch.distributed as dist
from torch import nn

from gift_compile import comm
from gift_compile.config import GiftConfig
from gift_compile.numerics import fp8_round_trip
from gift_compile.agreement import GiftConfigMismatch
from gift_compile.meter import COMPILE_MIN_NUMEL, SKETCH_COLUMNS, DeliveredMeter, Reading, Route
from gift_compile.geometry import identity_whitening
from gift_compile.reference import GiftReducer, GiftReference
from gift_compile.state import GiftState

D_OUT, D_IN, TOKENS, STEPS = 16, 32, 64, 40


def layer_inputs(rank, step):
    """Anisotropic, correlated layer inputs (like real activations) and a gradient with a
    persistent per-rank component, so FP8 rounding errors are systematic from step to step."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    mixing = torch.linspace(3, 0.05, D_IN)[:, None] * torch.randn(D_IN, D_IN, generator=torch.Generator().manual_seed(99))
    x = torch.randn(TOKENS, D_IN, generator=g) @ mixing
    grad_out = torch.randn(D_OUT, TOKENS, generator=torch.Generator().manual_seed(rank)) + 0.05 * torch.randn(D_OUT, TOKENS, generator=g)
    return grad_out @ x, x


def exact_avg(step, world):
    return sum(layer_inputs(r, step)[0].double() for r in range(world)) / world


def run_steps(rank, world, config, collective, steps=STEPS, whitened=True):
    reducer = GiftReducer(config)
    outputs, checksums = [], []
    for step in range(steps):
        grad, x = layer_inputs(rank, step)
        outputs.append(reducer.reduce_layer("fc", grad, x, collective=collective, whitened=whitened))
        checksums.append(reducer.state.checksum())
    restored = GiftState(config)
    restored.load_state_dict(reducer.state.state_dict())
    return {
        "outputs": outputs,
        "checksums": checksums,
        "state": reducer.state.state_dict(),
        "restored": restored.state_dict(),
        "counters": reducer.runtime.counters["fc"].as_dict(),
    }


CONFIG = GiftConfig(layers=("fc",), low_rank=8, fallback=False)


@pytest.fixture(scope="module")
def all_reduce_run(ranks):
    return ranks(2).run(run_steps, CONFIG, "all_reduce")


def test_reduced_gradients_and_bases_are_identical_on_all_ranks(all_reduce_run):
    first, second = all_reduce_run
    for a, b in zip(first["outputs"], second["outputs"]):
        assert torch.equal(a, b)
    assert first["checksums"] == second["checksums"]  # the same basis on both ranks, every step
    assert len({c.item() for c in first["checksums"]}) == STEPS  # and it moved every step


def test_state_dict_round_trip_is_exact(all_reduce_run):
    for rank_result in all_reduce_run:
        state, restored = rank_result["state"], rank_result["restored"]
        assert state.keys() == restored.keys()
        assert {"layers.fc.residual", "layers.fc.gather_residual", "layers.fc.basis"} <= state.keys()
        for key in state:
            same = torch.equal(state[key], restored[key]) if isinstance(state[key], torch.Tensor) else state[key] == restored[key]
            assert same, key


def test_gift_error_is_fp8_sized(all_reduce_run):
    # Each step quantizes twice (sender, then the owner of the reduced shard), each with its
    # residual carried over: a single step's error stays of the order of the e4m3 half-ulp 2^-4.
    for step, out in enumerate(all_reduce_run[0]["outputs"]):
        exact = exact_avg(step, 2)
        assert (out.double() - exact).norm() / exact.norm() < 2 * 2.0**-4, step


def running_sum_errors(outputs, world):
    total, exact_total, errors = 0, 0, []
    for step, out in enumerate(outputs):
        total = total + out.double()
        exact_total = exact_total + exact_avg(step, world)[: out.shape[0]]
        errors.append((total - exact_total).norm().item())
    return errors


@pytest.mark.parametrize("whitened", [True, False], ids=["gift", "euclidean"])
def test_error_feedback_bounds_the_accumulated_error(whitened, ranks):
    # Reduce-scatter quantizes once, on the sender: with error feedback the sum of what was
    # sent telescopes to the sum of the true gradients minus the last residual, so the running
    # error stays O(one step). Without it the systematic rounding error adds up every step.
    config = CONFIG.replace(euclidean_error_feedback=True)
    with_ef = ranks(2).run(run_steps, config, "reduce_scatter", STEPS, whitened)[0]["outputs"]
    without = config.replace(error_feedback=False, euclidean_error_feedback=False)
    without_ef = ranks(2).run(run_steps, without, "reduce_scatter", STEPS, whitened)[0]["outputs"]
    ef_errors, plain_errors = running_sum_errors(with_ef, 2), running_sum_errors(without_ef, 2)
    print(f"accumulated error after {STEPS} steps: with EF {ef_errors[-1]:.3g}, without {plain_errors[-1]:.3g}")
    assert max(ef_errors[STEPS // 2 :]) < 2 * max(ef_errors[: STEPS // 2])  # bounded, not growing
    assert plain_errors[-1] > 1.5 * plain_errors[STEPS // 8]  # grows with the number of steps
    assert plain_errors[-1] > 4 * ef_errors[-1]


def mismatched_shapes(rank, world, factor_source):
    reducer = GiftReducer(CONFIG.replace(low_rank=2, factor_source=factor_source))
    grad = torch.randn(8, 4 + rank)
    with pytest.raises(GiftConfigMismatch) as info:
        reducer.reduce_layer("fc", grad, torch.randn(10, 4 + rank))
    return str(info.value)


@pytest.mark.parametrize("factor_source", ["current_step", "periodic"])
def test_mismatched_shapes_across_ranks_raise(factor_source, ranks):
    messages = ranks(2).run(mismatched_shapes, factor_source)
    assert messages[0] == messages[1]  # every rank stops, with the same message
    assert "layer 'fc': rank 0: gift fp8 all_reduce(avg) [8, 4] x2; rank 1: gift fp8 all_reduce(avg) [8, 5] x2" in messages[0]


METER_D_OUT, METER_D_IN = 64, 48
WIDE_D_IN = 192
"""A layer wide enough that the meter compresses its reading's ``d_in`` side (``meter._compress``:
``2 (r + SKETCH_COLUMNS) <= d_in`` at the default ``r = 32``)."""


def meter_inputs(rank, step, d_in=METER_D_IN):
    """Inputs with a decaying spectrum and gradients with a persistent per-rank part, at a size
    where the meter's 32-row sketch is a sketch (64 output rows), for the delivered-error tests."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    mixing = torch.linspace(3, 0.05, d_in)[:, None] * torch.randn(d_in, d_in, generator=torch.Generator().manual_seed(99))
    x = torch.randn(TOKENS, d_in, generator=g) @ mixing
    grad_out = torch.randn(METER_D_OUT, TOKENS, generator=torch.Generator().manual_seed(rank)) + 0.3 * torch.randn(METER_D_OUT, TOKENS, generator=g)
    return grad_out @ x, x


def metered_steps(rank, world, config, collective, steps, inputs=meter_inputs, restore_after=None,
                  residual_guard=comm.RESIDUAL_GUARD):
    """GIFT's delivered gradients, and per step the counters' (one-step, accumulated) reading,
    whether the layer is on its fallback and the residuals the guard has dropped so far.
    ``restore_after``: after that step, carry on in a new reducer from a checkpoint of the state
    (its counters and meter window start afresh). ``residual_guard``: ``comm.RESIDUAL_GUARD``
    for this run (``math.inf``: none)."""
    reducer = GiftReducer(config)
    delivered, readings, fallback, dropped = [], [], [], []
    with mock.patch.object(comm, "RESIDUAL_GUARD", residual_guard):
        for step in range(steps):
            if step - 1 == restore_after:
                saved = reducer.state.state_dict()
                reducer = GiftReducer(config)
                reducer.state.load_state_dict(saved)
            grad, x = inputs(rank, step)
            delivered.append(reducer.reduce_layer("fc", grad, x, collective=collective).double())
            counters = reducer.runtime.counters["fc"].as_dict()
            readings.append((counters["error_vs_fp8"], counters["accumulated_vs_fp8"]))
            fallback.append(counters["fallback_until"] is not None)
            dropped.append(counters["residuals_dropped"])
    return delivered, readings, fallback, dropped


def euclidean_truth(world, config, collective, steps, inputs=meter_inputs):
    """Per step: the exact average, and what the Euclidean FP8 route with the same error
    feedback delivers, from the float64 oracle (T = I): not from the library's shadow."""
    d_out, d_in = inputs(0, 0)[0].shape
    euclidean = oracle.OracleLayer(d_out, d_in, world, rank=8, damping=config.damping,
                                   error_feedback=config.error_feedback, collective=collective, whiten=False)
    exact, delivered = [], []
    for step in range(steps):
        grads, xs = zip(*(inputs(r, step) for r in range(world)))
        exact.append(sum(g.double() for g in grads) / world)
        delivered.append(euclidean.reduce(list(grads), list(xs)))
    return exact, delivered


class MeteredRun(NamedTuple):
    """A 2-rank ``metered_steps`` run beside its truth (``euclidean_truth``)."""
    readings: list
    readings_of_rank_1: list
    fallback: list
    delivered: list
    exact: list
    euclidean: list
    ratios: list
    """Per step: GIFT's delivered error over the Euclidean route's, both against the exact average."""
    dropped: list
    """Per step: residuals the guard has dropped so far, per rank."""


def metered_against_the_truth(ranks, config, collective, steps, inputs=meter_inputs, residual_guard=comm.RESIDUAL_GUARD) -> MeteredRun:
    (delivered0, readings, fallback, dropped0), (delivered1, readings1, _, dropped1) = ranks(2).run(
        metered_steps, config, collective, steps, inputs, None, residual_guard)
    exact, euclidean = euclidean_truth(2, config, collective, steps, inputs)
    delivered = gathered([delivered0, delivered1], collective)
    ratios = [float((delivered[t] - exact[t]).norm() / (euclidean[t] - exact[t]).norm()) for t in range(steps)]
    return MeteredRun(readings, readings1, fallback, delivered, exact, euclidean, ratios, list(zip(dropped0, dropped1)))


def gathered(delivered_per_rank, collective):
    """The whole delivered gradient per step: rank 0's (all-reduce) or the ranks' rows joined."""
    if collective == "all_reduce":
        return delivered_per_rank[0]
    return [torch.cat(rows) for rows in zip(*delivered_per_rank)]


def true_reading(delivered, exact, euclidean, step, counted):
    """What a reading at ``step`` should say, from the truth: the delivered error over the
    Euclidean route's, of that step and summed over the ``counted`` steps up to it."""
    gift_error = [delivered[t] - exact[t] for t in range(step - counted + 1, step + 1)]
    euclidean_error = [euclidean[t] - exact[t] for t in range(step - counted + 1, step + 1)]
    return (float(gift_error[-1].norm() / euclidean_error[-1].norm()),
            float(sum(gift_error).norm() / sum(euclidean_error).norm()))


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("interval,window", [(4, 4), (10, 3)], ids=["shadow every step", "windowed shadow"])
def test_meter_reads_the_delivered_error_over_the_euclidean_routes(ranks, collective, interval, window):
    """The meter against the truth: GIFT's delivered gradient (the library's output, gathered
    from the ranks) and the oracle's Euclidean route, both against the exact average.

    Bound: 0.15 per reading, 0.05 for the mean signed gap. The sketch's relative spread on a
    norm is about sqrt(1 / (2 * 32 * r)) for an error of stable rank r; GIFT's error, mapped
    back by T^-1, sits in the inputs' few high-variance directions (r of a few), so about 5%
    on a ratio, unbiased. Besides the sketch: the shadow's second stage re-encodes GIFT's
    sum, not FP8's own (a different input with the same rounding statistics), and a windowed
    shadow's residuals have one step of history, not all of them."""
    config = GiftConfig(layers=("fc",), low_rank=8, fallback=False, meter_interval=interval, meter_window=window)
    check_meter_against_truth(ranks, config, collective, counted=min(window, interval))


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_a_wide_layers_compressed_reading_reads_the_delivered_error(ranks, collective):
    """The same on a layer wide enough that each reading's ``d_in`` side is sent as
    ``[M Q, M P Omega]`` (``meter._compress``), with the same bounds: the exact ``Q`` part holds
    GIFT's concentrated error, and ``Omega``'s spread on the near-isotropic rest (``d_in - r``
    = 160 directions, 32 columns) is a few percent, like the rows' sketch."""
    assert 2 * (32 + SKETCH_COLUMNS) <= WIDE_D_IN
    config = GiftConfig(layers=("fc",), low_rank=32, fallback=False, meter_interval=4, meter_window=4)
    check_meter_against_truth(ranks, config, collective, counted=4, inputs=functools.partial(meter_inputs, d_in=WIDE_D_IN))


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_meter_without_error_feedback_reads_the_delivered_error(ranks, collective):
    """The same without error feedback, one step per reading (the layer whose ``D`` lies near the
    wire's grid, where the shadow once over-read without error feedback, is the [CLS] test's
    below). Same bounds as above."""
    config = GiftConfig(layers=("fc",), low_rank=8, fallback=False, meter_interval=4, error_feedback=False)
    check_meter_against_truth(ranks, config, collective, counted=1)


def check_meter_against_truth(ranks, config, collective, counted, steps=40, inputs=meter_inputs):
    """Every reading after the first within 0.15 of the truth, the mean signed gap within 0.05
    (bounds: the test above), one verdict on every rank."""
    interval = config.meter_interval
    readings, readings1, _, delivered, exact, euclidean, _, _ = metered_against_the_truth(ranks, config, collective, steps, inputs)
    assert readings == readings1  # one verdict on every rank
    gaps = []
    for step in range(interval, steps, interval):  # readings after the first
        one_step, accumulated = true_reading(delivered, exact, euclidean, step, counted)
        reading = readings[step]
        assert reading[0] == pytest.approx(one_step, abs=0.15), step
        gaps.append(reading[0] - one_step)
        if config.error_feedback:
            assert reading[1] == pytest.approx(accumulated, abs=0.15), step
            gaps.append(reading[1] - accumulated)
        else:
            assert reading[1] is None
        assert readings[step + 1] == reading  # held until the next reading
    assert abs(sum(gaps) / len(gaps)) < 0.05
    assert sum(r[0] for r in readings[interval:]) / (steps - interval) < 0.95  # correlated inputs: whitening helps


def shadow_compiled_and_eager(rank, world, gift_dtype, collective):
    """The meter of a layer large enough that its shadow runs compiled, and the same meter forced
    eager, on the same steps: every share, residual and reading, and whether the first compiled."""
    d = 256  # 256 x 256: at least COMPILE_MIN_NUMEL
    assert d * d >= COMPILE_MIN_NUMEL
    config = GiftConfig(gift_dtype=gift_dtype, meter_interval=3, meter_window=2)
    route = Route.of(config, collective, "avg", None)
    compiled, eager = DeliveredMeter("fc", d, d, config), DeliveredMeter("fc", d, d, config)
    eager.compiled = False
    shard_rows = d // world
    seen = []
    for step in range(1, 8):
        g = torch.Generator().manual_seed(31 * step + rank)
        grad = torch.randn(d, d, generator=g) * torch.logspace(0, -3, d)  # columns of every size: saturation to flushing
        output = torch.randn(d if collective == "all_reduce" else shard_rows, d, generator=g)
        kept = torch.randn(shard_rows, d, generator=g) * 1e-3 if route.gather_error_feedback else None
        for meter in (compiled, eager):
            meter.before(step, grad, route, identity_whitening("lowrank", d, 32))
        held = [m.window.held if m.window is not None else None for m in (compiled, eager)]
        pending = [m.after(step, output, kept) for m in (compiled, eager)]
        readings = [p.result() if p is not None else None for p in pending]
        state = [[m.window.residual, m.window.gather_residual] if m.window is not None else [] for m in (compiled, eager)]
        seen.append((held, readings, state))
    return compiled.compiled, seen


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("gift_dtype", ["fp8", "fp4"])
def test_the_compiled_shadow_is_the_eager_shadow_bit_for_bit(ranks, gift_dtype, collective):
    """The meter's shadow runs compiled for large layers (it is 3-4x cheaper per metered step);
    the eager shadow is the one the tests above check against the oracle, so the compiled one
    must give the same bits: the same round trips (Inductor keeps the divisions and casts), the
    same GEMMs (extern), the same residuals and readings, on both routes and both wires."""
    for was_compiled, seen in ranks(2).run(shadow_compiled_and_eager, gift_dtype, collective):
        assert was_compiled
        readings = [r for _, pair, _ in seen for r in pair if r is not None]
        assert readings, "no reading was taken"
        for held, pair, state in seen:
            assert pair[0] == pair[1]
            for a, b in zip(*held) if held[0] is not None else ():
                assert torch.equal(a, b)
            for a, b in zip(*state):
                assert torch.equal(a, b)


def classifier_inputs(rank, step, d_in=METER_D_IN):
    """A layer that whitening by the inputs' statistics hurts (``stats_source = "inputs"``, this
    step's factors; the tests of the meter and the fallback built on it set it): like a classifier
    head fed by one [CLS] token per sequence. The inputs' variance lies in 8 of the 48 directions
    (a random rotation of the features, so not along the axes); the [CLS] token's own input lies
    in the quiet ones, and it is the only token with a gradient. So ``G = d x_cls^T`` lives where
    ``A`` is small: ``T = (A + m I)^-1/2`` only rescales it there, but the per-element FP8 error
    of ``G T`` spreads over every direction and ``T^-1`` multiplies its loud part by
    ``sqrt(lambda + m)`` on the way back: ``||E T^-1||^2 ~ sum_j (A + m I)_jj / m ~ 2 d`` against
    ``d`` for FP8 of ``G`` itself, i.e. about sqrt(2) times FP8's error (damping 1). Whitening
    by the gradients' own statistics (the default) sees where ``G`` lies, and helps here: 0.31-0.36x
    FP8's error on the reduce-scatter route."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    rotation = torch.linalg.qr(torch.randn(d_in, d_in, generator=torch.Generator().manual_seed(5)))[0]
    loud = 8
    z = torch.randn(TOKENS, d_in, generator=g) * torch.cat([torch.full((loud,), 10.0), torch.full((d_in - loud,), 0.1)])
    z[0, :loud] = 0  # the [CLS] token
    x = z @ rotation.T
    grad_out = torch.zeros(METER_D_OUT, TOKENS)
    grad_out[:, 0] = torch.randn(METER_D_OUT, generator=torch.Generator().manual_seed(rank)) + 0.3 * torch.randn(METER_D_OUT, generator=g)
    return grad_out @ x, x


@pytest.mark.parametrize("collective,error_feedback,d_in", [("reduce_scatter", True, METER_D_IN), ("all_reduce", True, METER_D_IN),
                                                           ("all_reduce", False, METER_D_IN), ("all_reduce", True, WIDE_D_IN)])
def test_a_layer_whitening_hurts_falls_back_to_what_fp8_delivers(ranks, collective, error_feedback, d_in):
    """The defaults (factors from this step, error feedback, a reading every 10 steps, fallback
    after 3 readings above 1) but the inputs' statistics, on a layer where GIFT is then worse
    than FP8 (``classifier_inputs``),
    against the truth (the library's delivered gradients and the oracle's Euclidean FP8 route,
    both against the exact average).

    Bounds: whitened, every step's error is above 1.15x FP8's (theory sqrt(2); the first steps
    less, while error feedback has little history). The meter is within 0.15 of the truth (as
    in the test above) and on its side of 1. After the third reading the layer is Euclidean FP8
    with error feedback, the same route as the oracle's with a different residual history: per
    step within 15% of it, within 5% on average, and the meter's shadow is GIFT's route: its
    readings stay above 1, within 0.15 of GIFT's ratio measured while whitened (the same layer,
    the same statistics), so no retry would be taken. On the all-reduce route this needs the
    meter's shadow to re-encode the second stage's input, not ``D`` (on ``T = I`` ``D`` re-encodes
    almost exactly: the meter read 1.4 there before), also without error feedback, where no
    gather residual is kept and the second stage's rounding error is reported for the meter. At
    ``WIDE_D_IN`` the readings are compressed (``meter._compress``): the error GIFT adds lies in
    the 8 loud directions, inside ``T``'s basis, which is sent exactly."""
    steps, config = 60, GiftConfig(layers=("fc",), error_feedback=error_feedback, stats_source="inputs")
    inputs = functools.partial(classifier_inputs, d_in=d_in)
    readings, readings1, fallback, delivered, exact, euclidean, ratios, _ = metered_against_the_truth(
        ranks, config, collective, steps, inputs)
    assert readings == readings1
    assert min(ratios[1:21]) > 1.15  # the case is real: whitening hurts this layer
    assert fallback.index(True) == 20 and all(fallback[20:])  # readings at 0, 10, 20 above 1
    after = ratios[22:]  # step 21 still delivers GIFT's last residual
    assert max(abs(r - 1) for r in after) < 0.15 and abs(sum(after) / len(after) - 1) < 0.05
    whitened_truth = sum(ratios[10:21]) / 11  # GIFT's error over FP8's per step, while it was whitened
    for step in range(10, steps, 10):
        assert (readings[step][1] is None) == (not error_feedback)  # accumulated: with error feedback only
        if step <= 20:  # whitened: the reading against the truth
            truth = true_reading(delivered, exact, euclidean, step, min(config.meter_window, config.meter_interval))
            for got, want in zip(readings[step][: 1 + error_feedback], truth):
                assert got == pytest.approx(want, abs=0.15), (step, readings[step], truth)
        else:  # the fallback's shadow is GIFT's route: it reads what GIFT delivered while whitened
            assert readings[step][0] == pytest.approx(whitened_truth, abs=0.15), (step, readings[step], whitened_truth)
        assert min(r for r in readings[step] if r is not None) > 1, step  # GIFT loses: no retry would be taken


def swapping_inputs(rank, step, d_in=METER_D_IN):
    """A layer whose inputs' loud directions swap every step: two 8-direction subspaces (a random
    rotation, so not along the axes) take turns at 1000x the other directions' standard deviation.
    With damping 1e-4 (the test's config) whitening with this step's factors still helps each
    step's own rounding, but error feedback's residual, unwhitened by the last step's ``T^-1``
    (x ``sqrt(lambda + m)`` ~ 1000 along the last step's loud directions) and whitened by this
    step's ``T`` (x ``1 / sqrt(lambda' + m)`` ~ 1/4 there: ``m`` = 1e-4 x the mean eigenvalue ~ 17,
    ``lambda'`` ~ 1), returns ~250x larger in the whitened coordinates: far more than e4m3's
    2^-4 relative rounding takes off, so the residual grows from step to step."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    rotation = torch.linalg.qr(torch.randn(d_in, d_in, generator=torch.Generator().manual_seed(5)))[0]
    loud = 8
    scale = torch.ones(d_in)
    scale[(step % 2) * loud:(step % 2 + 1) * loud] = 1e3
    x = (torch.randn(TOKENS, d_in, generator=g) * scale) @ rotation.T
    grad_out = torch.randn(METER_D_OUT, TOKENS, generator=torch.Generator().manual_seed(rank)) + 0.3 * torch.randn(METER_D_OUT, TOKENS, generator=g)
    return grad_out @ x, x


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_without_the_residual_guard_diverging_error_feedback_falls_back_at_its_first_reading(ranks, collective):
    """GIFT worse than FP8 only through error feedback (``swapping_inputs``), with the residual
    guard off (``comm.RESIDUAL_GUARD = inf``; the next test has it on), against the truth (the
    library's delivered gradients and the float64 oracle's Euclidean route with the same error
    feedback, both against the exact average), with the defaults but the damping.

    Without error feedback GIFT beats FP8 at every step (measured 0.66-0.82x; bound 0.9) and
    never falls back. With it the residual diverges (measured 1.3x FP8's error at step 1, 2.6x at
    step 2, doubling per step), so every step from 2 on is above 2x; the reading at step 0 (no
    residual yet) is below 1, the one at step 10 far above ``FAR_OVER``, so the layer falls back
    at once (step 11), not after ``fallback_patience`` readings (step 31, by when the error was
    1e10x FP8's). On the reduce-scatter route that reading is within 10% of the truth (the
    sketch's spread); on the all-reduce route the shadow's second stage re-encodes the delivered
    rows, which carry GIFT's diverged error, so it under-reads (64 where the truth is 4,500) but
    is still far above 2. On the fallback (Euclidean FP8 with error feedback, the residual carried
    in the gradient's coordinates) the diverged residual is delivered and shrinks by the wire's
    rounding each step: over steps 20-29, each step is within 15% of FP8's error, 5% on average."""
    steps = 30
    config = GiftConfig(layers=("fc",), damping=1e-4)
    without, with_ = (metered_against_the_truth(ranks, config.replace(error_feedback=error_feedback), collective, steps,
                                                swapping_inputs, math.inf) for error_feedback in (False, True))
    for run in (without, with_):
        assert run.readings == run.readings_of_rank_1
    assert max(without.ratios) < 0.9 and not any(without.fallback)
    assert all(without.readings[step][0] < 1 for step in range(0, steps, 10))
    readings, _, fallback, delivered, exact, euclidean, ratios, dropped = with_
    assert dropped[-1] == (0, 0)
    assert min(ratios[2:11]) > 2  # the case is real: error feedback makes GIFT worse than FP8 with it
    assert readings[0][0] < 1 and fallback.index(True) == 10 and all(fallback[10:])  # Euclidean from step 11
    assert min(readings[10]) > 2
    if collective == "reduce_scatter":
        truth = true_reading(delivered, exact, euclidean, 10, config.meter_window)
        for got, want in zip(readings[10], truth):
            assert got == pytest.approx(want, rel=0.1)
    after = ratios[20:]
    assert max(abs(r - 1) for r in after) < 0.15 and abs(sum(after) / len(after) - 1) < 0.05, after


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_the_residual_guard_holds_error_feedback_that_would_diverge(ranks, collective):
    """The case above with the shipped residual guard (``comm.keeps_residual``). From step 1 on
    every carried residual is larger, whitened, than the whitened gradient it would ride on
    (measured 2.1-2.5x with input statistics; a layer that trains normally: 0.03-0.05x), so each rank drops it: one per
    step on the reduce-scatter route, two on the all-reduce route (its second stage too). Then:

    * against the truth (the oracle's Euclidean FP8 route with error feedback, the exact average),
      GIFT is below FP8 at every step (measured 0.32-0.51x, 0.47-0.77x with input statistics;
      bound 0.9), and the layer never falls
      back. The meter reads it: every reading below 1, each within 0.15 of the truth (the bound of
      the delivered-error tests above; measured gaps 0.01-0.06);
    * against the float64 oracle's GIFT route, which applies the same rule in its own
      formulation (residuals kept in whitened coordinates and moved at each new ``T``), the
      delivered error has the same size at every step: within 15% (measured 0.98-1.03x, mean 1.00;
      0.92-1.09x with input statistics;
      the two round off differently, so their errors are compared, not their outputs). Without
      the rule the oracle's route diverges like the library's in the test above."""
    steps = 30
    config = GiftConfig(layers=("fc",), damping=1e-4)
    readings, readings1, fallback, delivered, exact, euclidean, ratios, dropped = metered_against_the_truth(
        ranks, config, collective, steps, swapping_inputs)
    assert readings == readings1
    per_step = 1 if collective == "reduce_scatter" else 2
    assert dropped == [(per_step * step,) * 2 for step in range(steps)]
    assert max(ratios) < 0.9 and not any(fallback), ratios
    for step in range(0, steps, config.meter_interval):
        truth = true_reading(delivered, exact, euclidean, step, min(step + 1, config.meter_window))
        assert all(got < 1 for got in readings[step])
        for got, want in zip(readings[step], truth):
            assert got == pytest.approx(want, abs=0.15), (step, readings[step], truth)
    gift = oracle.OracleLayer(METER_D_OUT, METER_D_IN, 2, rank=config.low_rank, damping=config.damping, collective=collective,
                              statistics=config.statistics)
    for step in range(steps):
        grads, xs = zip(*(swapping_inputs(r, step) for r in range(2)))
        oracle_error = (gift.reduce(list(grads), list(xs)) - exact[step]).norm()
        assert (delivered[step] - exact[step]).norm() / oracle_error == pytest.approx(1, abs=0.15), step


def second_stage_inputs(rank, step, d_in=METER_D_IN):
    """A layer where GIFT wins the first stage and loses the all-reduce's second: the [CLS] layer
    (``classifier_inputs``: only token 0 has a gradient, its input in the quiet directions, where
    whitening hurts) plus a gradient on the other tokens that is the same on both ranks but for
    its sign. Those tokens' inputs are shared and loud, so this part dominates each rank's
    gradient in FP8's coordinates but is shrunk by ``T`` in GIFT's; and it cancels in the sum, so
    the reduced gradient the second stage encodes is the [CLS] part alone, on which whitening
    costs about ``sqrt(1 + 1 / damping)`` times FP8's error."""
    shared = torch.Generator().manual_seed(7919 * step + 1000)
    own = torch.Generator().manual_seed(7919 * step + rank)
    rotation = torch.linalg.qr(torch.randn(d_in, d_in, generator=torch.Generator().manual_seed(5)))[0]
    loud = 8
    scale = torch.cat([torch.full((loud,), 10.0), torch.full((d_in - loud,), 0.1)])
    z = torch.randn(TOKENS, d_in, generator=shared) * scale
    z[0] = torch.randn(d_in, generator=own) * scale
    z[0, :loud] = 0  # the [CLS] token
    x = z @ rotation.T
    grad_out = torch.zeros(METER_D_OUT, TOKENS)
    grad_out[:, 0] = torch.randn(METER_D_OUT, generator=torch.Generator().manual_seed(rank)) + 0.3 * torch.randn(METER_D_OUT, generator=own)
    grad_out[:, 1:] = 0.016 * torch.randn(METER_D_OUT, TOKENS - 1, generator=shared) * (1 if rank == 0 else -1)
    return grad_out @ x, x


def test_a_layer_the_second_stage_makes_worse_than_fp8_falls_back(ranks):
    """GIFT worse than FP8 only through the all-reduce's second stage (``second_stage_inputs``),
    against the truth (the library's delivered gradients and the float64 oracle's Euclidean
    route, both against the exact average), damping 0.05, no error feedback (so that error
    feedback plays no part; the defaults otherwise).

    The size of the cancelling part (0.016) puts the case between the stages: on the
    reduce-scatter route (the first stage only) GIFT's error is below FP8's on average
    (measured 0.95x over the first 21 steps, 0.79-1.11x per step, so a reading can be above 1;
    bound: the mean below 1 and no fallback: patience absorbs a single reading above 1); on the
    all-reduce route it is above on average (measured 1.23x, 1.01-1.48x per step; bound 1.1),
    the meter reads above 1 at every reading (measured 1.14-1.25, truth 1.07-1.41) and the
    layer falls back at the third (step 20). From step 21 on it delivers exactly what the
    oracle's Euclidean route does (same route, no error feedback: within 1%, fp32 against
    float64)."""
    steps = 30
    config = GiftConfig(layers=("fc",), damping=0.05, error_feedback=False, stats_source="inputs")
    means = {}
    for collective in ("reduce_scatter", "all_reduce"):
        readings, readings1, fallback, _, _, _, ratios, _ = metered_against_the_truth(
            ranks, config, collective, steps, second_stage_inputs)
        assert readings == readings1
        means[collective] = sum(ratios[:21]) / 21
        if collective == "reduce_scatter":
            assert not any(fallback)
        else:
            assert all(readings[step][0] > 1 for step in (0, 10, 20))
            assert fallback.index(True) == 20
            assert max(abs(r - 1) for r in ratios[21:]) < 0.01
    assert means["reduce_scatter"] < 1 < 1.1 < means["all_reduce"], means


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_on_the_fallback_each_gift_shadow_reading_is_what_the_oracles_gift_route_would_deliver(ranks, collective):
    """The [CLS] layer on its fallback (from step 21), on both routes, defaults (a reading
    every 10 steps, a window of 2: the shadow starts its residuals at steps 8, 18, ... and counts
    9 and 10). Each reading against its own truth: the float64 oracle's GIFT route (whitened,
    error feedback, this step's factors), its residuals restarted where the shadow's window
    starts, over the Euclidean gradient the library delivered, both against the exact average.

    Bound: 0.15 per reading, 0.05 for the mean signed gap, as for the whitened readings above
    (the sketch's spread; the library's factors are fp32, the oracle's float64; on the all-reduce
    route the shadow's second stage re-encodes the delivered rows plus their rounding error, the
    oracle its own first stage's sum: different inputs with the same rounding statistics).
    Measured: gaps -0.02 to +0.11 on readings of 1.3-1.6, mean +0.04 on either route; with 2,048
    sketch rows instead of 32 the reduce-scatter readings agree with the oracle within 0.01, so
    that is the sketch's spread, not a bias."""
    config, steps = GiftConfig(layers=("fc",), stats_source="inputs"), 60
    (delivered0, readings, fallback, _), (delivered1, _, _, _) = ranks(2).run(
        metered_steps, config, collective, steps, classifier_inputs)
    delivered = gathered([delivered0, delivered1], collective)
    assert fallback.index(True) == 20
    gift = oracle.OracleLayer(METER_D_OUT, METER_D_IN, 2, rank=config.low_rank, damping=config.damping, collective=collective,
                              statistics=config.statistics)
    shadow_errors, gaps = {}, []
    for step in range(steps):
        grads, xs = zip(*(classifier_inputs(r, step) for r in range(2)))
        if step % config.meter_interval == config.meter_interval - config.meter_window:  # a window's first step
            gift.residuals = [torch.zeros_like(r) for r in gift.residuals]
            gift.gather_residuals = [torch.zeros_like(r) for r in gift.gather_residuals]
        exact = sum(g.double() for g in grads) / 2
        shadow_errors[step] = (gift.reduce(list(grads), list(xs)) - exact, delivered[step] - exact)
        if step > 20 and step % config.meter_interval == 0:
            counted = [shadow_errors[t] for t in range(step - config.meter_window + 1, step + 1)]
            truth = (float(counted[-1][0].norm() / counted[-1][1].norm()),
                     float(sum(e for e, _ in counted).norm() / sum(d for _, d in counted).norm()))
            for got, want in zip(readings[step], truth):
                assert got == pytest.approx(want, abs=0.15), (step, readings[step], truth)
                gaps.append(got - want)
    assert len(gaps) == 6 and abs(sum(gaps) / len(gaps)) < 0.05, gaps


def falling_back(rank, world):
    # Periodic factors from the first step's inputs, then inputs from another distribution:
    # stale factors amplify what had little variance, and GIFT loses to FP8.
    config = GiftConfig(layers=("fc",), low_rank=8, factor_source="periodic", refresh_interval=1000, damping=1e-3,
                        meter_interval=1, fallback_patience=2, fallback_retry=3)
    reducer = GiftReducer(config)
    paths = []
    for step in range(14):
        grad, x = layer_inputs(rank, step)
        if step:
            x = x.flip(1)  # the energy moves to the inputs that had none
            grad = torch.randn(D_OUT, TOKENS, generator=torch.Generator().manual_seed(step)) @ x
        reducer.reduce_layer("fc", grad, x, collective="reduce_scatter")
        counters = reducer.runtime.counters["fc"].as_dict()
        paths.append((counters["error_vs_fp8"], counters["fallback_until"]))
    return paths


def test_a_layer_that_whitening_hurts_is_retried_only_when_its_gift_shadow_wins(ranks):
    """Patience 2, retry after 3 steps, a reading every step. On the fallback the meter's shadow
    is GIFT's route (the layer's own stale ``T``), so the readings still compare GIFT with FP8;
    a retry is taken only if the last one is at or below 1, else it fails unseen: the wait
    doubles and not one step is sent whitened."""
    paths = ranks(2).run(falling_back)[0]
    ratios, until = [p[0] for p in paths], [p[1] for p in paths]
    assert ratios[1] > 1 and ratios[2] > 1  # stale factors: worse than FP8
    assert until[:2] == [None, None] and until[2:5] == [6] * 3  # Euclidean from step 3
    # GIFT's shadow: still worse, so no retry (step 3, the fallback's first, still delivers the
    # residual GIFT kept while whitened, and its shadow has no history yet: not a comparison)...
    assert all(r > 1 for r in ratios[4:]), paths
    assert until[5:11] == [12] * 6 and until[11:] == [24] * 3  # ...at 6 (wait 3 -> 6) nor at 12 (-> 12)


def test_a_run_restored_on_its_fallback_gates_its_retry_as_the_run_it_continues(ranks):
    """The [CLS] layer (whitening hurts), a reading every 2 steps, patience 2, retry after 5: it
    falls back after the readings at 0 and 2, Euclidean until step 8; the GIFT shadow's reading at
    step 6 is above 1, so the retry due at 8 is skipped (until 8 + 10; at 18 again). A run restored from a
    checkpoint saved after step 6 has no reading before the retry (step 7 has none), so it decides
    from the verdict in the state, as the run it continues does: a blind retry would whiten step
    8, read above 1 there and fall back from 9 (until 19)."""
    config = GiftConfig(layers=("fc",), meter_interval=2, meter_window=1, fallback_patience=2, fallback_retry=5,
                        stats_source="inputs")
    steps = 20
    straight = ranks(2).run(metered_steps, config, "reduce_scatter", steps, classifier_inputs)[0][2]
    restored = ranks(2).run(metered_steps, config, "reduce_scatter", steps, classifier_inputs, 6)[0][2]
    assert not any(straight[:2]) and all(straight[2:]), straight  # the retries due at 8 and 18 skipped
    assert restored == straight


def recovering_inputs(rank, step):
    """The [CLS]-like layer (whitening hurts) until step 12, then correlated inputs (it helps)."""
    return classifier_inputs(rank, step) if step < 12 else meter_inputs(rank, step)


def test_a_layer_is_retried_once_its_gift_shadow_wins(ranks):
    """Current-step factors, a reading every 2 steps, patience 2, retry after 6. The layer falls
    back after the readings at steps 0 and 2; its GIFT shadow reads above 1 until the inputs
    change at step 12, so the retry due at step 9 is skipped (Euclidean until 9 + 12 = 21); by
    step 20 the shadow reads below 1, the retry at 21 is taken, and GIFT then delivers less error
    than FP8 (the readings, and the truth from the oracle's Euclidean route)."""
    config = GiftConfig(layers=("fc",), meter_interval=2, meter_window=1, fallback_patience=2, fallback_retry=6,
                        stats_source="inputs")
    steps = 34
    readings, _, fallback, _, _, _, ratios, _ = metered_against_the_truth(ranks, config, "reduce_scatter", steps, recovering_inputs)
    shown = [(round(r[0], 2), f) for r, f in zip(readings, fallback)]
    assert not any(fallback[:2]) and all(fallback[2:20]) and not any(fallback[20:]), shown
    assert all(readings[t][0] > 1 for t in range(4, 11, 2)), shown  # the shadow: GIFT would lose
    assert readings[20][0] < 1 and all(readings[t][0] < 1 for t in range(22, steps)), shown
    assert max(ratios[23:]) < 1, [round(r, 2) for r in ratios]


def recovering_at_the_retry(rank, step):
    """The [CLS]-like layer until step 4, correlated inputs from step 5 (see the test below)."""
    return classifier_inputs(rank, step) if step < 5 else meter_inputs(rank, step)


def settled_at(rank, world, each_step: bool, steps: int = 8):
    """A reading every step, patience 2, retry after 4, on :func:`recovering_at_the_retry`: the
    delivered gradients, whether a reading was on its way when each step returned, and (read
    after every step, ``each_step``, or only at the end) the counters' fallback."""
    config = GiftConfig(layers=("fc",), meter_interval=1, meter_window=1, fallback_patience=2, fallback_retry=4,
                        stats_source="inputs")
    reducer = GiftReducer(config)
    delivered, in_flight, until = [], [], []
    for step in range(steps):
        grad, x = recovering_at_the_retry(rank, step)
        delivered.append(reducer.reduce_layer("fc", grad, x, collective="reduce_scatter"))
        in_flight.append("fc" in reducer.runtime.readings)
        if each_step:
            until.append(reducer.runtime.counters["fc"].fallback_until)
    return delivered, in_flight, until, reducer.runtime.counters["fc"].as_dict()


def test_a_reading_acts_from_the_next_step_whenever_its_sum_arrives(ranks):
    """The meter's all-reduce is not waited for in the step that takes the reading: it is settled
    at the layer's next step, or earlier where something needs it (the counters read after every
    step here, or a retry decided at this step's end). Either way the schedule is the one a
    reading acted on at once gives: the layer falls back after the readings at steps 0 and 1
    (Euclidean from 2 until 6). The retry due at 6 is decided at step 5's end by the GIFT
    shadow's reading *at step 5*, taken on the new inputs (below 1: retried), not by the one at
    step 4 (above 1, which would skip it: Euclidean until 14)."""
    settled_each_step = ranks(2).run(settled_at, True)
    settled_when_needed = ranks(2).run(settled_at, False)
    delivered, in_flight, until, counters = settled_each_step[0]
    # Every step returned with its reading still on its way but step 5, whose end decides the retry.
    assert in_flight == [True] * 5 + [False] + [True] * 2, in_flight
    assert until[:1] == [None] and until[1:5] == [6] * 4 and until[5] is None, until
    assert counters["fallbacks"] >= 1
    for (a, _, _, last_a), (b, flying, _, last_b) in zip(settled_each_step, settled_when_needed):
        assert flying == in_flight
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # the same route, damping and residuals every step
        assert last_a == last_b


def reading_beside_a_late_peer(rank, world, steps=4):
    """Rank 1 enters each step's meter completion only once rank 0 has finished that step (a
    message on a group of its own, 20 s timeout): a reading that waited for its sum inside the
    step would wait for rank 1 while rank 1 waits for it."""
    signal = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    config = GiftConfig(layers=("fc",), meter_interval=2, meter_window=1)
    reducer = GiftReducer(config)
    complete = DeliveredMeter.after

    def after_rank_0_finished_its_step(meter, *args, **kwargs):
        dist.recv(torch.zeros(1), src=0, group=signal)
        return complete(meter, *args, **kwargs)

    with mock.patch.object(DeliveredMeter, "after", after_rank_0_finished_its_step if rank == 1 else complete):
        for step in range(steps):
            grad, x = meter_inputs(rank, step)
            reducer.reduce_layer("fc", grad, x, collective="reduce_scatter")
            if rank == 0:
                dist.send(torch.ones(1), dst=1, group=signal)
    return reducer.runtime.counters["fc"].as_dict()["error_vs_fp8"]


def test_a_reading_does_not_hold_up_its_step(ranks):
    """Rank 0 finishes each step, reading steps included, before rank 1 has added its share of
    the reading (module ``reading_beside_a_late_peer``); the readings then arrive, the same on
    both ranks."""
    readings = ranks(2).run(reading_beside_a_late_peer)
    assert readings[0] is not None and readings[0] == readings[1]


def test_failed_retries_fall_back_at_once_for_ever_longer():
    """The fallback's schedule, reading by reading (patience 2, retry 5): a retried layer falls
    back at its first reading above 1, for 2x, 4x, ... the wait (capped at 64x); a reading at or
    below 1 ends the probation, and the next fallback again needs 2 readings and waits 5 steps."""
    config = GiftConfig(layers=("fc",), fallback_patience=2, fallback_retry=5)
    layer = GiftState(config).layer("fc", 4, 8, torch.device("cpu"), whitened=True)

    def read_at(step, value):
        layer.step.fill_(step)
        assert layer.whitening_on(), step
        layer.record_reading(Reading(value, None))
        return None if layer.whitening_on() else int(layer.fallback_until)

    assert [read_at(0, 1.2), read_at(1, 1.2)] == [None, 1 + 1 + 5]
    assert read_at(7, 1.2) == 7 + 1 + 10  # retry 1: at once, 2x
    assert read_at(18, 1.2) == 18 + 1 + 20  # retry 2: 4x
    assert [read_at(39, 0.9), read_at(40, 1.2), read_at(41, 1.2)] == [None, None, 41 + 1 + 5]  # probation over
    for failed in range(1, 9):  # the wait doubles up to 64x, then stays
        until = read_at(int(layer.fallback_until), 1.2)
        assert until - int(layer.step) - 1 == 5 * 2 ** min(failed, 6)


def test_the_worse_reading_decides_the_fallback():
    """One-step readings below 1 do not keep a layer whitened whose accumulated error (what error
    feedback exists for) is above Euclidean's: the verdict is the worse of the two."""
    config = GiftConfig(layers=("fc",), fallback_patience=2, fallback_retry=5)
    layer = GiftState(config).layer("fc", 4, 8, torch.device("cpu"), whitened=True)
    layer.record_reading(Reading(0.8, 1.3))
    assert int(layer.meter_over) == 1 and layer.whitening_on()
    layer.record_reading(Reading(0.8, 1.3))
    assert not layer.whitening_on() and int(layer.fallback_until) == 6
    other = GiftState(config).layer("fc", 4, 8, torch.device("cpu"), whitened=True)
    for reading in (Reading(0.8, 1.3), Reading(0.9, 0.95), Reading(1.2, None)):  # a reading at or below 1 resets the count
        other.record_reading(reading)
    assert other.whitening_on() and int(other.meter_over) == 1


def test_adaptive_damping_climbs_towards_lower_readings():
    """Each reading moves the damping by a factor of 2: on while the readings do not get worse,
    back when one does; at an end of its range (2^-7 to 2^7 times the start) it stays and turns."""
    config = GiftConfig(layers=("fc",), damping=0.5, adaptive_damping=True, fallback=False)
    layer = GiftState(config).layer("fc", 4, 8, torch.device("cpu"), whitened=True)
    assert layer.damping == 0.5
    seen = []
    for verdict in (0.6, 0.5, 0.4, 0.45, 0.42, 0.44):
        layer.record_reading(Reading(verdict, None))
        seen.append(layer.damping / 0.5)
    # first reading: the first move (stronger whitening); better, better: on; worse: back;
    # better than that worse one: on (the same way back); worse: turn again.
    assert seen == [2**-1, 2**-2, 2**-3, 2**-2, 2**-1, 2**-2]
    for i in range(6):  # better and better: down to the end of the range, where it stays and turns
        layer.record_reading(Reading(0.3 - 0.01 * i, None))
    assert layer.damping / 0.5 == 2**-7 and int(layer.damping_direction) == 1
    layer.record_reading(Reading(0.2, None))
    assert layer.damping / 0.5 == 2**-6
    fixed = GiftState(GiftConfig(layers=("fc",))).layer("fc", 4, 8, torch.device("cpu"), whitened=True)
    fixed.record_reading(Reading(0.3, None))
    assert fixed.damping == 1.0  # the default keeps its damping


@pytest.mark.parametrize("damping", [0.05, 20.0])
def test_damping_sets_the_whitening_strength(damping):
    """What the controller moves: low damping whitens (T's spread follows the input spectrum),
    high damping brings T towards a multiple of I, Euclidean (independent check: T's condition
    number against A's spectrum, from the definition (A + damping * mean_eig * I)^-1/2)."""
    from gift_compile.geometry import initial_basis, input_sketch, whitening_from_sketch

    d, r = 16, 16  # full rank: T is exactly the damped inverse square root
    scales = torch.logspace(0, 2, d)
    x = torch.randn(4096, d, generator=torch.Generator().manual_seed(0)) * scales
    basis, one = initial_basis(d, r), torch.ones(())
    for _ in range(30):  # the subspace iteration converges on the eigenvectors
        _, basis, _ = whitening_from_sketch(input_sketch(x, basis, one), basis, one, damping)
    t = whitening_from_sketch(input_sketch(x, basis, one), basis, one, damping)[0].matrix().double()
    eig = torch.linalg.eigvalsh((x.T @ x).double() / x.shape[0])
    shifted = eig + damping * eig.mean()
    want = (shifted.max() / shifted.min()).sqrt()  # condition number of (A + shift I)^-1/2
    got = torch.linalg.cond(t)
    assert abs(got / want - 1) < 1e-3  # fp32 factors of a float64 derivation
    # input variances span 1e4: T's spread is ~10x at low damping, within 20% of flat at high
    assert got < 1.2 if damping > 1 else got > 5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(16, 32), nn.Linear(32, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


def model_step(rank, world, config):
    torch.manual_seed(0)
    model = MLP()
    reference = GiftReference(model, config)
    x = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    reference.reduce_gradients()
    return local, {n: p.grad for n, p in model.named_parameters()}, reference.selected


@pytest.mark.parametrize("euclidean_error_feedback", [False, True])
def test_reference_reduces_every_parameter_of_a_model(euclidean_error_feedback, ranks):
    config = GiftConfig(layers=("fc2",), low_rank=4, euclidean_error_feedback=euclidean_error_feedback)
    results = ranks(2).run(model_step, config)
    (local0, reduced0, selected), (local1, reduced1, _) = results
    assert selected == ["fc2"]
    for name in local0:
        exact = (local0[name].double() + local1[name].double()) / 2
        err = (reduced0[name].double() - exact).norm() / exact.norm()
        # fp32 path (biases, norm): exact to rounding; FP8 paths: two e4m3 roundings.
        limit = 2 * 2.0**-4 if name.endswith("weight") and name.startswith("fc") else 1e-6
        assert err < limit, (name, err)
        assert torch.equal(reduced0[name], reduced1[name])


def test_patterns_matching_nothing_list_the_linear_layers():
    with pytest.raises(ValueError, match=r"\['w9'\] match no Linear layer.*\['fc1', 'fc2'\]"):
        GiftReference(MLP(), GiftConfig(layers=("w9",)))


@pytest.mark.parametrize("config", [CONFIG, CONFIG.replace(factor_source="periodic")], ids=["current_step", "periodic"])
def test_state_lives_on_the_gradients_device_and_bookkeeping_on_the_host(config):
    # "meta" stands in for an accelerator here: which buffers move must not depend on which
    # device it is. Step counts and the fallback state stay on the host, so the per-step
    # checks (refresh due? on the fallback?) never wait for a GPU.
    state = GiftState(config)
    layer = state.layer("fc", D_OUT, D_IN)  # created before any gradient, as a checkpoint load does
    assert state.layer("fc", D_OUT, D_IN, torch.device("meta")) is layer
    devices = {name: buffer.device.type for name, buffer in layer.named_buffers()}
    controller = {"damping_exponent", "damping_direction", "last_verdict"} if layer.current_step else set()  # adaptive_damping's
    assert {name for name, device in devices.items() if device == "cpu"} == {"shape", "step", "refreshes", "fallback_until", "meter_over", "fallbacks_in_a_row", "shadow_verdict"} | controller
    assert devices["residual"] == "meta" and all(d == "meta" for n, d in devices.items() if n.startswith(("basis", "factor_", "moment")))
    assert layer.whitening_on()
    moved = GiftState(config)
    moved.layer("fc", D_OUT, D_IN)
    moved.to("meta")  # Module.to moves the state too, but not the host bookkeeping
    assert moved.layer("fc").residual.device.type == "meta" and moved.layer("fc").step.device.type == "cpu"
    assert moved.layer("fc").device.type == "meta"


def statistics_on_the_wire(rank, world, stats_dtype, steps=12):
    """Per step: GIFT's delivered gradient and the layer's basis fingerprint, and the statistics'
    bytes, with the current-step statistics summed in ``stats_dtype``."""
    reducer = GiftReducer(GiftConfig(layers=("fc",), fallback=False, stats_dtype=stats_dtype))
    delivered, checksums = [], []
    for step in range(steps):
        grad, x = meter_inputs(rank, step)
        delivered.append(reducer.reduce_layer("fc", grad, x, collective="all_reduce").double())
        checksums.append(float(reducer.state.checksum()))
    return delivered, checksums, reducer.runtime.counters["fc"].as_dict()["stats_bytes"]


def test_bf16_statistics_halve_their_bytes_and_deliver_what_fp32_statistics_do(ranks):
    """``stats_dtype = "bf16"``: each rank's sketch rounds to 8 mantissa bits (2^-9 relative) and
    gloo sums in bf16. Bounds: every rank still builds the same factors from the same summed bytes
    (identical fingerprints); half the statistics' bytes; and the delivered error, against the
    exact average, within 10% of fp32 statistics' step by step and 3% on average: a relative
    perturbation of 2^-8 in ``A`` moves ``T`` by about as much, which changes which elements FP8
    rounds up, not the size of its error (the error of one FP8 step itself varies by a few percent
    between steps)."""
    runs = {dtype: ranks(2).run(statistics_on_the_wire, dtype) for dtype in ("fp32", "bf16")}
    for dtype, ((_, sums0, bytes0), (_, sums1, _)) in runs.items():
        assert sums0 == sums1, dtype
    assert runs["bf16"][0][2] * 2 == runs["fp32"][0][2]
    steps = len(runs["fp32"][0][0])
    exact = [sum(meter_inputs(r, t)[0].double() for r in range(2)) / 2 for t in range(steps)]
    ratios = [float((runs["bf16"][0][0][t] - exact[t]).norm() / (runs["fp32"][0][0][t] - exact[t]).norm()) for t in range(steps)]
    assert runs["bf16"][0][1] != runs["fp32"][0][1]  # the rounding is real: other factors
    assert max(abs(r - 1) for r in ratios) < 0.10 and abs(sum(ratios) / steps - 1) < 0.03, ratios
