"""GIFT inside one torchtitan run: runtime, layer selection, ``auto`` profiling, metrics.

A :class:`GiftSession` is created by the trainer when ``[gift] enabled = true``. It

- registers the GIFT runtime (state + counters, reached by the ``gift::`` custom ops) under
  :data:`NAMESPACE` and puts its state into the checkpointer (``states["gift"]``);
- resolves ``layers`` patterns against the model's ``nn.Linear`` FQNs (``select_layers``) and
  creates those layers' state, so a checkpoint can be loaded before the first step;
- with ``layers = "auto"``: the first ``auto_profile_steps`` steps run every Linear weight
  gradient as Euclidean FP8; then it sums the boundary hits over ranks, chooses the layers
  (``autoselect``), writes them to ``<dump_folder>/<layers_file>``, resets the counters and
  drops the traced graph so graph_trainer retraces it with the chosen layers whitened;
- adds GIFT metrics to every torchtitan log line (console, TensorBoard/W&B) and appends one
  JSON record per logged step to ``<dump_folder>/gift_metrics.jsonl`` (rank 0).
"""

from __future__ import annotations

import functools
import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gift_compile import fsdp, timing
from gift_compile.collectives import (
    PROBE_BYTES, WireFormat, bytes_sent, match_statistics_timeouts, parameter_piece_kib_for, separate_statistics_group,
)
from gift_compile.config import GiftConfig
from gift_compile.runtime import GiftRuntime, register_runtime
from gift_compile.selection import linear_weight_shapes, select_layers
from gift_compile.titan_integration import autoselect
from gift_compile.titan_integration.checkpoint import KEY, GiftCheckpointState, explain_failed_loads
from gift_compile.titan_integration.config import GiftSection, check_route, to_gift_config
from gift_compile.titan_integration.graph_pass import (
    NAMESPACE, PIPELINE_NAME, GraphAccounting, PassContext, disable_incompatible_passes, get_pass_context, set_pass_context,
)

log = logging.getLogger(__name__)

METRICS_FILE = "gift_metrics.jsonl"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def data_parallel_groups(dims) -> list[dist.ProcessGroup]:
    """This rank's groups of the data-parallel mesh dimensions gradients are reduced over, in a
    fixed order (every rank creates the same groups after them)."""
    meshes = (dims.get_optional_mesh(name) for name in ("dp_replicate", "fsdp"))
    return [mesh.get_group() for mesh in meshes if mesh is not None]


def statistics_follow_pg_timeouts() -> None:
    """After torchtitan sets its process groups' timeouts (``set_pg_timeouts``, after the first
    step), give the statistics groups theirs (``collectives.match_statistics_timeouts``)."""
    import torchtitan.distributed.utils as dist_utils

    set_pg_timeouts = dist_utils.set_pg_timeouts
    if getattr(set_pg_timeouts, "gift_statistics", False):
        return

    @functools.wraps(set_pg_timeouts)
    def then_statistics(*args, **kwargs):
        set_pg_timeouts(*args, **kwargs)
        match_statistics_timeouts()

    then_statistics.gift_statistics = True
    dist_utils.set_pg_timeouts = then_statistics


def resolve_parameter_pieces(config: GiftConfig, dims, route: str) -> GiftConfig:
    """``parameter_piece_kib = "auto"`` made a number on every rank alike: graph_trainer's FSDP
    group on gloo is probed (``collectives.parameter_piece_kib_for``); elsewhere nothing is split."""
    if config.parameter_piece_kib != "auto":
        return config
    fsdp = dims.get_optional_mesh("fsdp") if route == "graph" else None
    kib, rate = parameter_piece_kib_for(fsdp.get_group()) if fsdp is not None else (0, None)
    if rate is not None:
        log.info("GIFT: one %g MiB all_to_all on the FSDP group moved at %.0f Mbit/s per direction: parameter all-gathers %s "
                 "(parameter_piece_kib = \"auto\")", PROBE_BYTES / 2**20, rate, f"in {kib} KiB pieces" if kib else "in one call each")
    return config.replace(parameter_piece_kib=kib)


