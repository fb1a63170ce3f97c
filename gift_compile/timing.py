"""Where a step's time goes: GIFT's codec, waiting for gradient communication, everything else.

So a user can tell whether the link or the codec bounds their step (and whether FP8/GIFT pays
on their cluster), each step is cut into segments of three kinds by ``tick`` calls: a graph that
runs as ordered Python (graph_trainer's joint graph) gets one wherever its nodes change kind
(``passes/time_meter.py``):

* ``codec``: what GIFT added (statistics, whitening, encoding, decoding, issuing collectives);
* ``wait``: blocking on a gradient collective's result (``wait_tensor``);
* ``compute``: everything else (the model's forward and backward, other collectives).

Each tick closes the segment since the previous one. On CPU the host executes every op as it
is called, so host time is the time; on a GPU each tick records a CUDA event on the current
stream and the segments are read from the events when the totals are taken (one sync per
report, none per tick).

The standard FSDP2 trainer runs no graph of ours: FSDP2 calls GIFT's reduce-scatter from its own
hook, and its codec is one Inductor call per parameter with the collective and its wait inside.
There the trainer opens and closes each step (``tick("compute")`` ... ``tick(None)``), the
hooks run as :func:`codec_section`, and inside a section every collective's wait is
``gift::timed_wait`` (``collectives.py`` issues each collective and waits explicitly), which
ticks ``wait`` before it blocks and ``codec`` after, from inside the compiled call. CPU only:
on a GPU FSDP2 runs that hook on its reduce-scatter stream, beside the backward, where host
time says nothing and stream time does not split the step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

KINDS = ("codec", "wait", "compute")

_TRACE = os.environ.get("GIFT_TIME_TRACE")
"""A path: every host tick of this process is appended to ``<path>.<pid>`` as its wall time
and the kind it opens (``end`` where a step ends), and every :func:`mark` as its label
(``benchmarks/link_trace.py`` lines them up with the link's counters)."""
_trace_file = None


def _trace(label: str) -> None:
    global _trace_file
    if _trace_file is None:
        _trace_file = open(f"{_TRACE}.{os.getpid()}", "a", buffering=1 << 16)  # noqa: SIM115 (open for the process's life)
    _trace_file.write(f"{time.time():.6f} {label}\n")
    if label == "end":
        _trace_file.flush()  # once a step: a rank may end without closing it


def mark(label: str) -> None:
    """A named point of the step (where the backward starts) in the ``GIFT_TIME_TRACE`` trace;
    nothing without one. Not a tick: the meter's segments go on."""
    if _TRACE:
        _trace(label)


torch.fx.node.has_side_effect(mark)


@dataclass
class StepTimer:
    """Seconds per kind, summed over the steps since the last :meth:`take`, and over the run
    from its second step (:meth:`summary`: the first step compiles)."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    steps: int = 0
    run_totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    run_steps: int = 0
    first_step_done: bool = False
    _last: object = None
    _kind: str | None = None
    _events: list = field(default_factory=list)  # (kind, start event, end event, in the run's totals) on a GPU

    def tick(self, kind: str | None, device: torch.device | None = None) -> None:
        """Close the running segment and open one of ``kind`` (``None``: the step ends)."""
        counted = self.first_step_done
        if device is not None and device.type == "cuda":
            now = torch.cuda.Event(enable_timing=True)
            now.record()
            if self._last is not None:
                self._events.append((self._kind, self._last, now, counted))
        else:
            now = time.perf_counter()
            if self._last is not None:
                self._add(self._kind, now - self._last, counted)
            if _TRACE:
                _trace(kind or "end")
        self._last, self._kind = (now, kind) if kind is not None else (None, None)
        if kind is None:
            self.steps += 1
            self.run_steps += counted
            self.first_step_done = True

    @property
    def kind(self) -> str | None:
        """The kind of the running segment; None between steps."""
        return self._kind

    def take(self) -> dict[str, float]:
        """Seconds per step and kind since the last call (and ``step``, their sum); then reset."""
        self._read_events()
        taken = _per_step(self.totals, self.steps)
        self.totals, self.steps = dict.fromkeys(KINDS, 0.0), 0
        return taken

    def summary(self) -> str | None:
        """The time meter over the run from its second step, in one line (the counters table's
        footer); None before such a step was timed."""
        self._read_events()
        seconds = _per_step(self.run_totals, self.run_steps)
        if seconds["step"] <= 0:
            return None
        return (f"time meter, {self.run_steps} steps after the first: {seconds['step']:.3f} s/step = codec {seconds['codec']:.3f} + "
                f"waiting for gradient communication {seconds['wait']:.3f} + other compute {seconds['compute']:.3f}; codec "
                f"and waiting {(seconds['codec'] + seconds['wait']) / seconds['step']:.0%} of the step")

    def _add(self, kind: str, seconds: float, counted: bool) -> None:
        self.totals[kind] += seconds
        if counted:
            self.run_totals[kind] += seconds

    def _read_events(self) -> None:
        """On a GPU: add the recorded segments to the totals (one sync)."""
        if self._events:
            torch.cuda.synchronize()
            for kind, start, end, counted in self._events:
                self._add(kind, start.elapsed_time(end) / 1000, counted)
            self._events = []


def _per_step(totals: dict[str, float], steps: int) -> dict[str, float]:
    """Seconds per step and kind, and ``step``, their sum."""
    out = {kind: seconds / max(steps, 1) for kind, seconds in totals.items()}
    out["step"] = sum(out.values())
    return out


_TIMERS: dict[str, StepTimer] = {}


def timer(namespace: str) -> StepTimer:
    """The step timer of a GIFT namespace (created on first use)."""
    found = _TIMERS.get(namespace)  # (not setdefault: it would build a StepTimer at every tick)
    return found if found is not None else _TIMERS.setdefault(namespace, StepTimer())


def tick(namespace: str, kind: str | None, device: torch.device | None = None) -> None:
    """What an instrumented graph calls at each change of kind."""
    timer(namespace).tick(kind, device)


torch.fx.node.has_side_effect(tick)  # no output: dead-code elimination must keep it


_timed_waits: str | None = None
"""The namespace whose timer the collectives' waits tick, inside a :func:`codec_section`; else None."""


def timed_waits_namespace() -> str | None:
    """Where ``collectives.received`` sends its waits (read when a codec is traced: Dynamo guards on it)."""
    return _timed_waits


@contextlib.contextmanager
def timed_step(namespace: str, device: torch.device) -> Iterator[None]:
    """One forward-backward as a step of the time meter, for a trainer that runs no graph of ours
    (module docstring); on CPU only."""
    if device.type != "cpu":
        yield
        return
    timer(namespace).tick("compute")
    try:
        yield
    finally:
        timer(namespace).tick(None)


@contextlib.contextmanager
def codec_section(namespace: str, device: torch.device) -> Iterator[None]:
    """Time host code of GIFT's codec that runs outside any graph (module docstring) as
    ``codec``, its collectives' waits as ``wait``, and go back to the kind it interrupted. Does
    nothing outside a timed step (the trainer opens none on a GPU) and inside another section."""
    global _timed_waits
    timer_ = timer(namespace)
    interrupted = timer_.kind
    if device.type != "cpu" or interrupted is None or _timed_waits is not None:
        yield
        return
    timer_.tick("codec")
    _timed_waits = namespace
    try:
        yield
    finally:
        _timed_waits = None
        timer_.tick(interrupted)


@torch.library.custom_op("gift::timed_wait", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def timed_wait(received: torch.Tensor, namespace: str) -> torch.Tensor:
    """``wait_tensor`` timed as ``wait`` inside a :func:`codec_section`, compiled calls included."""
    tick(namespace, "wait")
    torch.ops._c10d_functional.wait_tensor(received)
    tick(namespace, "codec")
    return received.clone()  # a custom op's output may not alias its input


@timed_wait.register_fake
def _(received, namespace):
    return torch.empty_like(received)


torch.fx.node.has_side_effect(torch.ops.gift.timed_wait.default)


__all__ = ["KINDS", "StepTimer", "codec_section", "mark", "tick", "timed_step", "timed_waits_namespace", "timer"]
