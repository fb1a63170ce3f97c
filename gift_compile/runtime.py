"""GIFT state at run time: the registry compiled graphs reach through opaque custom ops.

A compiled backward graph must not hold GIFT state as constants: factors change at every
refresh, and Inductor's FX graph cache replays a graph without re-running our pass
(DESIGN.md decision 5). The pass therefore inserts calls to the ``gift::`` ops below, which
carry only strings and ints (namespace, layer FQN, process-group name, shapes) and look the
state up here, at run time, on every call::

    token   = gift::begin_step(ns, fqn, group, d_out, d_in, layer_input, grad_output)
              refresh the factors when due (collectives over `group`)
    factors = gift::load_factors(ns, fqn, d_out, d_in, token)   copies of this step's T, T^-1
    R       = gift::load_residual(ns, fqn, d_out, d_in, token)  the residual itself
    ... whiten, quantize, FP8 collective, unwhiten (plain aten ops, fused by Inductor) ...
    gift::end_step(ns, fqn, token, R', stats, bytes)             keep R' as the state, count the step

The ``token`` data dependency orders the ops; ``end_step`` and ``record_euclidean`` are
marked side-effecting so dead-code elimination keeps them.

The residual (``d_out x d_in`` fp32 per layer) is never copied: ``load_residual`` hands out
the state tensor and ``end_step`` adopts the graph's ``R'`` buffer as the new state. That is
safe because (1) after ``R`` is read the state no longer refers to it once ``end_step`` runs,
so whatever Inductor reuses that buffer for is harmless, and (2) ``end_step``'s lowering below
takes ``R'`` out of Inductor's buffer reuse, so nothing later in the graph overwrites it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from tabulate import tabulate
from torch._inductor.lowering import fallback_handler, register_lowering
from torch._inductor.virtualized import V
from torch.distributed.distributed_c10d import _resolve_process_group

from gift_compile.config import GiftConfig
from gift_compile.state import GiftState, factor_shapes


@dataclass
class LayerCounters:
    """What one layer's gradient did, accumulated over steps (all per rank)."""

    path: str  # "gift" or the Euclidean wire dtype
    steps: int = 0
    bytes_sent: int = 0
    refreshes: int = 0
    last_refresh_step: int | None = None
    # float64 [saturated, flushed] summed over steps, and [||err||^2, ||sent||^2] of the last
    # step, both kept on the device that computed them: reading them back every step would
    # make the host wait for the GPU once per layer per step. They are read when asked for.
    _hits: torch.Tensor | None = field(default=None, repr=False)
    _last_squares: torch.Tensor | None = field(default=None, repr=False)

    def add_step(self, stats: torch.Tensor, bytes_sent: int) -> None:
        """Count one step whose encoding reported ``stats`` (``comm.Reduction.stats``)."""
        stats = stats.detach()
        if self._hits is None:
            self._hits = torch.zeros(2, dtype=torch.float64, device=stats.device)
        self._hits.add_(stats[:2])
        self._last_squares = stats[2:].double()  # a copy: the graph may reuse the stats buffer
        self.steps += 1
        self.bytes_sent += bytes_sent

    def as_dict(self) -> dict:
        """Every counter, with the device-side ones read back once."""
        saturated = flushed = 0.0
        rel_error = None  # ||V - deq(Q(V))|| / ||V|| of the last step (whitened coordinates on the GIFT path)
        if self._hits is not None:
            saturated, flushed = self._hits.tolist()
            err_sq, sent_sq = self._last_squares.tolist()
            rel_error = (err_sq / sent_sq) ** 0.5 if sent_sq > 0 else 0.0
        return {
            "path": self.path, "steps": self.steps, "bytes_sent": self.bytes_sent, "saturated": int(saturated),
            "flushed": int(flushed), "refreshes": self.refreshes, "last_refresh_step": self.last_refresh_step,
            "last_rel_error": rel_error,
        }

    @property
    def saturated(self) -> int:
        """Elements that hit the FP8 format's largest magnitude."""
        return self.as_dict()["saturated"]

    @property
    def flushed(self) -> int:
        """Nonzero elements that became zero on the wire."""
        return self.as_dict()["flushed"]

    @property
    def last_rel_error(self) -> float | None:
        return self.as_dict()["last_rel_error"]


@dataclass
class GiftRuntime:
    """One namespace's config, checkpointable state and counters."""

    config: GiftConfig
    state: GiftState = field(init=False)
    counters: dict[str, LayerCounters] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state = GiftState(self.config)

    def counter(self, fqn: str, path: str) -> LayerCounters:
        return self.counters.setdefault(fqn, LayerCounters(path))

    def table(self) -> str:
        rows = []
        for fqn, c in sorted(self.counters.items()):
            d = c.as_dict()
            error = None if d["last_rel_error"] is None else f"{d['last_rel_error']:.3e}"
            rows.append((fqn, d["path"], d["steps"], d["bytes_sent"], d["saturated"], d["flushed"], d["refreshes"], d["last_refresh_step"], error))
        headers = ["layer", "path", "steps", "bytes sent", "saturated", "flushed", "refreshes", "last refresh", "last rel. error"]
        return tabulate(rows, headers=headers)

    def bytes_per_step(self) -> dict[str, float]:
        """Mean bytes sent per step, by path."""
        totals: dict[str, float] = {}
        for c in self.counters.values():
            if c.steps:
                totals[c.path] = totals.get(c.path, 0.0) + c.bytes_sent / c.steps
        return totals


