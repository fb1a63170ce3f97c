"""Whitening geometry: the K-FAC second moment ``A = E[x x^T]`` and transforms ``T ~ A^-1/2``.

A weight gradient ``G`` (``d_out x d_in``) is sent as ``U = G T`` and recovered as
``G = U T^-1``. Every transform here is a right-multiplication, so it acts on each row of
``G`` independently: rows can be sharded (FSDP's dim-0 reduce-scatter) before or after it.

Storage layouts (``Whitening.layout``):

* ``dense``    ``T`` and ``T^-1`` as ``d x d`` matrices: full symmetric ``A^-1/2`` or Cholesky
               ``L^-T`` (``T^-1 = L^T``, the paper's choice).
* ``lowrank``  top-``r`` eigenpairs ``(V, l)`` of ``A`` plus an isotropic rest ``sigma`` (mean of
               the other eigenvalues), applied without any ``d x d`` matrix:
               ``G T = G / sqrt(sigma) + ((G V) * (l^-1/2 - sigma^-1/2)) V^T``. With ``r = d``
               there is no rest (``scale = 0``) and this is the full ``A^-1/2``.

Where the factors come from:

* ``factorize(A)``: from a second moment (the ``periodic`` refresh, and benchmarks).
* ``input_sketch`` + ``whitening_from_sketch``: from *this step's* inputs (docs/design.md §6), by one step of a
  warm-started subspace iteration. Each rank sends ``X_r^T (X_r Q)`` (``d x r``) plus its
  ``sum x^2`` and token count in one all-reduce; every rank then runs Rayleigh-Ritz on the
  previous basis ``Q`` with the summed sketch (``Q^T A Q = Q^T W / n``) for this step's
  eigenpairs, and orthonormalizes ``W = A Q`` as the next step's ``Q``. All ranks see the same
  summed bytes and run the same ops, so they build bit-identical ``T``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

# Above this dimension the top eigenpairs of a periodic refresh come from subspace iteration,
# not a full eigh.
EIGH_MAX_DIM = 2048


def token_rows(x: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
    """The rows of ``x`` (``(..., d)``) as ``(tokens, d)``; with ``max_tokens``, an evenly
    strided subsample of at most that many (a static stride: no data-dependent shapes)."""
    rows = x.reshape(-1, x.shape[-1])
    if max_tokens is not None and rows.shape[0] > max_tokens:
        rows = rows[:: math.ceil(rows.shape[0] / max_tokens)]
    return rows


def second_moment(x: torch.Tensor, max_tokens: int | None = None) -> tuple[torch.Tensor, int]:
    """``(sum_t x_t x_t^T, tokens)`` in fp32 over the rows of ``x`` (``(..., d)``).

    The count returned is the number of tokens actually used, so sums from ranks or steps
    with different token counts combine into a token-weighted mean.
    """
    rows = token_rows(x, max_tokens).float()
    return rows.T @ rows, rows.shape[0]


def damp(a: torch.Tensor, damping: float) -> torch.Tensor:
    """``A + damping * mean_eigenvalue(A) * I``; an all-zero A still becomes positive definite."""
    mean_eig = (torch.diagonal(a).sum() / a.shape[0]).clamp_min(1e-12)
    return a + damping * mean_eig * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)


# Factor tensors of each storage layout, in the order they are stored and loaded; the
# first one's dim 0 is the transform's dimension.
FACTOR_NAMES = {
    "dense": ("T", "T_inv"),
    "lowrank": ("basis", "coef", "coef_inv", "scale", "scale_inv"),
}


def factor_shapes(layout: str, d: int, rank: int) -> list[tuple[int, ...]]:
    """Shapes of a ``Whitening``'s tensors, in ``FACTOR_NAMES`` order."""
    return {"dense": [(d, d), (d, d)], "lowrank": [(d, rank), (rank,), (rank,), (), ()]}[layout]


