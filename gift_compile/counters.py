"""Per-layer counters of what GIFT did, and the table users read.

Everything a step reports stays on the device that computed it until someone asks
(``as_dict``): reading it back every step would make the host wait for the GPU once per
layer per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tabulate import tabulate

from gift_compile.comm import STATS

_ERROR, _PAYLOAD = STATS.index("error_sq"), STATS.index("payload_sq")
_SUMMED = [STATS.index(name) for name in ("saturated", "flushed", "residuals_dropped")]


@dataclass
class LayerCounters:
    """What one layer's gradient did, accumulated over steps (all per rank)."""

    path: str
    """``gift`` (whitened FP8) or the Euclidean wire: ``fp8``, ``fp8+ef``, ``bf16``, ``fp32``."""
    steps: int = 0
    bytes_sent: int = 0
    """Gradient payload bytes (plus scales) this rank sent, summed over steps."""
    stats_bytes: int = 0
    """Bytes of the current-step statistics all-reduce (whitened layers), summed over steps."""
    refreshes: int = 0
    last_refresh_step: int | None = None
    error_vs_fp8: float | None = None
    """The live meter's last reading (whitened layers, ``meter.py``): the error of the gradient
    GIFT delivered on its route over the error the same route's Euclidean wire would have
    delivered (same error-feedback setting), both against the ranks' exact average. Below 1:
    GIFT helps."""
    accumulated_vs_fp8: float | None = None
    """With error feedback: the same for the errors summed over the meter's window."""
    damping: float | None = None
    """With ``adaptive_damping``: the damping the layer's next step uses."""
    fallback_until: int | None = None
    """While set, the layer travels as Euclidean FP8 until this step (the meter said GIFT hurt)."""
    fallbacks: int = 0
    restarts_reported: int = 0
    """Restarts (see ``as_dict``'s ``restarts``) already logged."""
    # float64 sums over steps of every entry of ``stats`` (``comm.STATS``), and its last step's
    # values (the squared norms in the gradient's own coordinates are read from it), kept on the
    # device that computed them: two ops a step.
    _sums: torch.Tensor | None = field(default=None, repr=False)
    _last: torch.Tensor | None = field(default=None, repr=False)
    _restarts: torch.Tensor | None = field(default=None, repr=False)

    def add_restart(self, restarted: torch.Tensor) -> None:
        """Count a fresh start of the layer's geometry (a 0-d bool on the device, no sync)."""
        if self._restarts is None:
            self._restarts = torch.zeros((), dtype=torch.int64, device=restarted.device)
        self._restarts.add_(restarted)

    def add_step(self, stats: torch.Tensor, bytes_sent: int, stats_bytes: int = 0) -> None:
        """Count one step whose encoding reported ``stats`` (``comm.Reduction.stats``)."""
        stats = stats.detach()
        if self._sums is None:
            self._sums = torch.zeros(len(STATS), dtype=torch.float64, device=stats.device)
            self._last = torch.zeros_like(self._sums)
        self._sums.add_(stats)
        self._last.copy_(stats)  # a copy: the graph may reuse the stats buffer
        self.steps += 1
        self.bytes_sent += bytes_sent
        self.stats_bytes += stats_bytes

    def as_dict(self) -> dict:
        """Every counter, with the device-side ones read back once."""
        saturated = flushed = dropped = 0.0
        rel_error = None  # ||round-trip error|| / ||payload|| of the last step, in the gradient's coordinates
        if self._sums is not None:
            saturated, flushed, dropped = self._sums[_SUMMED].tolist()
            err_sq, payload_sq = self._last[[_ERROR, _PAYLOAD]].tolist()
            rel_error = (err_sq / payload_sq) ** 0.5 if payload_sq > 0 else 0.0
        return {
            "path": self.path, "steps": self.steps, "bytes_sent": self.bytes_sent, "stats_bytes": self.stats_bytes,
            "saturated": int(saturated), "flushed": int(flushed), "refreshes": self.refreshes,
            "last_refresh_step": self.last_refresh_step, "last_rel_error": rel_error,
            "error_vs_fp8": self.error_vs_fp8,
            "accumulated_vs_fp8": self.accumulated_vs_fp8, "damping": self.damping, "fallback_until": self.fallback_until, "fallbacks": self.fallbacks,
            "restarts": 0 if self._restarts is None else int(self._restarts),
            "residuals_dropped": int(dropped),
        }

    @property
    def saturated(self) -> int:
        """Elements that hit the FP8 format's largest magnitude."""
        return self.as_dict()["saturated"]

    @property
    def flushed(self) -> int:
        """Nonzero elements that became zero on the wire."""
        return self.as_dict()["flushed"]

    @property
    def residuals_dropped(self) -> int:
        """Error-feedback residuals the residual guard did not send (``comm.keeps_residual``)."""
        return self.as_dict()["residuals_dropped"]

    @property
    def last_rel_error(self) -> float | None:
        return self.as_dict()["last_rel_error"]


def counters_table(counters: dict[str, LayerCounters]) -> str:
    """One row per layer: path, steps, bytes, FP8 boundary hits, error, meter, fallback."""
    rows = []
    for fqn, c in sorted(counters.items()):
        d = c.as_dict()
        path = d["path"] if d["fallback_until"] is None else f"{d['path']} (Euclidean until step {d['fallback_until']})"
        rows.append((
            fqn, path, d["steps"], d["bytes_sent"], d["stats_bytes"], d["saturated"], d["flushed"],
            _fmt(d["last_rel_error"], ".3e"), _fmt(d["error_vs_fp8"], ".2f"), _fmt(d["accumulated_vs_fp8"], ".2f"), _fmt(d["damping"], ".3g"),
            d["fallbacks"], d["restarts"], d["residuals_dropped"],
        ))
    headers = ["layer", "path", "steps", "bytes sent", "stats bytes", "saturated", "flushed",
               "last rel. error", "error vs fp8", "accumulated vs fp8", "damping", "fallbacks", "restarts", "residuals dropped"]
    return tabulate(rows, headers=headers)


def _fmt(value: float | None, spec: str) -> str | None:
    return None if value is None else format(value, spec)


__all__ = ["LayerCounters", "counters_table"]