class GraphRoute:
    """graph_trainer: the ``gift`` pass pipeline rewrites the joint graph's collectives."""

    def __init__(self, trainer, section: GiftSection) -> None:
        self.trainer, self.compile_codec = trainer, section.compile_codec
        compile_config = trainer.config.compile
        if getattr(compile_config, "pass_pipeline", None) != PIPELINE_NAME or not compile_config.enable:
            raise ValueError(
                f"[gift] enabled = true needs graph_trainer's joint-graph pass: set [compile] enable = true, "
                f"mode = \"aot_fx_trace\" and pass_pipeline = \"{PIPELINE_NAME}\" (got enable={compile_config.enable}, "
                f"pass_pipeline={getattr(compile_config, 'pass_pipeline', None)!r})"
            )
        disabled = disable_incompatible_passes(compile_config)
        if disabled:
            log.info("GIFT: graph passes %s disabled (a CUDA graph would skip the gift:: ops' per-step Python)", disabled)

    def select(self, config: GiftConfig, chosen: list[str], *, retrace: bool, profiling: bool) -> None:
        # The profile's graph runs auto_profile_steps steps: compiling its codec regions (~75 s of
        # a 2-rank CPU debug job with a cold cache) costs far more than running them eagerly for
        # those steps, and changes no bit (regional Inductor keeps eager numerics).
        compile_codec = self.compile_codec and not profiling
        set_pass_context(PassContext(NAMESPACE, config, frozenset(chosen), compile_codec))
        if retrace:
            self.trainer._traced_step = None  # graph_trainer retraces and reruns the pass pipeline

    def accounting(self) -> GraphAccounting:
        return get_pass_context(NAMESPACE).accounting


class Fsdp2Route:
    """The standard trainer: FSDP2's reduce-scatter of each block is ``fsdp.GiftReduceScatter``."""

    def __init__(self, trainer, runtime: GiftRuntime, section: GiftSection) -> None:
        self.model = trainer.model_parts[0]
        dims = trainer.parallel_dims
        replicas = dims.get_mesh("dp_replicate").get_group() if dims.dp_replicate_enabled else None
        self.route = fsdp.install(self.model, runtime, NAMESPACE, replicate_group=replicas, compile_codec=section.compile_codec)
        self._accounting = self._count()

    def select(self, config: GiftConfig, chosen: list[str], *, retrace: bool, profiling: bool) -> None:
        # the profile's Euclidean codec graphs are the ones the unchosen layers use afterwards
        self.route.select(self.model, chosen, config)

    def _count(self) -> GraphAccounting:
        """What each parameter's reduce-scatter would send in fp32, and what stays dense (1-D)."""
        accounting = GraphAccounting(collectives=len(self.route.segments))
        fp32 = WireFormat("fp32")
        replicas = dist.get_world_size(self.route.replicate_group) if self.route.replicate_group is not None else 1
        for segment in self.route.segments:
            nbytes = bytes_sent(segment.shape, segment.world, fp32, "reduce_scatter")
            if replicas > 1:  # HSDP: then the shard's all-reduce across the replicas
                nbytes += bytes_sent((segment.shard_rows, segment.cols), replicas, fp32, "all_reduce")
            accounting.fp32_bytes += nbytes
            accounting.linear_fp32_bytes += nbytes if segment.layer is not None else 0
            if len(segment.shape) == 1:
                accounting.untouched_bytes += nbytes  # torchtitan reduces in fp32
            else:
                accounting.numel[segment.layer or segment.module] = int(torch.Size(segment.shape).numel())
                accounting.linear_candidates += [segment.layer] if segment.layer else []
        return accounting

    def accounting(self) -> GraphAccounting:
        return self._accounting