@dataclass(frozen=True)
class Whitening:
    """A transform applied as ``G -> G T`` together with its exact inverse.

    ``layout`` says which tensors are meaningful:

    * ``dense``:   ``T`` (``d x d``) and ``T_inv``.
    * ``lowrank``: ``basis`` (``d x r``, orthonormal), ``coef``/``coef_inv`` (``r``),
      ``scale``/``scale_inv`` (0-d): ``G T = G * scale + ((G basis) * coef) basis^T``. Without
      the scales (:meth:`unit_scaled`) the isotropic part is ``I``: ``G T = G + ((G basis) * coef) basis^T``.
    """

    layout: str
    tensors: dict[str, torch.Tensor]

    def whiten(self, g: torch.Tensor, projected: torch.Tensor | None = None) -> torch.Tensor:
        """``G T``; ``projected``: ``G B`` (:meth:`projection`) where the caller has it already."""
        return _apply(self.layout, self.tensors, g, inverse=False, projected=projected)

    def unwhiten(self, u: torch.Tensor, projected: torch.Tensor | None = None) -> torch.Tensor:
        """``U T^-1``; ``projected``: ``U B`` where the caller has it already."""
        return _apply(self.layout, self.tensors, u, inverse=True, projected=projected)

    def projection(self, g: torch.Tensor) -> torch.Tensor | None:
        """``G B`` in the low-rank layout (``T = s I + B diag(c) B^T``), the product a whitening and
        :meth:`squared_norm` start from; None for a dense ``T``."""
        return g @ self.tensors["basis"] if self.layout == "lowrank" else None

    def squared_norm(self, g: torch.Tensor, projected: torch.Tensor | None = None, *, inverse: bool = False,
                     g_squared: torch.Tensor | None = None) -> torch.Tensor:
        """``|G T|^2`` (Frobenius, 0-d; ``|G T^-1|^2`` with ``inverse``), without forming ``G T`` in
        the low-rank layout: there ``|G T|^2 = s^2 |G|^2 + sum_k (2 s c_k + c_k^2) |G b_k|^2``
        (``B`` orthonormal), from ``G B`` alone (``projected`` where the caller has it) instead of
        a whitening's two products, and ``|G|^2`` (``g_squared`` where the caller has it: then
        ``G`` is not read at all)."""
        if self.layout != "lowrank":
            return (self.unwhiten(g) if inverse else self.whiten(g)).square().sum()
        suffix = "_inv" if inverse else ""
        scale, coef = self.tensors.get("scale" + suffix, 1.0), self.tensors["coef" + suffix]
        projected = (self.projection(g) if projected is None else projected).square().sum(dim=0)
        g_squared = g.square().sum() if g_squared is None else g_squared
        return scale * scale * g_squared + ((2 * scale + coef) * coef * projected).sum()

    def matrix(self, inverse: bool = False) -> torch.Tensor:
        """The dense ``T`` (or ``T^-1``); for tests and small ``d`` only."""
        d = self.dim
        eye = torch.eye(d, dtype=torch.float32, device=next(iter(self.tensors.values())).device)
        return _apply(self.layout, self.tensors, eye, inverse=inverse)

    @property
    def dim(self) -> int:
        return self.tensors[FACTOR_NAMES[self.layout][0]].shape[0]

    @classmethod
    def from_list(cls, layout: str, tensors: list[torch.Tensor]) -> Whitening:
        names = FACTOR_NAMES[layout]
        if len(tensors) != len(names):
            raise ValueError(f"a {layout} whitening has {len(names)} factor tensors {names}, got {len(tensors)}")
        return cls(layout, dict(zip(names, tensors)))

    def unit_scaled(self) -> Whitening:
        """``T / s`` with its inverse ``s T^-1`` (``s``: ``scale``), for the wire: the low-rank
        transform with ``I`` as its isotropic part, so ``G T`` is ``G`` plus a rank-``r`` product,
        which Inductor computes as one GEMM that adds it to ``G`` (``addmm``), with no pass over
        memory for ``G * s`` (nor ``U * s^-1`` on the way back). A wire with amax scales sends
        ``G T / s`` as it sends ``G T`` (the same codes up to the scale's own rounding), and the
        receiver's ``s T^-1`` undoes both. A dense ``T``, or one with no isotropic part
        (``r = d``: ``s = 0``), is returned as it is."""
        t = self.tensors
        if self.layout != "lowrank" or "scale" not in t or t["basis"].shape[0] == t["basis"].shape[1]:
            return self
        # T = s I + B c B^T = s (I + B (c / s) B^T); T^-1 = s^-1 (I + B (s c_inv) B^T), as s^-1 = scale_inv.
        return Whitening("lowrank", {"basis": t["basis"], "coef": t["coef"] * t["scale_inv"], "coef_inv": t["coef_inv"] * t["scale"]})

    def or_identity(self, on: torch.Tensor) -> Whitening:
        """This transform where ``on == 1`` and ``T = I`` where ``on == 0`` (a 0-d float), with no
        branch on the value: a layer switched to its Euclidean fallback runs the same graph."""
        t = self.tensors
        if self.layout == "dense":
            eye = torch.eye(self.dim, dtype=t["T"].dtype, device=t["T"].device)
            return Whitening("dense", {"T": t["T"] * on + eye * (1 - on), "T_inv": t["T_inv"] * on + eye * (1 - on)})
        blended = {name: t[name] * on for name in ("coef", "coef_inv")}
        blended.update({name: t[name] * on + (1 - on) for name in ("scale", "scale_inv")})
        return Whitening("lowrank", {"basis": t["basis"], **blended})


