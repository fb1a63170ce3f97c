import pytest
import torch

from gift_compile.collectives import WireFormat, round_trip
from gift_compile.geometry import (
    SKETCH_SCALE_SHRINK, Whitening, factorize, input_sketch, second_moment, top_eigenpairs, whitening_from_sketch,
    whitening_from_sketches,
)

ONE = torch.ones(())  # the sketch scale of inputs of ordinary magnitude

torch.set_default_dtype(torch.float32)


def anisotropic_moment(d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    spectrum = torch.logspace(2, -2, d, dtype=torch.float64)
    return ((basis * spectrum) @ basis.T).float()


CASES = [
    dict(factorization="cholesky", rank=None),
    dict(factorization="symmetric", rank=None),
    dict(factorization="symmetric", rank=6),
    dict(factorization="cholesky", rank=6),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_transform_times_inverse_is_identity(case):
    w = factorize(anisotropic_moment(24), damping=1e-4, **case)
    product = w.matrix() @ w.matrix(inverse=True)
    # fp32 factors of a matrix with condition number ~1e4: products are exact to ~1e-4.
    torch.testing.assert_close(product, torch.eye(24), atol=2e-4, rtol=0)
    g = torch.randn(5, 24)
    torch.testing.assert_close(w.unwhiten(w.whiten(g)), g, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("factorization", ["cholesky", "symmetric"])
def test_whitened_samples_have_identity_covariance(factorization):
    d, n = 16, 50_000
    a = anisotropic_moment(d, seed=1).double()
    samples = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) @ torch.linalg.cholesky(a).T
    moment, tokens = second_moment(samples)
    w = factorize(moment / tokens, factorization=factorization, rank=None, damping=1e-9)
    white = samples.float() @ w.matrix()
    # T^T A_hat T = I holds exactly for the sample moment A_hat; fp32 rounding leaves ~1e-3.
    torch.testing.assert_close(white.T @ white / n, torch.eye(d), atol=5e-3, rtol=0)


def test_full_rank_low_rank_equals_full_symmetric():
    a = anisotropic_moment(20)
    low = factorize(a, factorization="symmetric", rank=20, damping=1e-3)
    full = factorize(a, factorization="symmetric", rank=None, damping=1e-3)
    assert low.layout == "lowrank" and full.layout == "dense"
    torch.testing.assert_close(low.matrix(), full.matrix(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(low.matrix(inverse=True), full.matrix(inverse=True), atol=1e-4, rtol=1e-4)


def test_paper_two_by_two_cholesky_example():
    a = torch.tensor([[4.0, 3.0], [3.0, 4.0]])
    chol = torch.linalg.cholesky(a)
    torch.testing.assert_close(chol, torch.tensor([[2.0, 0.0], [1.5, 1.3229]]), atol=1e-4, rtol=0)
    w = factorize(a, factorization="cholesky", rank=None, damping=1e-12)
    g = torch.tensor([[5.0, 1.0]])  # a row gradient: g^T L^-T = (L^-1 g)^T
    torch.testing.assert_close(w.whiten(g), torch.tensor([[2.5, -2.0788]]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_rank_deficient_moment_gives_finite_transforms(case):
    x = torch.randn(100, 12)
    x[:, 3:] = 0.0  # nine dead inputs
    moment, tokens = second_moment(x)
    w = factorize(moment / tokens, damping=1e-3, **case)
    assert all(bool(torch.isfinite(t).all()) for t in w.tensors.values())
    g = torch.randn(4, 12)
    assert bool(torch.isfinite(w.whiten(g)).all())
    assert all(bool(torch.isfinite(t).all()) for t in factorize(torch.zeros(12, 12), damping=1e-3, **case).tensors.values())


def test_subspace_iteration_finds_the_top_eigenpairs():
    d = 2100  # above EIGH_MAX_DIM
    g = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(d, 40, generator=g, dtype=torch.float64))
    spectrum = torch.logspace(2, 0, 40, dtype=torch.float64)  # decaying, like activation spectra
    a = (basis * spectrum) @ basis.T + torch.eye(d, dtype=torch.float64)
    values, vectors = top_eigenpairs(a, 8)
    torch.testing.assert_close(values, spectrum[:8] + 1, atol=1e-6, rtol=0)
    residual = a @ vectors - vectors * values
    assert residual.norm() < 1e-6 * values[0]  # eigen-residual relative to ||A||


def test_bad_shapes_and_ranks_raise():
    with pytest.raises(ValueError, match="rank=9 is invalid for a layer with d_in=8"):
        factorize(torch.eye(8), factorization="symmetric", rank=9, damping=1e-3)
    with pytest.raises(ValueError, match="square"):
        factorize(torch.ones(2, 3), factorization="symmetric", rank=None, damping=1e-3)
    w = factorize(torch.eye(4), factorization="symmetric", rank=None, damping=1e-3)
    with pytest.raises(ValueError, match="2-D"):
        w.whiten(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="5 factor tensors"):
        Whitening.from_list("lowrank", [torch.ones(2)])


def test_token_subsampling_keeps_a_token_weighted_count():
    x = torch.randn(4, 250, 8)
    moment, tokens = second_moment(x, max_tokens=100)
    assert tokens == 100  # stride ceil(1000 / 100) = 10
    rows = x.reshape(-1, 8)[::10]
    torch.testing.assert_close(moment, rows.T @ rows)


def explicit_low_rank_transform(a, basis, damping):
    """T and T^-1 of the Rayleigh-Ritz approximation of A on span(basis), written out densely."""
    d, r = basis.shape
    values, small = torch.linalg.eigh(basis.T @ a @ basis)
    vectors = basis @ small
    mean_eig = torch.trace(a) / d
    damped = values.clamp_min(0) + damping * mean_eig
    t = (vectors * damped.rsqrt()) @ vectors.T
    t_inv = (vectors * damped.sqrt()) @ vectors.T
    if r < d:
        sigma = (torch.trace(a) - values.clamp_min(0).sum()) / (d - r) + damping * mean_eig
        rest = torch.eye(d, dtype=a.dtype) - vectors @ vectors.T
        t, t_inv = t + rest * sigma.rsqrt(), t_inv + rest * sigma.sqrt()
    return t, t_inv


@pytest.mark.parametrize("rank", [6, 24])
def test_sketch_factors_equal_an_explicit_rayleigh_ritz(rank):
    d, n = 24, 300
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(4)) @ torch.linalg.cholesky(anisotropic_moment(d, seed=5)).T
    basis = torch.linalg.qr(torch.randn(d, rank, generator=torch.Generator().manual_seed(6), dtype=torch.float64)).Q.float()
    whitening, next_basis, _ = whitening_from_sketch(input_sketch(x, basis, ONE), basis, ONE, 0.3)
    a = (x.double().T @ x.double()) / n
    t, t_inv = explicit_low_rank_transform(a, basis.double(), 0.3)
    # fp32 sketch and factors of a matrix with condition number ~1e4: agreement to ~1e-5 of ||T||.
    torch.testing.assert_close(whitening.matrix().double(), t, atol=2e-5 * t.abs().max().item(), rtol=0)
    torch.testing.assert_close(whitening.matrix(inverse=True).double(), t_inv, atol=2e-5 * t_inv.abs().max().item(), rtol=0)
    # The next basis spans A Q (one subspace-iteration step): same orthogonal projector.
    q = torch.linalg.qr(a @ basis.double()).Q
    torch.testing.assert_close(next_basis.double() @ next_basis.double().T, q @ q.T, atol=1e-5, rtol=0)


def test_full_rank_sketch_factors_are_the_damped_inverse_square_root():
    d, n = 16, 200
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(7)) * torch.logspace(1, -1, d)
    basis = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(8))).Q
    whitening, _, _ = whitening_from_sketch(input_sketch(x, basis, ONE), basis, ONE, 0.1)
    a = x.double().T @ x.double() / n
    values, vectors = torch.linalg.eigh(a + 0.1 * torch.trace(a) / d * torch.eye(d, dtype=torch.float64))
    torch.testing.assert_close(whitening.matrix().double(), (vectors * values.rsqrt()) @ vectors.T, atol=1e-4, rtol=1e-4)


def test_sketches_of_ranks_add_up_to_the_sketch_of_all_tokens():
    # The all-reduce sums the ranks' sketches: that must equal the sketch of every token at once.
    basis = torch.linalg.qr(torch.randn(12, 4)).Q
    parts = [torch.randn(30, 12), torch.randn(50, 12)]
    torch.testing.assert_close(sum(input_sketch(p, basis, ONE) for p in parts), input_sketch(torch.cat(parts), basis, ONE), atol=1e-4, rtol=1e-5)


def test_non_finite_inputs_keep_the_previous_basis_and_send_unwhitened():
    # A NaN input: this step sends with T = I (its gradient is NaN on the Euclidean path too:
    # visible, never hidden), the basis is kept, and the next sketch scale shrinks.
    basis = torch.linalg.qr(torch.randn(12, 4)).Q
    x = torch.randn(20, 12)
    x[3, 5] = float("nan")
    whitening, next_basis, next_scale = whitening_from_sketch(input_sketch(x, basis, ONE), basis, ONE, 0.3)
    assert torch.equal(next_basis, basis)
    g = torch.randn(3, 12)
    assert torch.equal(whitening.whiten(g), g) and torch.equal(whitening.unwhiten(g), g)
    assert next_scale.item() == SKETCH_SCALE_SHRINK


@pytest.mark.parametrize("nystrom", [False, True])
def test_a_batch_of_layers_factorizes_each_as_alone(nystrom):
    # whitening_from_sketches runs a bucket's layers as one batch (one eigh, QR and matmul call
    # each over a stack): every layer's factors, next basis and scale must be bit-identical to
    # its own call, or a graph that batches and an eager route that does not would disagree.
    # A layer with a NaN input in the batch falls back alone (T = I, basis kept); its neighbours
    # are untouched. Layers of another shape run in a call of their own, in the caller's order.
    def layer(seed, d=12, rank=4, nan=False):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(40, d, generator=g) * torch.logspace(0, -2, d)
        if nan:
            x[1, 2] = float("nan")
        basis = torch.linalg.qr(torch.randn(d, rank, generator=g)).Q
        return input_sketch(x, basis, ONE), basis, ONE, 0.1 * (seed + 1)
    layers = [layer(0), layer(1, nan=True), layer(2, d=8, rank=3), layer(3)]
    batched = whitening_from_sketches(layers, nystrom=nystrom)
    for inputs, (whitening, next_basis, next_scale) in zip(layers, batched):
        alone, alone_basis, alone_scale = whitening_from_sketch(*inputs, nystrom=nystrom)
        assert whitening.tensors.keys() == alone.tensors.keys()
        assert all(torch.equal(whitening.tensors[k], alone.tensors[k]) for k in alone.tensors)
        assert torch.equal(next_basis, alone_basis) and torch.equal(next_scale, alone_scale)
    assert torch.equal(batched[1][0].whiten(torch.eye(12)), torch.eye(12)) and torch.equal(batched[1][1], layers[1][1])
    assert not torch.equal(batched[0][0].whiten(torch.eye(12)), torch.eye(12))  # its neighbour still whitens
    assert batched[2][0].dim == 8


def test_a_power_of_two_scale_changes_no_digit_of_the_factors():
    # The sketch's scale s multiplies every product by a power of two: s^2 times the same
    # fp32 digits, and the factors (computed from the unscaled values) are bit-identical.
    x = torch.randn(64, 12) * torch.logspace(0, -2, 12)
    basis = torch.linalg.qr(torch.randn(12, 4)).Q
    s = torch.tensor(2.0**-7)
    plain, scaled = input_sketch(x, basis, ONE), input_sketch(x, basis, s)
    assert torch.equal(scaled[:-1], plain[:-1] * s**2) and scaled[-1] == plain[-1] == 64
    for a, b in zip(whitening_from_sketch(plain, basis, ONE, 0.3)[0].tensors.values(),
                    whitening_from_sketch(scaled, basis, s, 0.3)[0].tensors.values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("magnitude", [1e18, 1e30])
def test_huge_inputs_give_finite_factors_after_the_scale_adapts(magnitude):
    # fp32's x^2 overflows from ~1.8e19 (and the token sum earlier): the first sketch overflows,
    # that step sends with T = I, and the scale shrinks until the sketch fits. Then the factors
    # are those of the unscaled inputs: T(c^2 A) = T(A) / c exactly in the algebra, so T times
    # the magnitude must equal T of the inputs divided by it (to fp32 rounding of the sums).
    x = torch.randn(256, 12, generator=torch.Generator().manual_seed(3)) * torch.logspace(0, -1, 12)
    basis = torch.linalg.qr(torch.randn(12, 4, generator=torch.Generator().manual_seed(4))).Q
    scale, steps = ONE, 0
    while True:
        whitening, next_basis, scale = whitening_from_sketch(input_sketch(x * magnitude, basis, scale), basis, scale, 0.3)
        steps += 1
        if not torch.equal(next_basis, basis):  # the sketch was finite: a real subspace step
            break
        assert torch.equal(whitening.whiten(torch.eye(12)), torch.eye(12))  # T = I while it overflowed
        assert steps < 6
    reference, *_ = whitening_from_sketch(input_sketch(x, basis, ONE), basis, ONE, 0.3)
    torch.testing.assert_close(whitening.matrix() * magnitude, reference.matrix(), rtol=1e-4, atol=1e-5 * reference.matrix().abs().max().item())
    # and the scale now brings one input element to ~1: s^2 * mean(x^2) in [1/4, 4]
    mean_square = (x.double() * magnitude).square().mean()
    assert 0.25 <= float(mean_square * scale.double() ** 2) <= 4


@pytest.mark.parametrize("case", CASES[:3], ids=["cholesky", "symmetric", "symmetric-r6"])
def test_or_identity_switches_between_the_transform_and_identity(case):
    w = factorize(anisotropic_moment(8), damping=1e-2, **case)
    g = torch.randn(3, 8)
    torch.testing.assert_close(w.or_identity(torch.tensor(1.0)).whiten(g), w.whiten(g))
    for fn in ("whiten", "unwhiten"):
        torch.testing.assert_close(getattr(w.or_identity(torch.tensor(0.0)), fn)(g), g, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("on", [1.0, 0.0], ids=["whitened", "on its fallback"])
@pytest.mark.parametrize("unit", [False, True], ids=["T", "unit-scaled"])
def test_squared_norm_is_the_norm_of_the_whitened_gradient(case, on, unit):
    """``squared_norm`` (the residual guard's measure) against ``|G T|^2`` and ``|G T^-1|^2`` from
    the dense ``T`` and its inverse in float64. The low-rank identity is exact for an orthonormal basis; the fp32 basis is
    orthonormal to ~1e-7, and the sum of 40 x 24 fp32 squares rounds to ~1e-6 relative."""
    w = factorize(anisotropic_moment(24), damping=1e-2, **case).or_identity(torch.tensor(on))
    w = w.unit_scaled() if unit else w
    for seed in range(3):
        g = torch.randn(40, 24, generator=torch.Generator().manual_seed(seed)) * 10.0**seed
        want = (g.double() @ w.matrix().double()).square().sum()
        assert float(w.squared_norm(g)) == pytest.approx(float(want), rel=1e-5)
        # |G T^-1|^2 (the residual's norm in G's coordinates, comm.reduce_received), from |G|^2 given
        want_inverse = (g.double() @ w.matrix(inverse=True).double()).square().sum()
        given = w.squared_norm(g, w.projection(g), inverse=True, g_squared=g.double().square().sum().float())
        assert float(given) == pytest.approx(float(want_inverse), rel=1e-5)


def lowrank_with_scale(d: int, r: int, scale: float, seed: int = 0) -> Whitening:
    """A low-rank ``T = s I + B diag(c) B^T`` with its exact inverse's coefficients, for any ``s``."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64))[0]
    coef = torch.rand(r, generator=g, dtype=torch.float64) * 3 - 0.9 * scale  # T's eigenvalues s + c in [0.1 s, 3 + 0.1 s]
    tensors = {"basis": basis, "coef": coef, "coef_inv": 1 / (scale + coef) - 1 / scale,
               "scale": torch.tensor(scale, dtype=torch.float64), "scale_inv": torch.tensor(1 / scale, dtype=torch.float64)}
    return Whitening("lowrank", {name: t.float() for name, t in tensors.items()})


@pytest.mark.parametrize("scale", [0.37, 2.9e3])
def test_unit_scaled_is_the_transform_over_its_scale(scale):
    # What the codec sends with (layer_step.prepare_reduction): T / s and its inverse s T^-1,
    # against the dense T and T^-1 in float64. Both products are exact up to fp32 rounding of
    # the factors (~1e-7 relative) and of a 16-term GEMM: 1e-5 of the largest entry.
    w = lowrank_with_scale(16, 4, scale)
    unit = w.unit_scaled()
    assert set(unit.tensors) == {"basis", "coef", "coef_inv"}
    # T and T^-1 written out from their factors in float64, not through Whitening's own products
    basis, coef, coef_inv = (w.tensors[name].double() for name in ("basis", "coef", "coef_inv"))
    eye = torch.eye(16, dtype=torch.float64)
    t = eye * float(w.tensors["scale"]) + basis @ torch.diag(coef) @ basis.T
    t_inv = eye * float(w.tensors["scale_inv"]) + basis @ torch.diag(coef_inv) @ basis.T
    want, want_inverse = t / scale, t_inv * scale
    torch.testing.assert_close(unit.matrix().double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(unit.matrix(inverse=True).double(), want_inverse, rtol=0, atol=1e-5 * want_inverse.abs().max().item())
    g = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(unit.unwhiten(unit.whiten(g)), g, atol=1e-5, rtol=1e-5)


def test_with_a_power_of_two_scale_the_wire_carries_the_same_codes():
    # Why the codec may drop the scale: with s = 2^k every fp32 operation of T / s is that of T
    # divided by s exactly (no rounding differs), so the whitened gradient is G T / s bit for bit,
    # an amax-scaled wire (FP8; FP4, whose block scales are chosen from the amax too) encodes it
    # to the same codes with scales / s, and unwhitening G T / s with s T^-1 gives back exactly
    # what unwhitening G T with T^-1 does.
    w = lowrank_with_scale(32, 4, 8.0)
    unit = w.unit_scaled()
    g = torch.randn(12, 32, generator=torch.Generator().manual_seed(2))
    whitened = w.whiten(g)
    assert torch.equal(unit.whiten(g), whitened / 8.0)
    for wire in (WireFormat(), WireFormat("fp4"), WireFormat("fp4", fp4_format="mxfp4")):
        sent = round_trip(whitened, wire)
        assert torch.equal(round_trip(whitened / 8.0, wire), sent / 8.0), wire
        assert torch.equal(unit.unwhiten(sent / 8.0), w.unwhiten(sent)), wire


def test_unit_scaled_leaves_transforms_without_an_isotropic_part_alone():
    # A dense T has no separate scale; current-step factors of full rank (r = d) have none
    # either (s = 0, which cannot be divided out).
    dense = factorize(anisotropic_moment(8), factorization="symmetric", rank=None, damping=1e-2)
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(3))
    basis = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(4))).Q
    full_rank, _, _ = whitening_from_sketch(input_sketch(x, basis, ONE), basis, ONE, 0.1)
    assert float(full_rank.tensors["scale"]) == 0.0
    assert dense.unit_scaled() is dense and full_rank.unit_scaled() is full_rank
