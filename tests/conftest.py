"""Test-wide setup: benchmark modules (the fidelity harness) are importable by name."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import pytest  # noqa: E402

from gift_compile.testing.ranks import RankPool  # noqa: E402


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