class GiftSession:
    def __init__(self, trainer, section: GiftSection, route: str = "graph") -> None:
        check_route(section, route)
        self.trainer = trainer
        self.section = section
        self.config = resolve_parameter_pieces(to_gift_config(section), trainer.parallel_dims, route)
        self.runtime: GiftRuntime = register_runtime(NAMESPACE, self.config)
        self.dump_folder = Path(trainer.config.dump_folder)
        self.shapes = linear_weight_shapes(trainer.model_parts[0])
        self.auto = self.config.layers == "auto"
        self.chosen: list[str] = [] if self.auto else select_layers(list(self.shapes), self.config.layers)
        self.profile_table: str | None = None
        self.switched_at: int | None = None
        if self.config.stats_group == "own":
            for group in data_parallel_groups(trainer.parallel_dims):
                separate_statistics_group(group)  # off FSDP's all-gather queue (collectives.py)
            statistics_follow_pg_timeouts()
        self.route = GraphRoute(trainer, section) if route == "graph" else Fsdp2Route(trainer, self.runtime, section)
        self._create_layer_states(self.chosen)
        self.route.select(self._wire_config(), self.chosen, retrace=False, profiling=self.profiling)
        if getattr(trainer.checkpointer, "enable", False):
            trainer.checkpointer.states[KEY] = GiftCheckpointState(self.runtime)
            explain_failed_loads(trainer.checkpointer, self.runtime)
        self._wrap_metrics(trainer.metrics_processor)
        log.info(
            "GIFT enabled (%s route%s): %s; layers %s", route, "" if section.compile_codec else ", eager codec", self.config,
            f"auto (profiling {self.config.auto_profile_steps} steps)" if self.auto else self.chosen,
        )

    # -- selection -------------------------------------------------------------------------
    @property
    def profiling(self) -> bool:
        return self.auto and self.switched_at is None

    def _wire_config(self) -> GiftConfig:
        if self.profiling:  # the paper profiles with Euclidean FP8, whatever euclidean_dtype says
            return self.config.replace(euclidean_dtype="fp8")
        return self.config

    def _create_layer_states(self, fqns: list[str]) -> None:
        for fqn in fqns:
            d_out, d_in = self.shapes[fqn]
            self.runtime.state.layer(fqn, d_out, d_in, self.trainer.device)

    def before_step(self, step: int) -> None:
        """Called at the start of every train step (``step`` is the 1-based step about to run)."""
        if self.profiling and step == self.config.auto_profile_steps + 1:
            self._switch_to_gift(step)

    def _switch_to_gift(self, step: int) -> None:
        numel = self.route.accounting().numel
        linear = {f: n for f, n in numel.items() if f in self.shapes}
        rates = autoselect.global_hit_counts(self.runtime.counters, linear, device=self.trainer.device)
        self.chosen = autoselect.choose_layers(rates, self.config.auto_max_layers)
        self.profile_table = self.runtime.table()
        self.switched_at = step
        text = autoselect.layers_toml(self.chosen, rates, self.config.auto_profile_steps)
        if rank() == 0:
            path = self.dump_folder / self.section.layers_file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            log.info("GIFT auto: wrote the chosen layers to %s", path)
        log.info("GIFT auto: profile after %d steps\n%s", self.config.auto_profile_steps, text)
        if not self.chosen:
            log.warning("GIFT auto: no Linear layer had an FP8 boundary hit; every layer stays Euclidean FP8")
        self._create_layer_states(self.chosen)
        self.runtime.counters.clear()
        self.route.select(self._wire_config(), self.chosen, retrace=True, profiling=self.profiling)

    # -- metrics ---------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        accounting = self.route.accounting()
        by_path = self.runtime.bytes_per_step()
        stats = by_path.pop("stats", 0.0)
        total = sum(by_path.values()) + accounting.untouched_bytes
        out: dict[str, Any] = {f"gift/bytes_per_step/{p}": v for p, v in sorted(by_path.items())}
        out["gift/bytes_per_step/unchanged"] = accounting.untouched_bytes
        out["gift/bytes_per_step"] = total
        out["gift/bytes_per_step_fp32"] = accounting.fp32_bytes
        out["gift/bytes_ratio_vs_fp32"] = total / accounting.fp32_bytes if accounting.fp32_bytes else None
        out["gift/stats_bytes_per_step"] = stats
        out["gift/total_bytes_ratio_vs_fp32"] = (total + stats) / accounting.fp32_bytes if accounting.fp32_bytes else None
        linear = set(accounting.linear_candidates)
        linear_bytes = accounting.untouched_linear_bytes + sum(
            c.bytes_sent / c.steps for key, c in self.runtime.counters.items() if c.steps and key.partition("@")[0].partition("#")[0] in linear)
        out["gift/linear_bytes_ratio_vs_fp32"] = linear_bytes / accounting.linear_fp32_bytes if accounting.linear_fp32_bytes else None
        out["gift/layers"] = len(self.chosen)
        out["gift/refreshes"] = sum(c.refreshes for c in self.runtime.counters.values())
        for name in ("error_vs_fp8", "accumulated_vs_fp8"):  # the live meter (meter.py)
            readings = [getattr(c, name) for c in self.runtime.counters.values() if getattr(c, name) is not None]
            out[f"gift/{name}"] = sum(readings) / len(readings) if readings else None
            out[f"gift/{name}_max"] = max(readings) if readings else None
        dampings = [c.damping for c in self.runtime.counters.values() if c.damping is not None]  # adaptive_damping
        out["gift/damping_min"], out["gift/damping_max"] = (min(dampings), max(dampings)) if dampings else (None, None)
        out["gift/fallback_layers"] = sum(c.fallback_until is not None for c in self.runtime.counters.values())
        out["gift/restarts"] = self.runtime.report_restarts()
        out["gift/residuals_dropped"] = sum(c.residuals_dropped for c in self.runtime.counters.values())
        out["gift/collectives_per_step"] = accounting.collective_calls or None
        out["gift/collectives_per_step_traced"] = accounting.collective_calls_traced or None
        seconds = timing.timer(NAMESPACE).take()
        if seconds["step"] > 0:  # the time meter (timing.py; CPU on the standard trainer): per step since the last log line
            out["gift/codec_s"], out["gift/comm_wait_s"], out["gift/compute_s"] = seconds["codec"], seconds["wait"], seconds["compute"]
            out["gift/comm_share"] = (seconds["codec"] + seconds["wait"]) / seconds["step"]
        out["gift/profiling"] = int(self.profiling)
        return out

    def _wrap_metrics(self, processor) -> None:
        session = self
        original_log = processor.log
        original_validation = getattr(processor, "log_validation", None)

        def log_with_gift(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            gift = session.metrics()
            original_log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics={**(extra_metrics or {}), **gift})
            if rank() == 0:  # torchtitan's console line has fixed fields: ours follow it, same names as the metrics
                logging.getLogger("torchtitan").info("[gift] step %d: %s", step, console_line(gift))
            session.record(step, loss=global_avg_loss, grad_norm=grad_norm, **gift)

        processor.log = log_with_gift
        if original_validation is not None:
            def log_validation_with_gift(loss, step, extra_metrics=None):
                original_validation(loss, step, extra_metrics=extra_metrics)
                session.record(step, validation_loss=loss)

            processor.log_validation = log_validation_with_gift

    def record(self, step: int, **values: Any) -> None:
        record_metrics(self.dump_folder, step, **values)

    def summary(self) -> str:
        """The per-layer counters table, and the time meter's line where it ran (timing.py)."""
        timed = timing.timer(NAMESPACE).summary()
        return self.runtime.table() + (f"\n{timed}" if timed else "")

    def write_counters(self) -> Path:
        """``<dump_folder>/gift_counters_rank<r>.json``: per-layer counters and a state fingerprint."""
        state = self.runtime.state
        residual = sum(float(l.residual.double().norm()) for l in state.layers.values() if l.residual is not None)
        payload = {
            "chosen": self.chosen,
            "switched_at": self.switched_at,
            "layers": {fqn: c.as_dict() for fqn, c in sorted(self.runtime.counters.items())},
            "state_checksum": float(state.checksum()),
            "residual_norm": residual,
            "state_steps": {l.fqn: int(l.step) for l in state.layers.values()},
        }
        self.dump_folder.mkdir(parents=True, exist_ok=True)
        path = self.dump_folder / f"gift_counters_rank{rank()}.json"
        path.write_text(json.dumps(payload, indent=1))
        return path


