"""Run a function on N local ranks (tests, benchmarks, examples).

Each rank is a fresh ``spawn``-ed process joined over TCP on 127.0.0.1, with gloo (CPU) or,
for GPU benchmarks, NCCL (rank ``r`` on GPU ``r``). ``fn(rank, world, *args)`` runs with the
default process group initialized; whatever it returns (tensors, numbers, dicts of them)
comes back to the caller, one entry per rank, in rank order. An exception on any rank is
re-raised in the caller with that rank's traceback.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results, threads: int, backend: str) -> None:
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:  # few CPU cores: a compile-worker pool only adds start-up time
            os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            results.put((rank, "ok", _to_bytes(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure, including KeyboardInterrupt-like exits
        results.put((rank, "error", traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any], world: int, *args: Any, threads: int = 1, timeout: float = 900, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return the results in rank order."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} NCCL ranks need {world} GPUs, this machine has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, threads, backend)) for r in range(world)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                # Peers of a failed rank would block in their next collective: stop now.
                errors.append(f"rank {rank} failed:\n{value}")
                break
            else:
                collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [collected[r] for r in range(world)]
