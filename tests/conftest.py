"""Test-wide setup: benchmark modules (the fidelity harness) are importable by name, and the
session compiles into its own Inductor cache."""

import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import pytest  # noqa: E402

from gift_compile.testing.ranks import RankPool  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def private_inductor_cache(tmp_path_factory):
    """An Inductor cache no other process writes: benchmarks or another test run on the same
    machine share the default one, and a test once failed reading an entry being written.
    Set before any rank pool or gift-titan job starts, so they inherit it."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor_cache"))
    yield
    if previous is None:
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world)``: a pool of ``world`` gloo ranks shared by every test of the session
    (started on first use); ``ranks(world).run(fn, *args)`` runs ``fn(rank, world, *args)``."""
    pools: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in pools:
            pools[world] = RankPool(world)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close()