CONSOLE_METRICS = ("gift/bytes_ratio_vs_fp32", "gift/total_bytes_ratio_vs_fp32", "gift/bytes_per_step", "gift/stats_bytes_per_step",
                   "gift/layers", "gift/error_vs_fp8", "gift/error_vs_fp8_max", "gift/accumulated_vs_fp8_max", "gift/fallback_layers", "gift/restarts",
                   "gift/codec_s", "gift/comm_wait_s", "gift/comm_share")


def console_line(metrics: dict[str, Any]) -> str:
    """The metrics a console line shows, under the names TensorBoard, W&B and the JSONL file use."""
    def fmt(value):
        return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)

    return " ".join(f"{name}={fmt(metrics.get(name))}" for name in CONSOLE_METRICS)


_STARTED: set[Path] = set()  # folders this process has written to


def record_metrics(dump_folder: Path, step: int, **values: Any) -> None:
    """Append one JSON line to ``<dump_folder>/gift_metrics.jsonl`` (rank 0 only). The first
    record of a process drops what an earlier run wrote from this step on (a resume reruns it)."""
    if rank() != 0:
        return
    path = dump_folder / METRICS_FILE
    if dump_folder not in _STARTED:
        _STARTED.add(dump_folder)
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
            path.write_text("".join(line + "\n" for line in kept))
    values = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
    values["step"] = step
    values["time"] = time.time()
    values["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.cuda.is_available():
        values["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    dump_folder.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(values) + "\n")


__all__ = ["METRICS_FILE", "NAMESPACE", "GiftSession", "record_metrics"]
