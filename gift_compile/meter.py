"""The live meter: the error of what a whitened layer *delivers* on its route, against what the
same route's Euclidean wire (FP8, or FP4 for an FP4 layer: the layer's fallback) would deliver
with the same error-feedback setting, both measured against the exact average of the ranks'
gradients.

What a route delivers is ``D`` (the reduced gradient the optimizer gets, after the
all-reduce's second stage and with error feedback as configured). Its error is
``E = D - c * sum_r G_r`` (``c = 1/world`` for an average). No rank holds ``sum_r G_r``, and
sending it exactly would cost fp32 bytes, so the meter measures a *sketch* of it: a Gaussian
``S`` (``SKETCH_ROWS x d_out``, the same on every rank) maps each rank's share,
``S[:, own rows] D[own rows] - c * S G_r``, to ``SKETCH_ROWS x d_in`` numbers, and one
all-reduce sums the shares to ``S E`` exactly. ``|S E|^2`` estimates ``|E|^2`` without bias;
its relative spread is ``sqrt(2 / (SKETCH_ROWS * r))`` for an error of effective rank ``r``
(quantization errors are close to full rank: a few percent at 32 rows).

The ``d_in`` side is compressed too before it is sent, where the layer is wide enough to gain:
with ``Q`` the layer's input basis (``T``'s ``basis``, ``d_in x r``, orthonormal, the same on every
rank) and ``P = I - Q Q^T``, a share ``M`` is sent as ``[M Q, M P Omega]``, ``Omega`` a Gaussian
``d_in x SKETCH_COLUMNS`` with ``E[Omega Omega^T] = I`` (the same on every rank). Its squared norm
is ``|M Q|^2`` exactly plus an unbiased estimate of ``|M P|^2``: GIFT's error, mapped back by
``T^-1``, concentrates in ``Q``'s few directions, where a random ``Omega`` alone adds a spread of
about ``sqrt(2 / (SKETCH_COLUMNS * r))`` (it read 0.19 below the truth on the [CLS] case of
``tests/test_state_reference.py``, whose error lies in 8 of 48 directions); outside ``Q`` GIFT's
error is close to isotropic. Where the layer is too narrow for this to halve a share, or ``T``
has no basis (dense), shares are sent whole. A reading is then
``4 x 32 x (r + 32)`` fp32 per layer instead of ``4 x 32 x d_in``: on the debug job (12 layers
of ``d_in`` 256, ``r = 32``) 0.4 MiB instead of 1.5 MiB, which at 50 Mbit/s took 0.3 s of the reading's step.

The Euclidean shadow is run beside the real step, with no communication: this rank's
``G_r + R_r`` (its own shadow residual) through the route's encoding (``collectives.round_trip``)
gives its share of the first stage exactly; on the all-reduce route the owner of each shard
re-encodes, with its shadow gather residual, what the real second stage encoded: its rows of
the first stage's sum plus its gather residual, in G's coordinates, which is ``D``'s rows plus
the second stage's rounding error (``comm.Reduction.gather_residual``: the residual ``R2'`` the
owner keeps with error feedback; reported without it too). That is the closest thing to the
Euclidean route's own first-stage sum that exists without sending it (it differs by the
previous residual, a rounding's size, which leaves the rounding statistics alike).
Re-encoding ``D`` itself would under-count the second stage: ``D`` already lies on the wire's
grid and re-encodes almost exactly. On the fallback (``T = I``) the meter read ~1.4 where the
truth was 1.0 (``tests/test_state_reference.py``), and without error feedback, where ``D`` once
stood in, it over-read by up to ``sqrt(1 + 1/world)`` wherever ``D`` lies near the grid (there,
or where ``T`` only rescales the gradient). Both sides are sketched with
the same ``S``, summed in the same all-reduce.

On the layer's fallback (``T = I``: what it delivers is the Euclidean route's) the roles swap:
the shadow is GIFT's route, the same round trips in whitened coordinates with the ``T`` the
layer would use (handed to the meter at every step), so a reading still says how GIFT compares with Euclidean,
and a retry can be skipped while GIFT would still lose (``state.py``). That shadow runs eagerly.

A reading covers a *window*: ``meter_window`` steps ending at each ``meter_interval``-th step
(with error feedback; one step without it). Its first step only starts the shadow's residuals,
so the shadow's error feedback has history when counting starts, as GIFT's has. The window
reports the last step's error (``error_vs_fp8``) and, with error feedback, the error
accumulated over the counted steps (``accumulated_vs_fp8``: with error feedback the errors of
consecutive steps cancel, and the sum is what the optimizer integrates).
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gift_compile import policy
from gift_compile.collectives import WireFormat, resolve_group, round_trip, shard_round_trip
from gift_compile.comm import finite_or_zero, guarded_sum
from gift_compile.config import GiftConfig
from gift_compile.geometry import Whitening
from gift_compile.static_compile import static_compile

SKETCH_ROWS = 32
SKETCH_COLUMNS = 32


class Reading(NamedTuple):
    one_step: float
    """|E_gift| / |E_euclidean| of the window's last step."""
    accumulated: float | None
    """The same for the errors summed over the window's counted steps (error feedback only)."""

    @property
    def verdict(self) -> float:
        """What the fallback compares with 1: the worse of the two."""
        return max(self.one_step, self.accumulated or 0.0)


