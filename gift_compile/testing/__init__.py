"""Helpers for tests and benchmarks (not needed to use GIFT).

- ``ranks``       run a function on N local gloo (or NCCL) ranks, once or as a persistent pool
- ``text``        local text -> fixed-length token batches
- ``titan_jobs``  run a gift-titan job (checked here, torchrun in a subprocess) and read what it wrote
"""
