"""How each gradient travels: the one rule every route acts on.

The compiler pass (``passes/gift_collectives.py``, also graph_trainer's joint graph), FSDP2's
reduce-scatter and replica all-reduce (``fsdp.py``), the eager reference (``reference.py``)
and the byte accounting all ask :func:`plan` and act on the :class:`Plan` it returns; none of
them decides a wire, a residual or a counter row on its own.

The rule, by kind of parameter:

* ``linear`` (an ``nn.Linear`` weight): whitened when selected (``gift``, on ``gift_dtype``,
  with a residual under ``error_feedback``); otherwise on ``euclidean_dtype``, with a residual
  (``euclidean+ef``) when that wire is quantized and ``euclidean_error_feedback`` is on;
* ``matrix`` (another 2-D gradient, such as the token embedding): ``embedding_dtype``, no state;
* ``vector`` (1-D and anything else: biases, norms): unchanged, in the collective's own dtype.

On the all-reduce route the owner of each reduced shard re-encodes it on the same wire
(``all_gather_dtype = "wire"``, with a residual of its own when the plan keeps one) or sends it
in bf16. HSDP's replica all-reduce (``replicas=True``), which follows FSDP's reduce-scatter,
keeps no state: every quantized plan travels there stateless, on its own wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gift_compile.collectives import WireFormat, bytes_sent
from gift_compile.config import GiftConfig

ParamKind = Literal["linear", "matrix", "vector"]
PlanKind = Literal["gift", "euclidean+ef", "euclidean", "unchanged"]


@dataclass(frozen=True)
class Plan:
    """How one gradient travels (fixed when a graph is traced or a route installed)."""

    kind: PlanKind
    """``gift`` (whitened), ``euclidean+ef`` (unwhitened, with a residual), ``euclidean``
    (stateless on ``wire``) or ``unchanged`` (the collective's own dtype)."""
    wire: WireFormat | None
    """The wire (None: unchanged)."""
    error_feedback: bool = False
    """The sender keeps a residual (``gift`` and ``euclidean+ef``)."""
    gather_error_feedback: bool = False
    """All-reduce route: the owner of each reduced shard keeps a residual for its re-encoding."""
    gather_dtype: str = "wire"
    """All-reduce route: ``wire`` (re-encode the reduced shard) or ``bf16``."""

    @property
    def whitened(self) -> bool:
        return self.kind == "gift"

    @property
    def stateful(self) -> bool:
        """Has per-layer state (a residual or a basis): travels through ``layer_step``."""
        return self.kind in ("gift", "euclidean+ef")

    @property
    def path(self) -> str:
        """The counters row's path: ``gift``, ``<dtype>+ef`` or the wire's dtype."""
        if self.kind == "gift":
            return "gift" if self.wire.dtype == "fp8" else f"gift-{self.wire.dtype}"
        return {"euclidean+ef": f"{self.wire.dtype}+ef", "euclidean": self.wire.dtype}.get(self.kind, "unchanged")

    def bytes_sent(self, shape: tuple[int, ...], world: int, collective: str) -> int:
        """Bytes one rank sends for this gradient (``shape``: what it reduces) on ``collective``."""
        return bytes_sent(shape, world, self.wire, collective, self.gather_dtype)

    def describe(self, shape: tuple[int, ...], collective: str, op: str, world: int) -> str:
        """This rank's entry of the ranks' agreement (agreement.py)."""
        return f"{self.kind} {self.wire.dtype if self.wire else '-'} {collective}({op}) {list(shape)} x{world}"


UNCHANGED = Plan("unchanged", None)


def plan(config: GiftConfig, kind: ParamKind, *, selected: bool = False, collective: str = "reduce_scatter",
         replicas: bool = False) -> Plan:
    """The :class:`Plan` of one gradient (module docstring). ``selected``: a ``linear`` layer the
    config whitens (``layers`` resolved against the model); ``replicas``: HSDP's replica all-reduce."""
    if not config.enabled or kind == "vector":
        return UNCHANGED
    gather = config.all_gather_dtype if collective == "all_reduce" else "wire"
    if kind == "matrix":
        return Plan("euclidean", WireFormat.of(config.embedding_dtype, config), gather_dtype=gather)
    if selected:
        wire, kind_, residual = WireFormat.gift(config), "gift", config.error_feedback
    else:
        wire = WireFormat.euclidean(config)
        residual = wire.quantized and config.euclidean_error_feedback
        kind_ = "euclidean+ef" if residual else "euclidean"
    if replicas:  # after FSDP's reduce-scatter: each shard, stateless, on its wire
        return Plan("euclidean", wire, gather_dtype=gather)
    return Plan(kind_, wire, residual, residual and collective == "all_reduce" and gather == "wire", gather)


__all__ = ["Plan", "ParamKind", "UNCHANGED", "plan"]