def _apply(layout: str, t: dict[str, torch.Tensor], g: torch.Tensor, *, inverse: bool,
           projected: torch.Tensor | None = None) -> torch.Tensor:
    if g.dim() != 2:
        raise ValueError(f"whitening needs a 2-D (d_out, d_in) gradient, got shape {tuple(g.shape)}")
    suffix = "_inv" if inverse else ""
    if layout == "dense":
        return g @ t["T" + suffix]
    if layout == "lowrank":
        basis = t["basis"]
        projected = g @ basis if projected is None else projected
        isotropic = g * t["scale" + suffix] if "scale" in t else g  # unit_scaled: I
        return isotropic + (projected * t["coef" + suffix]) @ basis.T
    raise ValueError(f"unknown whitening layout {layout!r}")


def identity_whitening(layout: str, dim: int, rank: int) -> Whitening:
    """The transform ``T = I`` in ``layout`` (factors before the first refresh)."""
    if layout == "dense":
        eye = torch.eye(dim)
        return Whitening("dense", {"T": eye, "T_inv": eye.clone()})
    if layout == "lowrank":
        zeros = torch.zeros(rank)
        return Whitening(
            "lowrank",
            {"basis": initial_basis(dim, rank), "coef": zeros, "coef_inv": zeros.clone(), "scale": torch.ones(()), "scale_inv": torch.ones(())},
        )
    raise ValueError(f"unknown whitening layout {layout!r}")


