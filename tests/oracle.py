"""An independent float64 statement of GIFT's Algorithm 1, for tests.

Written from the paper (arXiv 2607.07494, Algorithm 1) and docs/design.md, not from the
library: nothing here imports ``gift_compile``. Where the library has a choice of
formulation, the oracle takes the other one, so agreement checks the derivation:

* the error-feedback residual lives in *whitened* coordinates, as in the paper, and is moved
  explicitly whenever ``T`` changes: ``R <- R T_old^-1 T_new`` (the library keeps it in the
  gradient's coordinates);
* ``T`` is a dense ``d x d`` matrix built from an explicitly formed ``A`` (the library never
  forms ``A`` for current-step factors and applies ``T`` in low-rank form); with gradient
  statistics ``A = sum_k G_k^T G_k / rows`` and its Nystrom approximation is formed densely
  with a pseudo-inverse and decomposed whole (the library works on ``r x r`` matrices only);
* FP8 e4m3 and FP4 E2M1 rounding are written out from the formats' definitions (the library
  casts FP8, and rounds FP4 arithmetically on a different formula).

One rule beyond Algorithm 1, from docs/design.md §8 (the residual guard): a whitened layer's
residual is not sent in a step where it is larger (Frobenius norm, whitened coordinates) than
what it would be added to (this step's whitened gradient; on the all-reduce route's second
stage, the reduced shard); that step's new residual is its own rounding error alone.

Every rank's data is visible here (``grads[r]``, ``inputs[r]``), so the reduction is a plain
sum over a Python list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6  # smallest normal: 2^-6; subnormal spacing 2^-9
E4M3_MANTISSA_BITS = 3


def e4m3(values: torch.Tensor) -> torch.Tensor:
    """Round float64 ``values`` to the nearest e4m3 number (ties to even), saturating at +-448."""
    magnitude = values.abs().clamp_max(E4M3_MAX)
    exponent = torch.floor(torch.log2(magnitude.clamp_min(2.0**E4M3_MIN_NORMAL_EXP))).clamp_min(E4M3_MIN_NORMAL_EXP)
    spacing = torch.pow(2.0, exponent - E4M3_MANTISSA_BITS)
    rounded = torch.round(magnitude / spacing) * spacing  # torch.round: half to even
    return torch.sign(values) * rounded.clamp_max(E4M3_MAX)


def quantize(v: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled e4m3 round trip: the scale maps the largest magnitude to 448 (fp32 scale)."""
    scale = float(torch.tensor(float(v.abs().max()), dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32))
    scale = max(scale, 1e-30 / E4M3_MAX)
    return e4m3(v / scale) * scale


# E2M1 (OCP MX FP4) from its definition: sign, 2 exponent bits (bias 1), 1 mantissa bit.
E2M1_GRID = tuple((m / 2) if e == 0 else (1 + m / 2) * 2.0 ** (e - 1) for e in range(4) for m in range(2))
E2M1_MAX = E2M1_GRID[-1]


def e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round float64 ``values`` to the nearest E2M1 number, ties to the even mantissa, saturating at 6."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    magnitude = values.abs().clamp_max(E2M1_MAX)
    distance = (magnitude[..., None] - grid).abs()
    nearest = distance.min(dim=-1, keepdim=True).values
    # among the nearest (two on a tie), the one whose mantissa bit (grid index parity) is 0
    tied_odd = (distance == nearest) & (torch.arange(len(E2M1_GRID)) % 2 == 1)
    chosen = torch.where(distance == nearest, 0, 1) * 2 + tied_odd.long()
    return torch.sign(values) * grid[chosen.argmin(dim=-1)]