_RUNTIMES: dict[str, GiftRuntime] = {}
_LOCK = threading.Lock()


def register_runtime(namespace: str, config: GiftConfig) -> GiftRuntime:
    """Create (or return the existing, same-config) runtime of ``namespace``."""
    with _LOCK:
        existing = _RUNTIMES.get(namespace)
        if existing is not None:
            if existing.config != config:
                raise ValueError(
                    f"GIFT namespace {namespace!r} is already in use with another config; "
                    "pass a distinct name= to gift_backend for each model"
                )
            return existing
        _RUNTIMES[namespace] = runtime = GiftRuntime(config)
        return runtime


def get_runtime(namespace: str) -> GiftRuntime:
    try:
        return _RUNTIMES[namespace]
    except KeyError:
        raise RuntimeError(
            f"no GIFT runtime named {namespace!r} in this process; build the backend with "
            f"gift_backend(config, name={namespace!r}) before running a graph compiled with it"
        ) from None


# The gift:: ops run Python on every call (refresh, residual hand-over, counters): a CUDA
# graph must not capture them, or replays would skip that Python and reuse stale tensors.
_RUNS_PYTHON = (torch.Tag.cudagraph_unsafe,)


def _token(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)


@torch.library.custom_op("gift::begin_step", mutates_args=(), tags=_RUNS_PYTHON)
def begin_step(
    namespace: str, fqn: str, group_name: str, d_out: int, d_in: int, layer_input: torch.Tensor, grad_output: torch.Tensor | None
) -> torch.Tensor:
    runtime = get_runtime(namespace)
    layer = runtime.state.layer(fqn, d_out, d_in, layer_input.device)
    counter = runtime.counter(fqn, "gift")
    if layer.is_refresh_step():
        layer.refresh(layer_input, grad_output, _resolve_process_group(group_name))
        counter.refreshes += 1
        counter.last_refresh_step = int(layer.step)
    return _token(layer_input)


@begin_step.register_fake
def _(namespace, fqn, group_name, d_out, d_in, layer_input, grad_output):
    return _token(layer_input)


@torch.library.custom_op("gift::load_factors", mutates_args=(), tags=_RUNS_PYTHON)
def load_factors(namespace: str, fqn: str, d_out: int, d_in: int, token: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone() for t in get_runtime(namespace).state.layer(fqn, d_out, d_in, token.device).factor_tensors()]


@load_factors.register_fake
def _(namespace, fqn, d_out, d_in, token):
    shapes = factor_shapes(get_runtime(namespace).config, d_out, d_in)
    return [token.new_empty(shape) for shape in shapes]


@torch.library.custom_op("gift::load_residual", mutates_args=(), tags=_RUNS_PYTHON)
def load_residual(namespace: str, fqn: str, d_out: int, d_in: int, token: torch.Tensor) -> torch.Tensor:
    return get_runtime(namespace).state.layer(fqn, d_out, d_in, token.device).residual  # not a copy: see the module docstring


@load_residual.register_fake
def _(namespace, fqn, d_out, d_in, token):
    return token.new_empty((d_out, d_in))


@torch.library.custom_op("gift::end_step", mutates_args=(), tags=_RUNS_PYTHON)
def end_step(
    namespace: str, fqn: str, token: torch.Tensor, new_residual: torch.Tensor | None, stats: torch.Tensor, bytes_sent: int
) -> None:
    runtime = get_runtime(namespace)
    runtime.state.layer(fqn).end_step(new_residual)
    runtime.counter(fqn, "gift").add_step(stats, bytes_sent)


@end_step.register_fake
def _(namespace, fqn, token, new_residual, stats, bytes_sent):
    return None


@register_lowering(torch.ops.gift.end_step.default, type_promotion_kind=None)
def _lower_end_step(namespace, fqn, token, new_residual, stats, bytes_sent):
    if new_residual is not None:
        # end_step keeps this buffer as the layer's residual: no later buffer of the graph may
        # reuse its memory, and no later kernel may write into it in place.
        new_residual.realize()
        V.graph.never_reuse_buffers.add(new_residual.get_name())
    return fallback_handler(torch.ops.gift.end_step.default, add_to_fallback_set=False)(
        namespace, fqn, token, new_residual, stats, bytes_sent
    )


@torch.library.custom_op("gift::record_euclidean", mutates_args=(), tags=_RUNS_PYTHON)
def record_euclidean(namespace: str, fqn: str, path: str, stats: torch.Tensor, bytes_sent: int) -> None:
    get_runtime(namespace).counter(fqn, path).add_step(stats, bytes_sent)


@record_euclidean.register_fake
def _(namespace, fqn, path, stats, bytes_sent):
    return None


for _op in (torch.ops.gift.end_step.default, torch.ops.gift.record_euclidean.default):
    torch.fx.node.has_side_effect(_op)
