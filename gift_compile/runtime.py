"""A GIFT runtime: one model's config, checkpointable state and counters, and the eager
operations of a layer's step on them; plus the process-wide registry that compiled graphs
reach it through (by namespace, from the ``gift::`` ops in ``ops.py``).

The eager reference calls the same methods directly, so a compiled graph and the reference
share every line of state handling.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gift_compile import policy
from gift_compile.agreement import agree
from gift_compile.comm import Reduction
from gift_compile.config import GiftConfig
from gift_compile.counters import LayerCounters, counters_table
from gift_compile.geometry import Whitening
from gift_compile.meter import PendingReading, Route
from gift_compile.state import GiftLayerState, GiftState

log = logging.getLogger(__name__)


@dataclass
class GiftRuntime:
    """One namespace's config, checkpointable state and counters."""

    config: GiftConfig
    state: GiftState = field(init=False)
    _counters: dict[str, LayerCounters] = field(default_factory=dict, init=False, repr=False)
    readings: dict[str, PendingReading] = field(default_factory=dict, init=False, repr=False)
    """The live meter's readings on their way, by layer (:meth:`settle_reading`)."""
    integration: Any = None
    """What an integration's graph pass needs from its session (torchtitan: ``graph_pass.PassContext``)."""
    agreed: set[tuple[str, str]] = field(default_factory=set)
    """``(group name, description)`` pairs the ranks already agreed on (``agreement.agree``)."""
    owners: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    """Linear FQN -> the weight whose gradients this runtime's state of that layer belongs to."""

    def __post_init__(self) -> None:
        self.state = GiftState(self.config)
        # A checkpoint holds the effect of every reading taken before it (a fallback, a damping move).
        self.state.register_state_dict_pre_hook(lambda *_: self.settle_readings())

    @property
    def counters(self) -> dict[str, LayerCounters]:
        """Per-layer counters; the readings still on their way are waited for and counted first."""
        self.settle_readings()
        return self._counters

    def agree(self, group: dist.ProcessGroup, description: str, device: torch.device) -> None:
        """The ranks' check before GIFT's first collective of a graph or group; once per description."""
        key = (group.group_name, description)
        if key not in self.agreed:
            agree(description, group, device)
            self.agreed.add(key)

    def claim(self, fqn: str, weight: torch.nn.Parameter) -> None:
        """Record that layer ``fqn``'s state belongs to ``weight``; a second model whose layer has
        the same FQN would otherwise share its residual, basis, step and meter."""
        owner = self.owners.get(fqn)
        if owner is weight:
            return
        if owner is not None:
            raise ValueError(
                f"GIFT: two models with a layer named {fqn!r} are compiled with the same GIFT backend, so they would "
                "share that layer's residual, basis and step counter; give each model its own backend: "
                "torch.compile(model, backend=gift_backend(config)) per model"
            )
        self.owners[fqn] = weight

    def counter(self, fqn: str, path: str) -> LayerCounters:
        return self._counters.setdefault(fqn, LayerCounters(path))

    def table(self) -> str:
        self.report_restarts()
        return counters_table(self._counters)

    def report_restarts(self) -> int:
        """Log the layers whose basis or factors were restarted since the last report; returns
        the total (a host read of the device-side counts: call it when reporting, not per step)."""
        total = 0
        for fqn, counter in self.counters.items():
            restarts = counter.as_dict()["restarts"]
            if restarts > counter.restarts_reported:
                log.warning("GIFT layer %s: its basis/factors were not finite and restarted fresh (%d time(s) so far)",
                            fqn, restarts)
                counter.restarts_reported = restarts
            total += restarts
        return total

    def bytes_per_step(self) -> dict[str, float]:
        """Mean bytes sent per step, by path (and ``stats`` for the current-step statistics)."""
        totals: dict[str, float] = {}
        for c in self.counters.values():
            if c.steps:
                totals[c.path] = totals.get(c.path, 0.0) + c.bytes_sent / c.steps
                if c.stats_bytes:
                    totals["stats"] = totals.get("stats", 0.0) + c.stats_bytes / c.steps
        return totals

    # -- one layer's step (stateful layers: whitened, or Euclidean with error feedback) ---------
    def path(self, whitened: bool) -> str:
        """The counters row's path of a stateful layer (``policy.Plan.path``)."""
        return policy.plan(self.config, "linear", selected=whitened).path

    def begin_step(self, fqn: str, d_out: int, d_in: int, whitened: bool, layer_input: torch.Tensor, group) -> bool:
        """Create or place the layer's state, refresh periodic factors when due; returns whether
        the layer whitens this step."""
        self.settle_reading(fqn)  # the last reading decides this step's route and damping
        layer = self.state.layer(fqn, d_out, d_in, layer_input.device, whitened=whitened)
        counter = self.counter(fqn, self.path(whitened))
        if whitened:
            counter.add_restart(layer.restart_if_not_finite())
        refreshes = int(layer.refreshes)
        on = layer.begin_step(layer_input, group)
        if int(layer.refreshes) != refreshes:
            counter.refreshes += 1
            counter.last_refresh_step = int(layer.step)
        return on

    def layer(self, fqn: str) -> GiftLayerState:
        return self.state.layer(fqn)

    def meter(self, fqn: str, grad: torch.Tensor, whitening: Whitening, collective: str, op: str, group) -> None:
        """The live meter's part ahead of the reduction (``meter.py``): on a window's steps,
        this rank's share of the shadow: Euclidean, or on the fallback GIFT's with ``whitening``
        (the layer's ``T`` before the fallback's ``T = I``)."""
        layer = self.state.layer(fqn)
        layer.meter.before(int(layer.step), grad, Route.of(self.config, collective, op, group), whitening,
                           on_fallback=not layer.whitening_on())

    def end_step(
        self, fqn: str, group, reduction: Reduction, next_basis: torch.Tensor | None, next_scale: torch.Tensor | None,
        bytes_sent: int, stats_bytes: int,
    ) -> None:
        layer = self.state.layer(fqn)
        counter = self.counter(fqn, self.path(layer.whitened))
        if layer.meter is not None:
            pending = layer.meter.after(int(layer.step), reduction.output, reduction.gather_residual)
            if pending is not None:
                self.readings[fqn] = pending
                if layer.retry_due_at_this_steps_end():
                    self.settle_reading(fqn)
        # The gather error is reported without error feedback too (for the meter); the state
        # keeps it only where the layer keeps a gather residual.
        layer.end_step(reduction.residual, reduction.gather_residual, next_basis, next_scale)
        self._show_fallback(layer, counter)
        counter.add_step(reduction.stats, bytes_sent, stats_bytes)

    def settle_reading(self, fqn: str) -> None:
        """Wait for layer ``fqn``'s reading on its way, if any, and act on it as at the step it
        was taken: the meter's all-reduce travels beside the rest of the backward and is waited
        for where the reading is first needed (the layer's next step, a retry decided at this
        step's end, a checkpoint, the counters)."""
        pending = self.readings.pop(fqn, None)
        reading = pending.result() if pending is not None else None
        if reading is None:
            return
        layer, counter = self.state.layer(fqn), self._counters[fqn]
        before = int(layer.fallback_until)
        counter.error_vs_fp8, counter.accumulated_vs_fp8 = reading
        layer.record_reading(reading, pending.step)
        if self.config.adaptive_damping and layer.current_step:
            counter.damping = layer.damping
        if int(layer.fallback_until) != before:
            counter.fallbacks += 1
        self._show_fallback(layer, counter)

    def settle_readings(self) -> None:
        """:meth:`settle_reading` of every layer with a reading on its way."""
        for fqn in list(self.readings):
            self.settle_reading(fqn)

    @staticmethod
    def _show_fallback(layer: GiftLayerState, counter: LayerCounters) -> None:
        counter.fallback_until = None if layer.whitening_on() or not layer.whitened else int(layer.fallback_until)

    def record_euclidean(self, fqn: str, path: str, stats: torch.Tensor, bytes_sent: int) -> None:
        """A stateless Euclidean step: only counted."""
        self.counter(fqn, path).add_step(stats, bytes_sent)


