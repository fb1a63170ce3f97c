"""Per-rank entry point that torchrun starts (``python -m gift_compile.titan_integration.entry``).

Applies the CPU/gloo shims whose conditions hold (none on a CUDA machine), registers the local
datasets and the ``gift`` pass pipeline, then hands the command line to torchtitan's own
``main()`` (``--module gift_compile.titan_integration.job_configs --config <name> --section.field ...``).

A rank whose training ended normally exits without finalizing the interpreter (:func:`exit_now`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def main() -> None:
    from gift_compile.titan_integration.cpu_support import apply_cpu_support

    apply_cpu_support()
    from gift_compile.titan_integration.datasets import register_datasets
    from gift_compile.titan_integration.graph_pass import register_pipeline

    register_datasets()
    register_pipeline()
    from torchtitan.train import main as titan_main

    titan_main()
    exit_now()


def exit_now(code: int = 0) -> NoReturn:
    """End this process once its logs are flushed, skipping the interpreter's teardown: a rank
    whose job is done (torchtitan has closed the trainer, its checkpointer and metric writers,
    and destroyed the process group; its last checkpoint is saved synchronously, after any
    asynchronous save has finished), and ``gift-titan`` once torchrun has returned. That
    teardown runs C++ destructors after the process group is gone, and now and then one aborts
    ("terminate called without an active exception", seen in a one-rank-per-node job with GIFT
    off): the rank's exit code then fails a finished job, and the other nodes' torchrun waits
    300 s at its exit barrier. It also costs ~2 s per process with torch imported (on CPU).
    Inductor's compile workers (a pool, on GPU machines; none unless Inductor was imported) are
    stopped as that teardown would."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.shutdown_compile_workers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

if __name__ == "__main__":
    main()