@dataclass
class PendingReading:
    """A reading whose sums are still being added up over the ranks (an all-reduce in flight):
    nothing that step does depends on it, so the backward does not wait for it; the runtime
    takes its :meth:`result` where the reading is first needed (``runtime.py``)."""

    step: int
    """The layer's step the reading was taken at (its fallback starts after it)."""
    sums: torch.Tensor
    work: dist.Work | None
    accumulated: bool
    """Whether the window's accumulated error is read (error feedback)."""

    def result(self) -> Reading | None:
        """Wait for the sums; the reading (the same on every rank), or None where it is not finite."""
        if self.work is not None:
            self.work.wait()
        norms = self.sums.flatten(1).norm(dim=1).tolist()
        one_step = _ratio(norms[0], norms[1])
        if one_step is None:
            return None
        return Reading(one_step, _ratio(norms[2], norms[3]) if self.accumulated else None)


@dataclass(frozen=True)
class Route:
    """How a whitened layer's gradient travels, as far as the meter's shadow needs it."""

    collective: str
    op: str
    group: dist.ProcessGroup
    wire: WireFormat
    error_feedback: bool
    second_stage: bool
    """All-reduce route whose all-gather re-encodes on the wire (``all_gather_dtype = "wire"``);
    with ``bf16`` the second stage rounds ``D`` itself, which the shadow would round alike."""
    gather_error_feedback: bool

    @classmethod
    @functools.lru_cache(maxsize=256)  # asked every step of every whitened layer; a handful of distinct routes
    def of(cls, config: GiftConfig, collective: str, op: str, group) -> Route:
        plan = policy.plan(config, "linear", selected=True, collective=collective)
        return cls(collective, op, resolve_group(group), WireFormat.gift(config), plan.error_feedback,
                   collective == "all_reduce" and plan.gather_dtype == "wire", plan.gather_error_feedback)

    @property
    def keeps_residuals(self) -> bool:
        return self.error_feedback or self.gather_error_feedback


class Window:
    """One layer's meter window (host-side; not checkpointed: a restored run starts a new one)."""

    def __init__(self, fqn: str, d_out: int, d_in: int, shard_rows: int, step: int, device: torch.device) -> None:
        seed = (zlib.crc32(fqn.encode()) << 31) + step  # the same S on every rank, a new one per window
        generator = torch.Generator().manual_seed(seed)
        self.sketch = (torch.randn(SKETCH_ROWS, d_out, generator=generator) / math.sqrt(SKETCH_ROWS)).to(device)
        self.columns = (torch.randn(d_in, SKETCH_COLUMNS, generator=generator) / math.sqrt(SKETCH_COLUMNS)).to(device)
        """``Omega``: the rest of the ``d_in`` side's sketch (module docstring)."""
        self.principal: torch.Tensor | None = None
        """``Q``: the layer's input basis at the latest step, sent exactly (module docstring)."""
        # The shadow's residuals start at zero (and stay there without error feedback): adding
        # zeros changes no value, and the stages see the same inputs at every step (one graph).
        self.residual = torch.zeros(d_out, d_in, device=device)
        self.gather_residual = torch.zeros(shard_rows, d_in, device=device)
        self.sums = torch.zeros(2, SKETCH_ROWS, d_in, device=device)  # GIFT, Euclidean: counted steps
        self.last_step = step - 1
        self.counting = False
        """Whether this step's errors are summed (from the step after the shadow's first)."""
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None
        """This step's shares from :meth:`DeliveredMeter.before`: ``c S G_r`` and the shadow's first stage."""
        self.route: Route | None = None
        self.whitening: Whitening | None = None
        """The shadow's ``T`` this step (GIFT's shadow only)."""

    @property
    def gift_shadow(self) -> bool:
        """Whether the shadow is GIFT's route (the layer on its fallback) rather than Euclidean."""
        return self.whitening is not None


