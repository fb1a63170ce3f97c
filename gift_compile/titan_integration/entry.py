"""Per-rank entry point that torchrun starts (``python -m gift_compile.titan_integration.entry``).

Applies the CPU/gloo shims whose conditions hold (none on a CUDA machine), registers the local
datasets and the ``gift`` pass pipeline, then hands the command line to torchtitan's own
``main()`` (``--module gift_compile.titan_integration.job_configs --config <name> --section.field ...``).
"""

from __future__ import annotations


def main() -> None:
    from gift_compile.titan_integration.cpu_support import apply_cpu_support

    apply_cpu_support()
    from gift_compile.titan_integration.datasets import register_datasets
    from gift_compile.titan_integration.graph_pass import register_pipeline

    register_datasets()
    register_pipeline()
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
