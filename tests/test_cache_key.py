"""The FX graph cache key covers every module of the package whose code reaches a compiled graph.

Inductor replays a cached graph without running the pass, so a module that the pass traces
into the graph (``layer_step``, ``comm``, ...) or that the graph calls at run time (``ops``,
``runtime``, ``state``, ...) must be hashed into ``GiftGraphPass.uuid()``: otherwise an upgrade
that changes it keeps replaying the old graph. The test watches which package files actually
run Python while a model is compiled and trained, and requires each of them in the key.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gift_compile import GiftConfig, gift_backend, replicate
from gift_compile.backend import _PASS_FILES
from models import MLP

PACKAGE = Path(__file__).resolve().parents[1] / "gift_compile"


def files_that_run(rank, world):
    ran = set()

    def watch(frame, event, arg):  # a global trace function: called at each Python call only
        if frame.f_code.co_filename.startswith(str(PACKAGE)):
            ran.add(frame.f_code.co_filename)
        # returns None: no line events in the frame. (A profile function, called at every C call
        # and return too, made this test ~20% slower: 77 s against 63 s on 2 cores.)

    torch.manual_seed(0)
    model = replicate(MLP())
    compiled = torch.compile(model, backend=gift_backend(GiftConfig(layers=("fc2",), low_rank=4, meter_interval=1)), fullgraph=True)
    sys.settrace(watch)
    try:
        for step in range(2):  # the first compiles (the pass traces layer_step), the second replays
            compiled(torch.randn(4, 16)).square().mean().backward()
    finally:
        sys.settrace(None)
    return sorted(ran)


def test_every_module_that_reaches_a_graph_is_in_the_cache_key(ranks):
    ran = {Path(f) for f in ranks(2).run(files_that_run)[0]}
    hashed = {Path(f) for f in _PASS_FILES}
    # replicate.py runs too, but as model code Dynamo traces into the graph it hands over (which
    # is itself part of the cache key); the pass's own modules must be in the pass's key.
    assert {PACKAGE / "layer_step.py", PACKAGE / "ops.py", PACKAGE / "comm.py", PACKAGE / "runtime.py"} <= ran
    assert ran - hashed <= {PACKAGE / "replicate.py"}, sorted(str(p.relative_to(PACKAGE)) for p in ran - hashed)