class DeliveredMeter:
    """The meter of one whitened layer (module docstring)."""

    def __init__(self, fqn: str, d_out: int, d_in: int, config: GiftConfig) -> None:
        self.fqn, self.d_out, self.d_in, self.config = fqn, d_out, d_in, config
        self.window: Window | None = None
        self.compiled: bool | None = None
        """Whether the shadow runs compiled (:data:`COMPILE_MIN_NUMEL`); decided at the first step."""

    def position(self, step: int, route: Route) -> str | None:
        """``"read"`` (the reading's step), ``"shadow"`` (an earlier step of the window) or None."""
        span = self.config.meter_window if route.keeps_residuals else 0
        before = -step % self.config.meter_interval  # steps until the next reading
        return "read" if before == 0 else "shadow" if before <= span else None

    @torch.no_grad()
    def before(self, step: int, grad: torch.Tensor, route: Route, whitening: Whitening, on_fallback: bool = False) -> None:
        """Ahead of the real reduction: this rank's share of the shadow's first stage.
        ``whitening``: the layer's ``T`` this step (its basis compresses the reading). On the
        layer's fallback (``on_fallback``) the shadow is GIFT's route with it, and the delivered
        gradient the Euclidean one."""
        world = dist.get_world_size(route.group)
        if self.compiled is None:
            self.compiled = self._compile_stages(route, world, grad.device)
        where = self.position(step, route)
        if where is None:
            return
        g = grad.detach().float()
        window = self.window
        if window is None or window.last_step != step - 1 or window.gift_shadow != on_fallback:  # a new window (a gap, a switch: start over)
            window = self.window = Window(self.fqn, self.d_out, self.d_in, _shard_rows(self.d_out, world), step, g.device)
            window.counting = where == "read"  # a window joined late counts from its next step
        args = (g, window.residual, window.sketch, _scale(route, world), route, world)
        if on_fallback:  # eagerly: a layer is rarely on its fallback, and a compile then would stall the run
            window.residual, *held = _first_stage(*args, whitening)
        else:
            window.residual, *held = (_compiled_first_stage if self.compiled else _first_stage)(*args)
        window.held = tuple(held)
        window.whitening = whitening if on_fallback else None
        window.principal = whitening.tensors.get("basis")
        window.route, window.last_step = route, step

    def _compile_stages(self, route: Route, world: int, device: torch.device) -> bool:
        """Whether the shadow runs compiled; if so, compile it now, on zeros (the layer's first
        step is in the run's compile warm-up; its first window may be in the timed steps)."""
        if self.d_out * self.d_in < COMPILE_MIN_NUMEL or route.wire.scale_mode == "global_max":
            return False  # global_max agrees on scales with a collective: not on zeros, out of turn
        window = Window(self.fqn, self.d_out, self.d_in, _shard_rows(self.d_out, world), 0, device)
        _compiled_first_stage(torch.zeros_like(window.residual), window.residual, window.sketch, _scale(route, world), route, world)
        if route.second_stage:
            own = _own_rows(self.d_out, world, dist.get_rank(route.group))
            _compiled_second_stage(window.residual[own], window.gather_residual, window.gather_residual, route, self.d_out)
        return True

    @torch.no_grad()
    def after(self, step: int, output: torch.Tensor, gather_error: torch.Tensor | None = None) -> PendingReading | None:
        """After the real reduction (``output``: all of ``D``, or this rank's rows of it on the
        reduce-scatter route; ``gather_error``: on the all-reduce route, the owner's rounding
        error of the second stage, ``comm.Reduction.gather_residual``): complete this step's
        shares; on the reading's step, start summing them over the ranks and return the
        reading on its way (the same on every rank once it arrives)."""
        window = self.window
        if window is None or window.held is None or window.last_step != step:
            return None
        route = window.route
        where = self.position(step, route)
        grad_share, shadow = window.held
        window.held = None
        world = dist.get_world_size(route.group)
        rows = _own_rows(self.d_out, world, dist.get_rank(route.group))
        n = rows.stop - rows.start
        delivered = (output[rows] if route.collective == "all_reduce" else output[:n]).float()
        s_own = window.sketch[:, rows]
        real = s_own @ delivered - grad_share
        if route.second_stage:
            args = (delivered, gather_error, window.gather_residual, route, self.d_out)
            if window.gift_shadow:
                window.gather_residual, error = _second_stage(*args, window.whitening)
            else:
                window.gather_residual, error = (_compiled_second_stage if self.compiled else _second_stage)(*args)
            shadow = shadow + s_own @ error
        gift, euclidean = (shadow, real) if window.gift_shadow else (real, shadow)
        if window.counting:
            window.sums += torch.stack([gift, euclidean])
        window.counting = True
        if where != "read":
            return None
        sums = _compress(torch.cat([torch.stack([gift, euclidean]), window.sums]), window.principal, window.columns)
        window.sums.zero_()
        # Asynchronous: on a slow link a blocking sum would wait behind the gradients' bytes
        # already in flight (+59 ms on a reading's step at 200 Mbit/s, statistics_queue_backward.md).
        work = dist.all_reduce(sums, group=route.group, async_op=True) if world > 1 else None
        return PendingReading(step, sums, work, route.keeps_residuals)


