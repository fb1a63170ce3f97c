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


def test_the_cache_key_names_the_process_group_backend(tmp_path):
    # On gloo the pass traces all-gathers as all_to_alls and splits large messages
    # (collectives.all_gather, passes/pieces.py): a graph compiled under one backend must not be
    # replayed under another, so the same pass has another key on each.
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gift_compile.backend import GiftGraphPass

    graph_pass = GiftGraphPass(GiftConfig(layers=("fc2",)), "cache_key_backend", ("fc1", "fc2"), frozenset({"fc2"}))
    keys = {}
    for backend, store in (("gloo", dist.FileStore(str(tmp_path / "store"), 1)), ("fake", FakeStore())):
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            keys[backend] = (graph_pass.uuid(), graph_pass.uuid())
        finally:
            dist.destroy_process_group()
    assert keys["gloo"][0] == keys["gloo"][1] and keys["fake"][0] == keys["fake"][1]  # stable
    assert keys["gloo"][0] != keys["fake"][0]