def fp4_round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """One sender's FP4 round trip of a tensor, blocks of consecutive elements in row-major order
    (zero-padded at the end; along ``d_in`` when it is a multiple of the block).

    ``nvfp4``: blocks of 16, an e4m3 block scale times an fp32 tensor scale ``amax / (6 * 448)``;
    ``mxfp4``: blocks of 32, a power-of-two scale ``2^(floor(log2 block_amax) - 2)``. The
    scales are computed in fp32, as the formats define them; the values in float64."""
    block = {"nvfp4": 16, "mxfp4": 32}[fmt]
    flat = x.double().reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).reshape(-1, block)
    block_amax = padded.abs().amax(dim=-1).float()
    if fmt == "nvfp4":
        tensor_scale = max(padded.abs().max().float(), torch.tensor(1e-30)) / torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32)
        block_scale = e4m3((block_amax / (E2M1_MAX * tensor_scale)).double()).float()
        scales = (block_scale * tensor_scale).double()
    else:
        exponent = torch.floor(torch.log2(block_amax.double().clamp_min(2.0**-126))) - 2
        scales = torch.pow(2.0, exponent.clamp(-126, 127))
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    decoded = e2m1(padded / safe[..., None]) * scales[..., None]
    return decoded.reshape(-1)[: flat.numel()].reshape(x.shape)