COMPILE_MIN_NUMEL = 1 << 16
"""Layers from this size on run their shadow compiled (:mod:`static_compile`; an FP8 round trip of
256 x 256 takes 0.09 ms instead of 1.0, of 4M elements 5 ms instead of 118), compiled at the
layer's first step so that no window stalls. Smaller ones stay eager: there a compile (about a
second per shape) costs more than it saves in a run."""


def _first_stage(g: torch.Tensor, residual: torch.Tensor, sketch: torch.Tensor, c: float, route: Route, world: int,
                 whitening: Whitening | None = None):
    """This rank's shadow of the route's first stage, Euclidean or (``whitening``) GIFT's:
    ``(its next shadow residual, c S G_r, c S (sent - G_r))``."""
    payload = _guarded_payload(g, residual, whitening)
    sent = _in_coordinates(whitening, lambda u: round_trip(u, route.wire, world, route.group), payload)
    next_residual = finite_or_zero(payload - sent) if route.error_feedback else residual
    return next_residual, c * (sketch @ g), c * (sketch @ (sent - g))


def _second_stage(delivered: torch.Tensor, gather_error: torch.Tensor, residual: torch.Tensor, route: Route, rows: int,
                  whitening: Whitening | None = None):
    """The owner's shadow of the all-reduce's second stage (Euclidean or, ``whitening``, GIFT's),
    from its rows of ``D`` and its rounding error there (together: what the second stage
    encoded, module docstring): ``(its next shadow gather residual, the error of its rows)``.
    ``rows``: the gradient's."""
    shard = F.pad(delivered, (0, 0, 0, residual.shape[0] - delivered.shape[0])) + gather_error.float()
    payload = _guarded_payload(shard, residual, whitening)
    sent = _in_coordinates(whitening, lambda u: shard_round_trip(u, rows, route.group, route.wire), payload)
    next_residual = finite_or_zero(payload - sent) if route.gather_error_feedback else residual
    return next_residual, (sent - shard)[: delivered.shape[0]]


def _guarded_payload(carrier: torch.Tensor, residual: torch.Tensor, whitening: Whitening | None) -> torch.Tensor:
    """``carrier + residual``; for GIFT's shadow, ``carrier`` alone where ``comm``'s residual guard
    would not send the residual (``comm.guarded_sum``, the first stage's rule)."""
    return carrier + residual if whitening is None else guarded_sum(carrier, residual, whitening)[0]


def _in_coordinates(whitening: Whitening | None, round_trip_fn, x: torch.Tensor) -> torch.Tensor:
    """``round_trip_fn(x)``, or GIFT's: in whitened coordinates, mapped back (as ``comm.py``)."""
    if whitening is None:
        return round_trip_fn(x)
    return whitening.unwhiten(round_trip_fn(whitening.whiten(x)))


_compiled_first_stage = static_compile(_first_stage)
_compiled_second_stage = static_compile(_second_stage)


def _compress(shares: torch.Tensor, principal: torch.Tensor | None, columns: torch.Tensor) -> torch.Tensor:
    """``[M Q, M P Omega]`` of every share ``M`` (``..., d_in``): the same squared norm in
    expectation, ``r + SKETCH_COLUMNS`` wide (module docstring). Shares are sent whole where that
    would not halve them (there the second sketch's spread would buy little), or where ``T`` has
    no basis (a dense ``T``)."""
    if principal is None or 2 * (principal.shape[1] + columns.shape[1]) > shares.shape[-1]:
        return shares
    exact = shares @ principal
    return torch.cat([exact, (shares - exact @ principal.T) @ columns], dim=-1)


def _shard_rows(d_out: int, world: int) -> int:
    return -(-d_out // world)


def _own_rows(d_out: int, world: int, rank: int) -> slice:
    """The rows of the reduced gradient this rank owns (the reduce-scatter's dim-0 chunk)."""
    shard_rows = _shard_rows(d_out, world)
    return slice(min(rank * shard_rows, d_out), min((rank + 1) * shard_rows, d_out))


def _scale(route: Route, world: int) -> float:
    return 1.0 / world if route.op == "avg" else 1.0


def _ratio(gift: float, euclidean: float) -> float | None:
    if not (math.isfinite(gift) and math.isfinite(euclidean)) or euclidean <= 0:
        return None
    return gift / euclidean


__all__ = ["DeliveredMeter", "PendingReading", "Reading", "Route", "SKETCH_COLUMNS", "SKETCH_ROWS", "Window"]
