"""The rank pool that the multi-process tests share (``gift_compile.testing.ranks.RankPool``).

A rank that crashes in native code (glibc aborting on a corrupted heap, say) never reports
back; the pool must say so at once, not leave the suite waiting for its 15-minute timeout.
"""

import os
import time

import pytest


def rank_and_world(rank, world):
    return rank, world


def abort(rank, world):
    os.abort()  # what glibc does on a corrupted heap: SIGABRT, no Python traceback


def test_a_crashed_rank_fails_the_call_at_once_and_the_next_call_gets_a_fresh_pool(ranks):
    pool = ranks(1)  # the session's pool: the crash takes it down, the next call restarts it
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 died \(killed by SIGABRT\)"):
        pool.run(abort, timeout=600)
    assert time.monotonic() - start < 60  # seconds of start-up and polling, not the timeout
    assert pool.run(rank_and_world) == [(0, 1)]
