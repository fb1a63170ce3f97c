"""Run functions on N local ranks (tests, benchmarks, examples).

Each rank is a ``spawn``-ed process joined over TCP on 127.0.0.1, with gloo (CPU) or, for
GPU benchmarks, NCCL (rank ``r`` on GPU ``r``). ``fn(rank, world, *args)`` runs with the
default process group initialized; whatever it returns (tensors, numbers, dicts of them)
comes back to the caller, one entry per rank, in rank order. An exception on any rank is
re-raised in the caller with that rank's traceback.

* :func:`run_on_ranks`: fresh processes for one function (what a new job sees: cold
  imports, empty caches).
* :class:`RankPool`: processes started once and reused for function after function, as
  torch's ``MultiProcContinuousTest`` does; a test module pays the start-up (importing
  torch, forming the group: seconds per rank) once instead of once per test. Each call runs
  with the compiler configs and environment it started with, and afterwards Dynamo is reset
  and the GIFT runtimes are forgotten, so no call sees another's compiled graphs or state;
  a failed call takes the pool down (its peers may be stuck in a collective) and the next
  call starts a fresh one.

A rank that dies (a crash in native code, a kill) fails the call within a second, with its
exit code, instead of leaving the caller waiting for the timeout.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gift_compile.runtime import forget_runtimes

BACKENDS = ("gloo", "nccl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    # Tensors sent through a multiprocessing queue travel as shared-memory handles that die
    # with the sending process; serialized bytes outlive it.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _join_group(rank: int, world: int, port: int, threads: int, backend: str) -> None:
    faulthandler.enable(all_threads=True)  # a crash in native code still prints every thread's Python stack
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # Inductor keeps its default compile threads: on 2 cores the suite's compiles overlap their
    # C++ builds and the rank pools' tests took 216 s with them, 235 s with one thread.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _run_isolated(fn: Callable, rank: int, world: int, args: tuple) -> Any:
    """``fn`` with the compiler configs and environment restored afterwards, Dynamo reset."""
    configs = [torch._dynamo.config, torch._inductor.config]
    saved = [config.get_config_copy() for config in configs]
    environ = dict(os.environ)
    try:
        return fn(rank, world, *args)
    finally:
        torch._dynamo.reset()
        forget_runtimes()
        for config, before in zip(configs, saved):
            now = config.get_config_copy()
            config.load_config({k: v for k, v in before.items() if now.get(k) != v})  # only what fn changed
        os.environ.clear()
        os.environ.update(environ)


def _exit_now(results) -> None:
    """End a worker once its results are flushed, without finalizing the interpreter: with torch
    imported that takes seconds per process, and a pool's ranks all end at the same time."""
    results.close()
    results.join_thread()
    os._exit(0)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results, threads: int, backend: str) -> None:
    try:
        _join_group(rank, world, port, threads, backend)
        try:
            results.put((rank, "ok", _to_bytes(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure, including KeyboardInterrupt-like exits
        results.put((rank, "error", traceback.format_exc()))
    _exit_now(results)


def _pool_worker(rank: int, world: int, port: int, tasks, results, threads: int, backend: str) -> None:
    try:
        _join_group(rank, world, port, threads, backend)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        _exit_now(results)
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, "ok", _to_bytes(_run_isolated(fn, rank, world, args))))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()
    _exit_now(results)


def _exit_description(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _collect(results, procs: list, timeout: float) -> tuple[dict[int, Any], list[str]]:
    """One result per rank of ``procs``; stops at the first error, a rank that died, or ``timeout``."""
    collected: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    dead_before: set[int] = set()
    while len(collected) < len(procs) and not errors:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = {r for r, p in enumerate(procs) if r not in collected and p.exitcode is not None}
            # Dead for a whole quiet second: a result it flushed just before exiting has arrived by now.
            if dead & dead_before:
                errors += [f"rank {r} died ({_exit_description(procs[r].exitcode)}) before returning a result" for r in sorted(dead)]
            elif time.monotonic() > deadline:
                errors.append(f"ranks {sorted(set(range(len(procs))) - set(collected))} returned nothing within {timeout:.0f} s")
            dead_before = dead
            continue
        if status == "error":
            # Peers of a failed rank would block in their next collective: stop now.
            errors.append(f"rank {rank} failed:\n{value}")
        else:
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)  # our own workers' results
    return collected, errors


def _check_backend(backend: str, world: int) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} NCCL ranks need {world} GPUs, this machine has {torch.cuda.device_count()}")


def run_on_ranks(
    fn: Callable[..., Any], world: int, *args: Any, threads: int = 1, timeout: float = 900, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh ranks; return the results in rank order."""
    _check_backend(backend, world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, threads, backend)) for r in range(world)]
    for p in procs:
        p.start()
    errors: list[str] = []
    try:
        collected, errors = _collect(results, procs, timeout)
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [collected[r] for r in range(world)]


class RankPool:
    """``world`` ranks kept alive between calls (module docstring)."""

    def __init__(self, world: int, *, threads: int = 1, backend: str = "gloo") -> None:
        _check_backend(backend, world)
        self.world, self.threads, self.backend = world, threads, backend
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_pool_worker, args=(r, self.world, port, self._tasks[r], self._results, self.threads, self.backend))
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 900) -> list[Any]:
        """Run ``fn(rank, world, *args)`` on every rank of the pool; results in rank order."""
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        try:
            collected, errors = _collect(self._results, self._procs, timeout)
        except BaseException:
            self.close(kill=True)
            raise
        if errors:
            self.close(kill=True)
            raise RuntimeError("\n".join(errors))
        return [collected[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for tasks in self._tasks if self._procs else []:
                tasks.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RankPool", "free_port", "run_on_ranks"]