def initial_basis(dim: int, rank: int, *, seed: int = 0) -> torch.Tensor:
    """An orthonormal ``dim x rank`` start for the subspace iteration: a seeded Gaussian,
    orthonormalized, so every rank (and a restarted run) starts from the same basis."""
    gaussian = torch.randn(dim, rank, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(gaussian).Q.float().contiguous()


# ----------------------------------------------------------------------------- current step


def sketch_numel(dim: int, rank: int) -> int:
    """Floats in one rank's ``input_sketch``: ``X^T X Q`` plus ``sum x^2`` and the token count."""
    return dim * rank + 2


# The two functions below run as opaque custom ops (eagerly, also inside a compiled graph):
# they are small (an r x r eigh, a d x r QR, two skinny matmuls) and hold reductions whose
# order Inductor would change, so the compiled graph and the eager reference stay bit-identical.


# The sketch is sent in fp32, and ``sum_t x_t x_t^T`` overflows fp32 for inputs of about 1e17
# and up (where the gradient ``dY^T X`` is still far inside fp32's range). So every rank scales
# its rows by the same power of two ``s`` first: a power of two scales each product exactly, so
# ``s^2 X^T X Q`` has the same digits as ``X^T X Q``, and the factors are computed from the
# unscaled values (``/ s^2`` in float64, exact). ``s`` is state, derived from the previous step's
# summed trace (so every rank holds the same one), aiming at elements of magnitude ~1.
SKETCH_SCALE_SHRINK = 2.0**-32
"""A sketch that still overflowed (the first steps of huge inputs): the next step's ``s`` is this
much smaller (4 steps from 1 to fp32's largest inputs), and this step sends with ``T = I``."""
_SCALE_EXPONENT = (-120, 120)  # s stays a normal fp32 power of two, s^2 a normal float64
NYSTROM_RTOL = 1e-10
"""``whitening_from_sketch(nystrom=True)``: eigenvalues of ``C = Q^T W`` at or below this fraction of
its largest are dropped from its pseudo-inverse (rounding noise in float64, not spectrum)."""


@torch.library.custom_op("gift::input_sketch", mutates_args=())
def input_sketch(x: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
    """This rank's share of the current-step statistics, packed for one sum all-reduce:
    ``s^2 [X^T (X Q) (d*r), sum x^2, 0] + [0, 0, tokens]`` in fp32, with ``s = scale`` (see above).
    Costs ``4 tokens d r`` flops, no ``d x d``. With ``stats_source = "gradients"`` the rows are
    the weight gradient's (``G^T G Q``, ``d_out`` rows), the same op under the same name."""
    rows = token_rows(x, max_tokens).float() * scale  # s X: every product of two is s^2 x x', exactly
    projected = rows.T @ (rows @ basis)
    # In fp32, like the projection it is compared with (the rest of the spectrum is the trace
    # minus the Ritz values), and on the scaled rows, so it overflows only where they do.
    trace = torch.linalg.vector_norm(rows).square()
    return torch.cat([projected.reshape(-1), trace.reshape(1), trace.new_full((1,), rows.shape[0])])


@input_sketch.register_fake
def _(x, basis, scale, max_tokens=None):
    return basis.new_empty(sketch_numel(*basis.shape))


@functools.lru_cache(maxsize=32)
def _identity_factors(rank: int, device: torch.device) -> torch.Tensor:
    """The packed factors of ``T = I`` (``whitening_from_sketch``): coefficients 0, scales 1."""
    return torch.cat([torch.zeros(2 * rank, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]).to(device)


@torch.library.custom_op("gift::whitening_from_sketches", mutates_args=())
def _whitening_from_sketches(
    sketches: list[torch.Tensor], bases: list[torch.Tensor], scales: list[torch.Tensor], dampings: list[torch.Tensor],
    nystrom: bool = False,
) -> list[torch.Tensor]:
    """For each layer ``i`` (bases of one shape): ``ritz basis, [coef, coef_inv, scale, scale_inv]
    packed, next basis, next sketch scale``, flat, layer after layer. The layers run as one batch,
    which pays each of the ~40 ops' fixed cost once (the main job's two layers of a bucket: 1.7x
    one layer's time, ``benchmarks/results/codec_profile_stop59.md``), and a batched eigh, QR or
    matmul computes each matrix as it would alone (``test_geometry.py`` checks bit for bit)."""
    k, (d, r) = len(bases), bases[0].shape
    sketch = torch.stack(sketches)
    # No host sync on a bad value: a sketch that is not finite (an input with NaN/Inf, or one so
    # large the sketch overflowed before ``scale`` adapted) gives T = I for this step, keeps the
    # basis, and shrinks the scale. The gradient then travels as Euclidean FP8: a NaN input's
    # gradient is NaN there too (visible, never hidden), a huge one's is sent finite.
    # Any NaN/Inf reaches the sum; finite fp32 values cannot overflow it.
    finite = sketch.sum(dim=1, dtype=torch.float64).isfinite()
    sketch = sketch.nan_to_num(0.0, 0.0, 0.0).double()
    scale64, basis64 = torch.stack(scales).double(), torch.stack(bases).double()
    kept_basis = basis64
    per_token = scale64.square().reciprocal() / sketch[:, -1].clamp_min(1.0)  # 1 / (s^2 n): s is a power of two
    w = sketch[:, : d * r].view(k, d, r)  # s^2 W: the same digits as W
    rayleigh = (basis64.mT @ w) * per_token[:, None, None]
    values, vectors = torch.linalg.eigh((rayleigh + rayleigh.mT) / 2)
    range_w, triangle = torch.linalg.qr(w)
    if nystrom:  # M ~ W C^+ W^T, C = Q^T M Q, whose range is W's: one more power step than Rayleigh-Ritz
        pinv = torch.where(values > NYSTROM_RTOL * values[:, -1:], values, math.inf).reciprocal()
        core = (triangle * per_token[:, None, None]) @ vectors  # R C^+ R^T = core diag(pinv) core^T, for W = range_w R
        values, vectors = torch.linalg.eigh((core * pinv[:, None, :]) @ core.mT)
        basis64 = range_w
    values = values.flip(-1).clamp_min(0.0)
    ritz = basis64 @ vectors.flip(-1)
    trace = sketch[:, -2] * per_token
    shift = torch.stack(dampings).double() * (trace / d).clamp_min(1e-30)
    damped = values + shift[:, None]
    if r < d:
        rest = ((trace - values.sum(dim=-1)) / (d - r)).clamp_min(0.0) + shift
        iso = torch.stack([rest.rsqrt(), rest.sqrt()], dim=-1)  # T's and T^-1's scale on the rest of the spectrum
    else:  # full rank: no isotropic rest
        iso = sketch.new_zeros(k, 2)
    factors = torch.cat([damped.rsqrt() - iso[:, :1], damped.sqrt() - iso[:, 1:], iso], dim=-1)
    factors = torch.where(finite[:, None], factors, _identity_factors(r, sketch.device))
    next_basis = torch.where(finite[:, None, None], range_w, kept_basis)
    mean_square = trace / d  # of one input element, unscaled: the next scale brings it to ~1
    exponent = (-0.5 * torch.log2(mean_square)).round().clamp(*_SCALE_EXPONENT)
    rescaled = torch.where(mean_square > 0, torch.exp2(exponent), scale64)
    next_scale = torch.where(finite, rescaled, (scale64 * SKETCH_SCALE_SHRINK).clamp_min(2.0**_SCALE_EXPONENT[0]))
    per_layer = zip(*(t.unbind() for t in (ritz, factors, next_basis, next_scale)))
    return [t.to(torch.float32, memory_format=torch.contiguous_format) for layer in per_layer for t in layer]


@_whitening_from_sketches.register_fake
def _(sketches, bases, scales, dampings, nystrom=False):
    d, r = bases[0].shape
    return [bases[0].new_empty(shape) for _ in bases for shape in ((d, r), (2 * r + 2,), (d, r), ())]


FactorInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | float"]
"""One layer's ``(summed sketch, basis, sketch scale, damping)`` for :func:`whitening_from_sketches`."""


def whitening_from_sketches(
    layers: list[FactorInputs], *, nystrom: bool = False
) -> list[tuple[Whitening, torch.Tensor, torch.Tensor]]:
    """:func:`whitening_from_sketch` of each layer, in order: one op call per basis shape, so a
    bucket's layers factorize as one batch (the same numbers as one by one)."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, (_, basis, _, _) in enumerate(layers):
        by_shape.setdefault(tuple(basis.shape), []).append(i)
    results: list = [None] * len(layers)
    for indices in by_shape.values():
        sketches, bases, scales, dampings = zip(*(layers[i] for i in indices))
        dampings = [torch.as_tensor(damping, dtype=torch.float32, device=sketches[0].device) for damping in dampings]
        flat = torch.ops.gift.whitening_from_sketches(list(sketches), list(bases), list(scales), dampings, nystrom)
        for j, i in enumerate(indices):
            ritz, factors, next_basis, next_scale = flat[4 * j: 4 * j + 4]
            r = ritz.shape[1]
            coef, coef_inv, iso = factors.split([r, r, 2])
            results[i] = Whitening.from_list("lowrank", [ritz, coef, coef_inv, iso[0], iso[1]]), next_basis, next_scale
    return results


def whitening_from_sketch(
    sketch: torch.Tensor, basis: torch.Tensor, scale: torch.Tensor, damping: torch.Tensor | float, *, nystrom: bool = False
) -> tuple[Whitening, torch.Tensor, torch.Tensor]:
    """``(T, next basis, next sketch scale)`` from the all-reduced ``input_sketch`` of every rank.

    With ``W = A Q`` (``A`` the token mean of ``x x^T`` over all ranks), Rayleigh-Ritz on the
    orthonormal ``Q`` gives eigenpairs of ``Q^T A Q = Q^T W``; the rest of the spectrum is
    ``sigma = (tr A - sum l) / (d - r)``. Both are damped by ``damping * tr(A) / d``. The next
    basis is ``qr(W)``: one more subspace-iteration step, with this step's inputs. A sketch that
    is not finite gives ``T = I`` and keeps the basis (see the op above). ``damping`` is a 0-d
    tensor (a layer's own, which ``adaptive_damping`` moves) or a number.

    ``nystrom``: the eigenpairs are those of the Nystrom approximation ``W C^+ W^T`` (``C = Q^T
    W``, its eigenvalues below ``NYSTROM_RTOL`` of the largest dropped) instead: from the same
    sketch, in the range of ``W``, so as good as Rayleigh-Ritz on this step's ``qr(W)``. That
    matters for a matrix whose top subspace moves from step to step (``stats_source =
    "gradients"``); for ``A``, which moves slowly, the previous basis is as good.
    """
    return whitening_from_sketches([(sketch, basis, scale, damping)], nystrom=nystrom)[0]


# ----------------------------------------------------------------------------- periodic


def top_eigenpairs(a: torch.Tensor, rank: int, *, seed: int = 0, iterations: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest ``rank`` eigenvalues (descending) and eigenvectors of symmetric PSD ``a``.

    Small matrices use ``eigh``. Large ones use subspace iteration from a seeded Gaussian
    start (``O(d^2 r)`` per iteration instead of ``O(d^3)``), then Rayleigh-Ritz.
    """
    d = a.shape[0]
    width = 2 * rank + 8  # oversampling speeds convergence to ratio lambda_width / lambda_rank per iteration
    if d <= EIGH_MAX_DIM or width >= d:
        values, vectors = torch.linalg.eigh(a)
        return values.flip(0)[:rank], vectors.flip(1)[:, :rank]
    generator = torch.Generator(device=a.device).manual_seed(seed)
    q = torch.randn(d, width, generator=generator, dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        q, _ = torch.linalg.qr(a @ q)
    values, small = torch.linalg.eigh(q.T @ a @ q)
    return values.flip(0)[:rank], (q @ small).flip(1)[:, :rank]


def factorize(
    a: torch.Tensor,
    *,
    factorization: str,
    rank: int | None,
    damping: float,
    seed: int = 0,
) -> Whitening:
    """Build ``(T, T^-1)`` from a second moment ``a`` (``d x d``); fp64 inside, fp32 out.

    The knobs have no defaults here: they are ``GiftConfig``'s (``factorization``, ``low_rank``,
    ``damping``), and one set of defaults lives there."""
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"the second moment must be a square matrix, got shape {tuple(a.shape)}")
    d = a.shape[0]
    if rank is not None and not 1 <= rank <= d:
        raise ValueError(f"rank={rank} is invalid for a layer with d_in={d}; it must be in [1, {d}]")
    # fp64 makes small factorizations exact to fp32 output; large ones use subspace iteration,
    # which fp32 serves well at a quarter of the memory (16384^2 fp64 would be 2 GiB).
    a = damp(a.double() if d <= EIGH_MAX_DIM else a.float(), damping)
    a = (a + a.T) / 2
    if rank is not None:
        values, basis = top_eigenpairs(a, rank, seed=seed)
        values = values.clamp_min(1e-300)
        rest = d - rank
        sigma = (torch.diagonal(a).sum() - values.sum()) / rest if rest else values.mean()
        sigma = sigma.clamp_min(values.min() * 1e-12 if rest else 1e-300)
        if factorization == "symmetric":
            return _to_fp32(
                "lowrank",
                {
                    "basis": basis,
                    "coef": values.rsqrt() - sigma.rsqrt(),
                    "coef_inv": values.sqrt() - sigma.sqrt(),
                    "scale": sigma.rsqrt(),
                    "scale_inv": sigma.sqrt(),
                },
            )
        # Cholesky of the low-rank-plus-isotropic approximation of A (a dense d x d factor).
        a = sigma * torch.eye(d, dtype=a.dtype, device=a.device) + (basis * (values - sigma)) @ basis.T
    if factorization == "cholesky":
        chol = torch.linalg.cholesky(a)
        eye = torch.eye(d, dtype=a.dtype, device=a.device)
        inv_chol = torch.linalg.solve_triangular(chol, eye, upper=False)
        return _to_fp32("dense", {"T": inv_chol.T, "T_inv": chol.T})
    values, vectors = torch.linalg.eigh(a)
    values = values.clamp_min(values.max() * 1e-12)
    return _to_fp32(
        "dense",
        {"T": (vectors * values.rsqrt()) @ vectors.T, "T_inv": (vectors * values.sqrt()) @ vectors.T},
    )


def _to_fp32(layout: str, tensors: dict[str, torch.Tensor]) -> Whitening:
    return Whitening(layout, {name: t.float().contiguous() for name, t in tensors.items()})