def rows_of(rank: int, world: int, d_out: int) -> slice:
    """The rows rank ``rank`` owns after a dim-0 reduce-scatter (``ceil(d_out / world)`` each)."""
    c = -(-d_out // world)
    return slice(min(rank * c, d_out), min((rank + 1) * c, d_out))


def symmetric_transform(values: torch.Tensor, vectors: torch.Tensor, rest: float | None, mean_eig: float, damping: float):
    """Dense ``T = A_r^-1/2`` and ``T^-1`` for ``A_r = V diag(l) V^T + rest (I - V V^T)``, damped,
    as the wire uses them: with a rest, ``T`` times ``sqrt(sigma)`` (its inverse divided by it),
    so that ``T`` is ``I`` off the top subspace (docs/design.md §1: a scalar changes no FP8
    code, and the library then whitens with no pass over memory for it)."""
    d = vectors.shape[0]
    shift = damping * mean_eig
    damped = values.clamp_min(0) + shift
    projector = vectors @ vectors.T
    t = (vectors * damped.rsqrt()) @ vectors.T
    t_inv = (vectors * damped.sqrt()) @ vectors.T
    if rest is not None:
        sigma = max(rest, 0.0) + shift
        t = (t + (torch.eye(d, dtype=torch.float64) - projector) / math.sqrt(sigma)) * math.sqrt(sigma)
        t_inv = (t_inv + (torch.eye(d, dtype=torch.float64) - projector) * math.sqrt(sigma)) / math.sqrt(sigma)
    return t, t_inv


@dataclass
class OracleLayer:
    """One layer's Algorithm 1 over steps, for ``world`` ranks at once."""

    d_out: int
    d_in: int
    world: int
    rank: int
    damping: float
    error_feedback: bool = True
    factor_source: str = "current_step"  # or "periodic"
    statistics: str = "inputs"  # or "gradients": T from sum_k G_k^T G_k (current step), by Nystrom
    refresh_interval: int = 10
    ema_decay: float = 0.5
    collective: str = "reduce_scatter"  # or "all_reduce" (an all-gather on the wire with owner error feedback)
    wire: str = "e4m3"  # or "nvfp4" / "mxfp4"
    whiten: bool = True  # False: T stays I, the Euclidean route with the same error feedback
    step: int = 0
    basis: torch.Tensor | None = None
    moment: torch.Tensor | None = None
    t: torch.Tensor | None = None
    t_inv: torch.Tensor | None = None
    residuals: list = field(default_factory=list)
    gather_residuals: list = field(default_factory=list)

    def __post_init__(self) -> None:
        gaussian = torch.randn(self.d_in, self.rank, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        self.basis = torch.linalg.qr(gaussian).Q
        self.t = self.t_inv = torch.eye(self.d_in, dtype=torch.float64)
        self.residuals = [torch.zeros(self.d_out, self.d_in, dtype=torch.float64) for _ in range(self.world)]
        self.gather_residuals = [torch.zeros(self.d_out, self.d_in, dtype=torch.float64)[rows_of(k, self.world, self.d_out)]
                                 for k in range(self.world)]

    def quantize(self, v: torch.Tensor) -> torch.Tensor:
        """One sender's round trip on the wire: per-tensor e4m3, or FP4 with its block scales."""
        return quantize(v) if self.wire == "e4m3" else fp4_round_trip(v, self.wire)

    def _new_transform(self, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        rows = [x.double().reshape(-1, self.d_in) for x in (grads if self.statistics == "gradients" else inputs)]
        a = sum(x.T @ x for x in rows) / sum(x.shape[0] for x in rows)
        if self.statistics == "gradients":
            # The Nystrom approximation A Q (Q^T A Q)^+ Q^T A, formed densely, its top eigenpairs
            # by a full eigh (its rank is at most ``rank``); then one power step for the next Q.
            sketch = a @ self.basis
            nystrom = sketch @ torch.linalg.pinv(self.basis.T @ sketch, rtol=1e-10, hermitian=True) @ sketch.T
            all_values, all_vectors = torch.linalg.eigh((nystrom + nystrom.T) / 2)
            values, vectors = all_values[-self.rank:], all_vectors[:, -self.rank:]
            self.basis = torch.linalg.qr(sketch).Q
        elif self.factor_source == "current_step":
            # Rayleigh-Ritz on the previous basis with this step's A, then one power step.
            values, small = torch.linalg.eigh(self.basis.T @ a @ self.basis)
            vectors = self.basis @ small
            self.basis = torch.linalg.qr(a @ self.basis).Q
        else:
            if self.step % self.refresh_interval != 0:
                return
            decay = self.ema_decay if self.moment is not None else 0.0
            self.moment = a if self.moment is None else decay * self.moment + (1 - decay) * a
            a = self.moment
            all_values, all_vectors = torch.linalg.eigh(a)
            values, vectors = all_values[-self.rank:], all_vectors[:, -self.rank:]
        trace = float(torch.trace(a))
        rest = (trace - float(values.clamp_min(0).sum())) / (self.d_in - self.rank) if self.rank < self.d_in else None
        t, t_inv = symmetric_transform(values, vectors, rest, trace / self.d_in, self.damping)
        # The paper's residual lives in whitened coordinates: carry it into the new ones.
        self.residuals = [r @ self.t_inv @ t for r in self.residuals]
        self.gather_residuals = [r @ self.t_inv @ t for r in self.gather_residuals]
        self.t, self.t_inv = t, t_inv

    def carried(self, residual: torch.Tensor, onto: torch.Tensor) -> torch.Tensor:
        """The residual guard (module docstring): the residual, or nothing where it outweighs ``onto``."""
        if self.whiten and float(torch.linalg.norm(residual)) > float(torch.linalg.norm(onto)):
            return torch.zeros_like(residual)
        return residual

    def reduce(self, grads: list[torch.Tensor], inputs: list[torch.Tensor], op: str = "avg") -> torch.Tensor:
        """The reduced gradient (all ``d_out`` rows) of one step."""
        if self.whiten:
            self._new_transform(inputs, grads)
        decoded = []
        for r, g in enumerate(grads):
            sent = g.double() @ self.t + (self.carried(self.residuals[r], g.double() @ self.t) if self.error_feedback else 0)
            decoded_r = self.quantize(sent)
            if self.error_feedback:
                self.residuals[r] = sent - decoded_r
            decoded.append(decoded_r)
        reduced = sum(decoded) / (self.world if op == "avg" else 1)
        if self.collective == "all_reduce":
            shards = []
            for k in range(self.world):
                rows = rows_of(k, self.world, self.d_out)
                shard = reduced[rows] + (self.carried(self.gather_residuals[k], reduced[rows]) if self.error_feedback else 0)
                decoded_shard = self.quantize(shard) if shard.numel() else shard
                if self.error_feedback:
                    self.gather_residuals[k] = shard - decoded_shard
                shards.append(decoded_shard)
            reduced = torch.cat(shards)
        self.step += 1
        return reduced @ self.t_inv