_RUNTIMES: dict[str, GiftRuntime] = {}
_LOCK = threading.Lock()


def register_runtime(namespace: str, config: GiftConfig) -> GiftRuntime:
    """Create (or return the existing, same-config) runtime of ``namespace``: for an integration
    that owns one well-known namespace per process (torchtitan's session, FSDP2's install)."""
    with _LOCK:
        existing = _RUNTIMES.get(namespace)
        if existing is not None:
            if existing.config != config:
                raise ValueError(f"GIFT namespace {namespace!r} is already in use with another config")
            return existing
        _RUNTIMES[namespace] = runtime = GiftRuntime(config)
        return runtime


def new_runtime(prefix: str, config: GiftConfig) -> tuple[str, GiftRuntime]:
    """A fresh runtime under the first free namespace of ``prefix``, ``prefix#2``, ``prefix#3``...

    Names follow creation order, so the same program gets the same names in every process:
    the namespace is baked into compiled graphs, and a warm FX graph cache must find them."""
    with _LOCK:
        namespace, n = prefix, 1
        while namespace in _RUNTIMES:
            n += 1
            namespace = f"{prefix}#{n}"
        _RUNTIMES[namespace] = runtime = GiftRuntime(config)
        return namespace, runtime


def forget_runtimes() -> None:
    """Drop every registered runtime: a fresh process's view (a test pool between calls)."""
    with _LOCK:
        _RUNTIMES.clear()


def is_registered(namespace: str, runtime: GiftRuntime) -> bool:
    return _RUNTIMES.get(namespace) is runtime


def get_runtime(namespace: str) -> GiftRuntime:
    try:
        return _RUNTIMES[namespace]
    except KeyError:
        raise RuntimeError(
            f"no GIFT runtime named {namespace!r} in this process; build the backend with "
            f"gift_backend(config, name={namespace!r}) before running a graph compiled with it"
        ) from None


__all__ = ["GiftRuntime", "forget_runtimes", "get_runtime", "is_registered", "new_runtime", "register_runtime"]
