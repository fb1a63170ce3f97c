"""torchtitan trainers with a ``gift`` config section.

- :class:`GiftGraphTrainer` (graph_trainer, SimpleFSDP, ``make_fx`` joint graph):
  ``[gift] enabled = true`` runs the ``gift`` pass pipeline on the joint graph.
- :class:`GiftTrainer` (the standard trainer: FSDP2 ``fully_shard`` + per-block compile):
  ``[gift] enabled = true`` gives every FSDP parameter group a GIFT reduce-scatter and every
  selected Linear layer a forward statistics hook (``gift_compile.fsdp``).

Both write ``gift_metrics.jsonl`` (loss, bytes, memory per logged step) to the dump folder.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch.distributed as dist
from torchtitan.experiments.graph_trainer.trainer import GraphTrainer
from torchtitan.trainer import Trainer

from gift_compile import timing
from gift_compile.passes.overlap import collectives_of
from gift_compile.titan_integration import cpu_support
from gift_compile.titan_integration.config import GiftSection
from gift_compile.titan_integration.graph_pass import register_pipeline
from gift_compile.titan_integration.session import NAMESPACE, GiftSession, record_metrics

register_pipeline()
log = logging.getLogger(__name__)


def _final_graph(trainer):
    """graph_trainer's final graph (after its passes); None on the standard trainer (no graph) or
    before the first step."""
    # graph_trainer's traced step is private (set at the first step): if a torchtitan release
    # renames it, the count is left out and the run goes on
    return getattr(getattr(getattr(trainer, "_traced_step", None), "gm", None), "graph", None)


def _wrap_loss_recording(trainer) -> None:
    """Disabled runs: still record loss and memory per logged step, and on graph_trainer the
    collectives per step under GIFT's metric name (for benchmarks: fp32 beside FP8 and GIFT)."""
    processor = trainer.metrics_processor
    original_log = processor.log
    original_validation = getattr(processor, "log_validation", None)
    folder = Path(trainer.config.dump_folder)
    counted: dict = {}  # final graph -> its collectives, counted as GIFT's pass counts its own: once

    def log_and_record(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        original_log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        graph = _final_graph(trainer)
        if graph is not None and graph not in counted:
            counted[graph] = len(collectives_of(graph))
        record_metrics(folder, step, loss=global_avg_loss, grad_norm=grad_norm,
                       **({} if graph is None else {"gift/collectives_per_step": counted[graph]}))

    processor.log = log_and_record
    if original_validation is not None:
        def log_validation(loss, step, extra_metrics=None):
            original_validation(loss, step, extra_metrics=extra_metrics)
            record_metrics(folder, step, validation_loss=loss)

        processor.log_validation = log_validation


class _GiftCounters:
    """Both trainers start a GIFT session when ``[gift] enabled`` and write GIFT's per-layer
    counters when they close."""

    gift_session: GiftSession | None

    def _start_gift(self, config) -> None:
        self.gift_session = GiftSession(self, config.gift, route=config.gift_route) if config.gift.enabled else None
        if self.gift_session is None:
            _wrap_loss_recording(self)

    def close(self) -> None:
        if self.gift_session is not None:
            from torchtitan.tools.logging import logger

            self.gift_session.write_counters()
            logger.info("[gift] per-layer counters (rank %d):\n%s", dist.get_rank() if dist.is_initialized() else 0, self.gift_session.summary())
        super().close()


class GiftGraphTrainer(_GiftCounters, GraphTrainer):
    """The ``layers = "auto"`` switch runs from graph_trainer's pre-step hook of the ``gift``
    pipeline (``graph_pass.before_train_step``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GraphTrainer.Config):
        gift_route: ClassVar[str] = "graph"
        gift: GiftSection = field(default_factory=GiftSection)
        """GIFT gradient communication (``--gift.<field>``, TOML ``[gift]``)."""

    def __init__(self, config: GiftGraphTrainer.Config) -> None:
        super().__init__(config)
        self._start_gift(config)


class _ShardOnlyDims:
    """``parallel_dims`` as the model's parallelize function sees it under GIFT with HSDP: no
    replicate dimension, so ``fully_shard`` shards over ``fsdp`` alone and GIFT's all-reduce
    hook reduces across the replicas (``gift_compile.fsdp``). Everything else is the real one."""

    dp_replicate_enabled = False

    def __init__(self, dims) -> None:
        self._dims = dims

    def __getattr__(self, name):
        return getattr(self._dims, name)


def _shard_only(parallelize_fn):
    @functools.wraps(parallelize_fn)
    def parallelize(model, *, parallel_dims, **kwargs):
        return parallelize_fn(model, parallel_dims=_ShardOnlyDims(parallel_dims), **kwargs)

    return parallelize


class GiftTrainer(_GiftCounters, Trainer):
    """HSDP (``data_parallel_replicate_degree > 1``) with ``[gift] enabled``: FSDP2 shards over
    ``fsdp`` and the replicate all-reduce is GIFT's, in FP8 (``gift_compile.fsdp``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        gift_route: ClassVar[str] = "fsdp2"
        gift: GiftSection = field(default_factory=GiftSection)
        """GIFT gradient communication (``--gift.<field>``, TOML ``[gift]``)."""

    def __init__(self, config: GiftTrainer.Config) -> None:
        if config.gift.enabled and config.parallelism.data_parallel_replicate_degree > 1:
            if config.parallelism.spmd_backend != "partial_dtensor":
                raise ValueError("[gift] with HSDP (parallelism.data_parallel_replicate_degree > 1) needs "
                                 f"parallelism.spmd_backend = 'partial_dtensor', got {config.parallelism.spmd_backend!r}")
            spec = config.model_spec
            config.model_spec = dataclasses.replace(spec, parallelize_fn=_shard_only(spec.parallelize_fn))
        super().__init__(config)
        # GIFT on or off alike (fp32 runs are the baseline GIFT is measured against)
        for part in self.model_parts:
            if units := cpu_support.overlap_fsdp_all_gathers(part):
                log.info("gift-titan: FSDP2 all-gathers asynchronous on gloo, forward prefetch chained over %d units", units)
        self._start_gift(config)

    def train_step(self, data_iterator):
        # The standard trainer has no pre-step hook: the ``layers = "auto"`` switch goes here.
        if self.gift_session is not None:
            self.gift_session.before_step(self.step)
        super().train_step(data_iterator)

    def forward_backward_step(self, **kwargs):
        # No graph of ours runs here: the time meter's step is opened and closed around the
        # forward-backward, as graph_trainer's joint graph is (timing.py).
        if self.gift_session is None:
            return super().forward_backward_step(**kwargs)
        with timing.timed_step(NAMESPACE, self.device):
            return super().forward_backward_step(**kwargs)


__all__ = ["GiftGraphTrainer", "GiftTrainer"]
