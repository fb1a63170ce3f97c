"""GIFT in torchtitan 0.3.0 (graph_trainer and standard FSDP2 trainer); see the torchtitan section of README.md.

Nothing is imported or patched here: importing ``gift_compile`` never touches torchtitan.

- ``cpu_support``  CPU/gloo shims, each guarded by its condition, applied by ``entry``
- ``config``       the ``[gift]`` / ``--gift.<field>`` trainer section and its GiftConfig
- ``graph_pass``   the ``gift`` pass pipeline on graph_trainer's joint graph
- ``session``      runtime, layer selection, ``layers = "auto"`` profiling, metrics
- ``autoselect``   boundary-hit rates -> chosen layers
- ``checkpoint``   GIFT state as a DCP stateful (``states["gift"]``)
- ``trainer``      GiftGraphTrainer (graph_trainer) and GiftTrainer (standard FSDP2/HSDP, via ``gift_compile.fsdp``)
- ``job_configs``  config registry: llama3_debug, llama3_debug_standard, llama3_8b
- ``datasets``     local datasets and the bundled corpus / default tokenizer
- ``launcher``     ``gift-titan job.toml``: TOML front-end and torchrun
- ``entry``        per-rank entry point started by torchrun
"""
