"""benchmarks/link_trace.py: a step's unused link time split into idle and slow, from counters."""

from __future__ import annotations

import numpy as np
import pytest
from link_trace import bin_rates, kind_strip, phases, split_step, strip

RATE = 1_000_000.0  # bytes/s


def counter(pieces: list[tuple[float, float]], sample_s: float = 0.001) -> tuple[np.ndarray, np.ndarray]:
    """A transmit counter sampled every ``sample_s``: ``pieces`` of (seconds, share of RATE)."""
    times, carried, t, total = [0.0], [0.0], 0.0, 0.0
    for seconds, share in pieces:
        for _ in range(round(seconds / sample_s)):
            t, total = t + sample_s, total + share * RATE * sample_s
            times.append(t)
            carried.append(total)
    return np.array(times), np.array(carried)


def test_unused_link_time_splits_into_idle_and_slow_bins():
    # 0.1 s at the link's rate, 0.1 s with nothing sent, 0.1 s at half the rate: the step carried
    # 0.15 s of wire, left 0.15 s unused: 0.1 s idle and 0.05 s short in the slow bins.
    times, carried = counter([(0.1, 1.0), (0.1, 0.0), (0.1, 0.5)])
    edges = np.arange(0.0, 0.3 + 0.005, 0.01)
    rates = bin_rates(times, carried, edges)
    split = split_step(rates, 0.01, RATE)
    assert split.step_s == pytest.approx(0.3)
    assert split.wire_s == pytest.approx(0.15)
    assert split.idle_s == pytest.approx(0.1)
    assert split.slow_s == pytest.approx(0.05)
    assert strip(rates, RATE) == "#" * 10 + "." * 10 + "+" * 10


def test_kind_strip_reads_what_the_time_meter_said_at_each_bin(tmp_path):
    # timing.py's trace: wall time and the kind each tick opens ("end": the step closed)
    trace = tmp_path / "ticks.123"
    trace.write_text("10.000 compute\n10.021 codec\n10.030 backward\n10.039 wait\n10.050 end\n")  # a mark is no kind
    edges = np.arange(10.0, 10.06 + 0.005, 0.01)
    assert kind_strip(trace, edges) == "==ccw "


def test_the_backward_starts_at_the_steps_first_backward_mark():
    # 0.2 s of forward at the link's rate, then 0.1 s of backward carrying a quarter of it; the
    # first backward mark at 0.2 s (the other rank's came later) splits the step there (the one at
    # -0.05 s is the step before's).
    times, carried = counter([(0.2, 1.0), (0.1, 0.25)])
    marks = np.array([-0.05, 0.2, 0.21])
    forward, forward_wire, backward, backward_wire = phases(times, carried, 0.0, 0.3, marks, RATE)
    assert (forward, backward) == pytest.approx((0.2, 0.1))
    assert (forward_wire, backward_wire) == pytest.approx((0.2, 0.025))
    assert phases(times, carried, 0.0, 0.3, np.array([]), RATE) is None  # fp32: no GIFT pass, no marks
