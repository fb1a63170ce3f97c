"""Whitening geometry: the K-FAC second moment ``A = E[x x^T]`` and transforms ``T ~ A^-1/2``.

A weight gradient ``G`` (``d_out x d_in``) is sent as ``U = G T`` and recovered as
``G = U T^-1``. Every transform here is a right-multiplication, so it acts on each row of
``G`` independently: rows can be sharded (FSDP's dim-0 reduce-scatter) before or after it.
Output-side transforms act on columns instead (``T_B^T G``) and are kept for ablations.

Factorizations (all of the damped ``A``):

* ``cholesky``  ``A = L L^T``, ``T = L^-T``, ``T^-1 = L^T`` (the paper's choice).
* ``symmetric`` ``T = A^-1/2``, ``T^-1 = A^1/2`` (ZCA whitening).
* low rank      top-``r`` eigenpairs ``(V, l)`` plus an isotropic rest ``sigma`` (mean of the
                other eigenvalues). Symmetric low rank is applied without any ``d x d`` matrix:
                ``G T = G / sqrt(sigma) + ((G V) * (l^-1/2 - sigma^-1/2)) V^T``.
* ``diag``      ``T = diag(A)^-1/2`` (the paper's ablation: no cross-dimension correlation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Above this dimension the top eigenpairs come from subspace iteration, not a full eigh.
EIGH_MAX_DIM = 2048


def second_moment(x: torch.Tensor, max_tokens: int | None = None) -> tuple[torch.Tensor, int]:
    """``(sum_t x_t x_t^T, tokens)`` in fp32 over the rows of ``x`` (``(..., d)``).

    With ``max_tokens``, an evenly strided subsample of at most that many tokens is used;
    the count returned is the number actually used, so sums from ranks or steps with
    different token counts combine into a token-weighted mean.
    """
    rows = x.reshape(-1, x.shape[-1])
    if max_tokens is not None and rows.shape[0] > max_tokens:
        rows = rows[:: math.ceil(rows.shape[0] / max_tokens)]
    rows = rows.float()
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
    "diag": ("scale", "scale_inv"),
}


@dataclass(frozen=True)
class Whitening:
    """A transform applied as ``G -> G T`` together with its exact inverse.

    ``kind`` says which tensors are meaningful:

    * ``dense``:   ``T`` (``d x d``) and ``T_inv``.
    * ``lowrank``: ``basis`` (``d x r``), ``coef``/``coef_inv`` (``r``), ``scale``/``scale_inv`` (0-d):
      ``G T = G * scale + ((G basis) * coef) basis^T``.
    * ``diag``:    ``scale``/``scale_inv`` (``d``).
    """

    kind: str
    tensors: dict[str, torch.Tensor]

    def whiten(self, g: torch.Tensor) -> torch.Tensor:
        return _apply(self.kind, self.tensors, g, inverse=False)

    def unwhiten(self, u: torch.Tensor) -> torch.Tensor:
        return _apply(self.kind, self.tensors, u, inverse=True)

    def matrix(self, inverse: bool = False) -> torch.Tensor:
        """The dense ``T`` (or ``T^-1``); for tests and small ``d`` only."""
        d = self.dim
        eye = torch.eye(d, dtype=torch.float32, device=next(iter(self.tensors.values())).device)
        return _apply(self.kind, self.tensors, eye, inverse=inverse)

    @property
    def dim(self) -> int:
        return self.tensors[FACTOR_NAMES[self.kind][0]].shape[0]


def _apply(kind: str, t: dict[str, torch.Tensor], g: torch.Tensor, *, inverse: bool) -> torch.Tensor:
    if g.dim() != 2:
        raise ValueError(f"whitening needs a 2-D (d_out, d_in) gradient, got shape {tuple(g.shape)}")
    suffix = "_inv" if inverse else ""
    if kind == "dense":
        return g @ t["T" + suffix]
    if kind == "lowrank":
        basis = t["basis"]
        return g * t["scale" + suffix] + ((g @ basis) * t["coef" + suffix]) @ basis.T
    if kind == "diag":
        return g * t["scale" + suffix]
    raise ValueError(f"unknown whitening kind {kind!r}")


def identity_whitening(kind: str, dim: int, rank: int | None = None) -> Whitening:
    """The transform ``T = I`` in the storage layout of ``kind`` (factors before the first refresh)."""
    if kind == "dense":
        eye = torch.eye(dim)
        return Whitening("dense", {"T": eye, "T_inv": eye.clone()})
    if kind == "lowrank":
        r = rank if rank is not None else dim
        return Whitening(
            "lowrank",
            {
                "basis": torch.zeros(dim, r),
                "coef": torch.zeros(r),
                "coef_inv": torch.zeros(r),
                "scale": torch.ones(()),
                "scale_inv": torch.ones(()),
            },
        )
    if kind == "diag":
        return Whitening("diag", {"scale": torch.ones(dim), "scale_inv": torch.ones(dim)})
    raise ValueError(f"unknown whitening kind {kind!r}")


def whitening_kind(factorization: str, rank: int | None, diagonal: bool = False) -> str:
    """Storage layout used for a configuration: symmetric low rank never forms ``d x d``."""
    if diagonal:
        return "diag"
    if factorization == "symmetric" and rank is not None:
        return "lowrank"
    return "dense"


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
    factorization: str = "symmetric",
    rank: int | None = None,
    damping: float = 1e-3,
    diagonal: bool = False,
    seed: int = 0,
) -> Whitening:
    """Build ``(T, T^-1)`` from a second moment ``a`` (``d x d``); fp64 inside, fp32 out."""
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"the second moment must be a square matrix, got shape {tuple(a.shape)}")
    d = a.shape[0]
    if rank is not None and not 1 <= rank <= d:
        raise ValueError(f"rank={rank} is invalid for a layer with d_in={d}; it must be in [1, {d}]")
    # fp64 makes small factorizations exact to fp32 output; large ones use subspace iteration,
    # which fp32 serves well at a quarter of the memory (16384^2 fp64 would be 2 GiB).
    a = damp(a.double() if d <= EIGH_MAX_DIM else a.float(), damping)
    a = (a + a.T) / 2
    kind = whitening_kind(factorization, rank, diagonal)
    if kind == "diag":
        diag = torch.diagonal(a)
        return _to_fp32("diag", {"scale": diag.rsqrt(), "scale_inv": diag.sqrt()})
    if rank is not None:
        values, basis = top_eigenpairs(a, rank, seed=seed)
        values = values.clamp_min(1e-300)
        rest = d - rank
        sigma = (torch.diagonal(a).sum() - values.sum()) / rest if rest else values.mean()
        sigma = sigma.clamp_min(values.min() * 1e-12 if rest else 1e-300)
        if kind == "lowrank":
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


def _to_fp32(kind: str, tensors: dict[str, torch.Tensor]) -> Whitening:
    return Whitening(kind, {name: t.float().contiguous() for name, t in tensors.items()})
