"""The time meter (``gift_compile/timing.py``): segments by kind, and where the ticks go."""

import torch
from torch import fx

from gift_compile import timing
from gift_compile.passes import time_meter


def test_segments_are_attributed_to_the_kind_that_opened_them(monkeypatch):
    clock = iter([0.0, 0.5, 0.6, 1.0, 10.0, 10.2, 10.3])  # a fake clock: what is measured, not how fast
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    t = timing.StepTimer()
    for kind in ("compute", "codec", "wait", None):  # step 1: 0.5 compute, 0.1 codec, 0.4 wait
        t.tick(kind)
    for kind in ("codec", "compute", None):  # step 2: 0.2 codec, 0.1 compute
        t.tick(kind)
    per_step = t.take()
    expected = {"codec": (0.1 + 0.2) / 2, "wait": 0.4 / 2, "compute": (0.5 + 0.1) / 2, "step": 1.3 / 2}
    assert per_step.keys() == expected.keys()
    assert all(abs(per_step[k] - v) < 1e-12 for k, v in expected.items())  # sums of floats: rounding only
    assert t.take()["step"] == 0.0  # taken: reset


def test_the_summary_covers_the_run_from_its_second_step_across_takes(monkeypatch):
    clock = iter([0.0, 5.0, 5.5, 5.8, 5.9, 6.0, 6.2])  # a fake clock, as above
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    t = timing.StepTimer()
    for kind in ("codec", None):  # step 1 (the compile): 5 s of codec, left out of the summary
        t.tick(kind)
    assert t.take()["codec"] == 5.0 and t.summary() is None  # logged, but nothing for the run's line yet
    for kind in ("compute", "wait", None):  # step 2: 0.3 compute, 0.1 wait
        t.tick(kind)
    t.take()  # a logged step: the summary still counts it
    for kind in ("codec", None):  # step 3: 0.2 codec
        t.tick(kind)
    assert t.summary() == ("time meter, 2 steps after the first: 0.300 s/step = codec 0.100 + waiting for gradient communication 0.050 + "
                           "other compute 0.150; codec and waiting 50% of the step")
    assert abs(t.take()["codec"] - 0.2) < 1e-12  # the summary reset nothing: step 3 is still to be logged


def test_ticks_mark_every_change_of_kind():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2)
    y = graph.call_function(torch.ops.aten.relu.default, (x,))  # compute
    codec = graph.call_function(torch.ops.aten.mul.Tensor, (y, 2.0))
    codec.meta[time_meter.CODEC] = True
    comm = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (codec, "sum", "0"))
    comm.meta[time_meter.CODEC] = True
    comm.meta["gift_gradient_comm"] = True
    wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (comm,))
    out = graph.call_function(torch.ops.aten.add.Tensor, (wait, y))  # compute again
    graph.output(out)
    for node in (codec, comm, wait, out):  # graph_trainer's joint graph: the backward's nodes say so
        node.meta["autograd_backward"] = True
    assert time_meter.instrument(graph, "ns") == 5
    kinds = [n.args[1] for n in graph.nodes if n.target is timing.tick]
    assert kinds == ["compute", "codec", "wait", "compute", None]
    order = [n for n in graph.nodes if n.op == "call_function"]
    assert order.index(wait) == order.index(comm) + 2  # a tick between the collective and its wait
    # one mark, right before the first backward node (for the trace; not a tick)
    marks = [i for i, n in enumerate(order) if n.target is timing.mark]
    assert [order[i].args for i in marks] == [("backward",)] and order[marks[0] + 1] is codec


def test_a_trace_records_each_tick_with_its_wall_time(monkeypatch, tmp_path):
    # GIFT_TIME_TRACE (read at import) names the file; benchmarks/link_trace.py lines the ticks up
    # with the link's counters, so each line is the wall clock (time.time) and the kind opened.
    import os
    import time

    monkeypatch.setattr(timing, "_TRACE", str(tmp_path / "ticks"))
    monkeypatch.setattr(timing, "_trace_file", None)
    before = time.time()
    t = timing.StepTimer()
    t.tick("compute")
    timing.mark("backward")  # a named point: written, and the segment goes on
    for kind in ("wait", None):  # the step's end flushes the file
        t.tick(kind)
    rows = [line.split() for line in (tmp_path / f"ticks.{os.getpid()}").read_text().splitlines()]
    assert [label for _, label in rows] == ["compute", "backward", "wait", "end"]
    times = [float(when) for when, _ in rows]
    assert before - 1e-3 <= times[0] <= times[1] <= times[2] <= times[3] <= time.time() + 1e-3
