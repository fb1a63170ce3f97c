"""Per-layer GIFT state: subspace basis or factors, error-feedback residuals, step counter, fallback.

All of it lives in buffers of an ``nn.Module``, so ``state_dict()`` checkpoints it and
``load_state_dict()`` restores it exactly. The compiled path reaches it at run time through
opaque custom ops keyed by the layer's FQN (``ops.py``, docs/design.md §5), never as graph constants: factors
change every step, and Inductor's FX graph cache replays a graph without re-running the pass.

What a layer keeps depends on ``GiftConfig`` and on whether the layer is whitened:

* ``factor_source = "current_step"``: ``basis``, the ``d_in x r`` subspace the next step's
  Rayleigh-Ritz starts from (``geometry.whitening_from_sketch``).
* ``factor_source = "periodic"``: ``moment`` (the EMA of ``A``) and the factor tensors
  (``factor_<name>``), recomputed every ``refresh_interval`` steps by :meth:`refresh`: ``A`` is
  all-reduced over the group, factorized, and rank 0's factors are broadcast, so every rank
  whitens with bit-identical ``T``.
* ``residual``: the sender's error-feedback residual, in the gradient's own coordinates (so it
  needs no "move" when ``T`` changes); ``gather_residual``: the owner's residual of the
  all-reduce route's second quantization (its shard's rows), created on first use.
* ``fallback_until`` / ``meter_over``: the live fidelity meter's verdict (``meter.py``, :meth:`record_reading`).
"""

from __future__ import annotations

import functools
import json
import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from gift_compile.collectives import resolve_group
from gift_compile.config import MAX_INT, GiftConfig
from gift_compile.geometry import FACTOR_NAMES, Whitening, factorize, identity_whitening, initial_basis, second_moment
from gift_compile.meter import DeliveredMeter, Reading

log = logging.getLogger(__name__)

# Host-side bookkeeping: Python reads these every step (is a refresh due? is the layer on its
# fallback? its damping?), which must never wait for a GPU. Everything else lives on the gradient's device.
HOST_BUFFERS = ("shape", "step", "refreshes", "fallback_until", "meter_over", "fallbacks_in_a_row", "shadow_verdict",
                "damping_exponent", "damping_direction", "last_verdict")

RETRY_DOUBLINGS = 6
"""A layer whose retry falls back again waits twice as long each time, up to ``2^6`` times ``fallback_retry``."""

DAMPING_OCTAVES = 7
"""``adaptive_damping``: a layer's damping stays within ``2^-7`` to ``2^7`` times ``config.damping``."""

FAR_OVER = 2.0
"""A reading above this falls back at once, without ``fallback_patience``: patience guards
against the meter's noise (a few percent: the sketch's spread), and GIFT delivering twice FP8's
error is not noise. It is what a layer whose error feedback diverges reads (its residual,
carried into the next step's coordinates, grown faster than the wire's rounding shrinks it):
there every step of patience multiplies the error."""


@functools.lru_cache(maxsize=64)
def _fresh(key: tuple, device: torch.device) -> torch.Tensor:
    """A fresh start's basis or factor tensor, built once per shape and device (read-only use)."""
    if key[0] == "basis":
        return initial_basis(key[1], key[2]).to(device)
    layout, dim, rank, name = key
    return identity_whitening(layout, dim, rank).tensors[name].to(device)


NO_VERDICT = -1.0
"""``shadow_verdict`` before the fallback's first reading (a verdict is a ratio of norms, >= 0)."""

ADAPTIVE_DAMPING_START = {
    "damping_exponent": torch.zeros((), dtype=torch.int64),
    "damping_direction": torch.full((), -1, dtype=torch.int64),  # first try stronger whitening
    "last_verdict": torch.full((), -1.0, dtype=torch.float64),  # no reading yet
}
"""A current-step layer's damping controller before its first reading (``adapt_damping``)."""


def state_key(fqn: str) -> str:
    """Module names may not contain dots; FQNs do."""
    return fqn.replace(".", "/")


class GiftLayerState(nn.Module):
    def __init__(
        self, fqn: str, d_out: int, d_in: int, config: GiftConfig, *, whitened: bool = True, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.fqn, self.d_out, self.d_in, self.config, self.whitened = fqn, d_out, d_in, config, whitened
        self.device = torch.device("cpu") if device is None else device
        self.low_rank = config.factor_rank(d_in)
        self.current_step = whitened and config.factor_source == "current_step"
        if self.current_step:
            self.register_buffer("basis", initial_basis(d_in, self.low_rank).to(self.device))
            self.register_buffer("sketch_scale", torch.ones((), device=self.device))  # geometry.input_sketch's s
            for name, value in ADAPTIVE_DAMPING_START.items():  # damping = config.damping * 2^exponent
                self.register_buffer(name, value.clone())
        elif whitened:
            self.register_buffer("moment", torch.zeros(d_in, d_in, device=self.device))
            for name, tensor in identity_whitening(config.whitening_layout, d_in, self.low_rank).tensors.items():
                self.register_buffer(f"factor_{name}", tensor.to(self.device))
        keeps_residual = config.error_feedback if whitened else config.euclidean_error_feedback
        self.register_buffer("residual", torch.zeros(d_out, d_in, device=self.device) if keeps_residual else None)
        self.register_buffer("gather_residual", None)  # all-reduce route: created with its shard shape
        self.register_buffer("shape", torch.tensor([d_out, d_in, int(whitened)]))  # lets a checkpoint rebuild the layer
        for name in ("step", "refreshes", "fallback_until", "meter_over", "fallbacks_in_a_row"):
            self.register_buffer(name, torch.zeros((), dtype=torch.int64))
        self.meter = DeliveredMeter(fqn, d_out, d_in, config) if whitened else None
        # On the fallback: the GIFT shadow's latest verdict (meter.py), which gates the retry;
        # checkpointed, so a run restored on its fallback decides its retry as the run it continues.
        self.register_buffer("shadow_verdict", torch.full((), NO_VERDICT, dtype=torch.float64) if whitened else None)
        self._refresh_start: tuple[int, torch.Tensor, int] | None = None  # (step, moment, refreshes) of a refresh

    # -- placement -----------------------------------------------------------------------------
    def place_on(self, device: torch.device) -> None:
        """Move the tensors the gradient meets (basis/factors, residuals) to its device.

        A layer created before its first gradient (a checkpoint load, a torchtitan session)
        may sit elsewhere; the refresh collectives then also run on ``device``, where the
        gradient's process group expects its tensors (NCCL: CUDA).
        """
        if device != self.device:
            self.to(device)
            self.device = device

    def _apply(self, fn, recurse=True):
        # What Module.to(device) and friends call: every buffer moves but the host bookkeeping.
        host = {name: self._buffers[name] for name in HOST_BUFFERS if name in self._buffers}
        super()._apply(fn, recurse)
        self._buffers.update(host)
        moved = [b for name, b in self._buffers.items() if b is not None and name not in HOST_BUFFERS]
        if moved:
            self.device = moved[0].device
        return self

    # -- what a step reads -----------------------------------------------------------------------
    def whitening(self) -> Whitening:
        """The periodic factors (``factor_source = "periodic"``)."""
        return Whitening(self.config.whitening_layout, {name: getattr(self, f"factor_{name}") for name in FACTOR_NAMES[self.config.whitening_layout]})

    def factor_tensors(self) -> list[torch.Tensor]:
        return list(self.whitening().tensors.values())

    def geometry_tensors(self) -> list[torch.Tensor]:
        """What a whitened layer's ``T`` is built from: its basis (current step) or its factors."""
        if not self.whitened:
            return []
        return [self.basis] if self.current_step else self.factor_tensors()

    @property
    def damping(self) -> float:
        """The damping this layer's factors use (``adaptive_damping`` moves a current-step layer's)."""
        if not self.current_step:
            return self.config.damping
        return self.config.damping * 2.0 ** int(self.damping_exponent)

    def damping_tensor(self) -> torch.Tensor:
        """:attr:`damping` as a 0-d tensor beside the basis, for ``geometry.whitening_from_sketch``."""
        return torch.full((), self.damping, device=self.basis.device)

    def fresh_geometry(self) -> list[torch.Tensor]:
        """:meth:`geometry_tensors` of a layer that never ran a step (the same on every rank)."""
        if self.current_step:
            return [_fresh(("basis", self.d_in, self.low_rank), self.device)]
        return [_fresh((self.config.whitening_layout, self.d_in, self.low_rank, name), self.device)
                for name in FACTOR_NAMES[self.config.whitening_layout]]

    @torch.no_grad()
    def restart_if_not_finite(self) -> torch.Tensor:
        """A basis or factor that is not finite (a state corrupted in memory; a checkpoint is
        checked when loaded) would fail LAPACK at every later step: it is replaced by a fresh
        start, with no host sync. Returns a 0-d bool on the device: whether it was (counted)."""
        tensors = self.geometry_tensors()
        # A NaN or Inf anywhere reaches a float64 sum; finite fp32 values cannot overflow one.
        first, *rest = (t.sum(dtype=torch.float64) for t in tensors)
        broken = ~sum(rest, start=first).isfinite()
        for tensor, fresh in zip(tensors, self.fresh_geometry()):
            torch.where(broken, fresh, tensor, out=tensor)
        if self.current_step:
            self.sketch_scale.masked_fill_(broken, 1.0)
        return broken

    def whitening_on(self) -> bool:
        """False while the layer is on its Euclidean fallback (a host-side check, no sync)."""
        return self.whitened and int(self.step) >= int(self.fallback_until)

    def ensure_gather_residual(self, rows: int, cols: int) -> torch.Tensor:
        if self.gather_residual is None or tuple(self.gather_residual.shape) != (rows, cols):
            if self.gather_residual is not None:
                raise ValueError(
                    f"GIFT layer {self.fqn!r}: the all-gather residual was kept for a ({tuple(self.gather_residual.shape)}) "
                    f"shard, this step reduces ({rows}, {cols}) shards: the data-parallel size changed"
                )
            self.gather_residual = torch.zeros(rows, cols, device=self.device)
        return self.gather_residual

    # -- a step ----------------------------------------------------------------------------------
    def begin_step(self, layer_input: torch.Tensor, group=None) -> bool:
        """Before this step's gradient is sent: refresh periodic factors when due. Returns
        whether the layer whitens this step (False on its fallback). (That every rank sends the
        same layers and shapes was checked before: agreement.py.)"""
        if self.whitened and not self.current_step and int(self.step) % self.config.refresh_interval == 0:
            self.refresh(layer_input, group)
        return self.whitening_on()

    def retry_due_at_this_steps_end(self) -> bool:
        """Whether :meth:`end_step` decides a retry this step: it reads this step's reading."""
        return self.whitened and int(self.step) + 1 == int(self.fallback_until)

    def _fall_back(self, from_step: int) -> None:
        """Euclidean from ``from_step`` for ``fallback_retry`` steps, times 2 per failed retry
        before this one (up to ``2^RETRY_DOUBLINGS``); this fallback counts as one more."""
        wait = self.config.fallback_retry * 2 ** min(int(self.fallbacks_in_a_row), RETRY_DOUBLINGS)
        self.fallback_until.fill_(from_step + wait)
        self.fallbacks_in_a_row.add_(1)

    def _retry_or_wait(self) -> None:
        """Before a retry's step: when GIFT's shadow read above 1 at its last reading on the
        fallback, the retry fails without a whitened step (the wait doubles, as after a retry that
        fell back)."""
        verdict = float(self.shadow_verdict)
        self.shadow_verdict.fill_(NO_VERDICT)
        if verdict <= 1.0:  # GIFT's shadow wins, or has not read yet
            return
        self._fall_back(from_step=int(self.step))
        log.warning("GIFT layer %s: its GIFT shadow read %.2fx the Euclidean route's on the fallback; retry skipped, "
                    "Euclidean until step %d", self.fqn, verdict, int(self.fallback_until))

    @torch.no_grad()
    def end_step(
        self, residual: torch.Tensor | None, gather_residual: torch.Tensor | None, next_basis: torch.Tensor | None,
        next_scale: torch.Tensor | None = None,
    ) -> None:
        """After the reduction: keep the new residuals, basis and sketch scale, count the step."""
        self._keep("residual", residual)
        self._keep("gather_residual", gather_residual)
        if next_basis is not None:
            self.basis.copy_(next_basis)
        if next_scale is not None:
            self.sketch_scale.copy_(next_scale)
        self._refresh_start = None
        self.step += 1
        if self.whitened and int(self.step) == int(self.fallback_until):
            self._retry_or_wait()

    def _keep(self, name: str, new: torch.Tensor | None) -> None:
        current = getattr(self, name)
        if current is None or new is None:
            return
        if new.shape != current.shape or new.dtype != current.dtype:
            raise ValueError(f"GIFT layer {self.fqn!r}: new {name} {tuple(new.shape)} {new.dtype} "
                             f"does not match the state's {tuple(current.shape)} {current.dtype}")
        if new.is_contiguous() and new.untyped_storage().nbytes() == current.untyped_storage().nbytes():
            setattr(self, name, new.detach())  # adopt it: a copy is a full pass over the tensor
        else:
            current.copy_(new)  # a view into a larger buffer would pin that buffer

    # -- the live meter and the fallback -----------------------------------------------------------
    def record_reading(self, reading: Reading, step: int | None = None) -> None:
        """Count a meter reading taken at ``step`` (default: this one; the same on every rank:
        ``meter.py``), before the step after it begins. With ``adaptive_damping``
        it moves the damping (:meth:`adapt_damping`). A layer whose delivered error is above
        Euclidean's (one step, or accumulated with error feedback) for ``fallback_patience``
        readings in a row, or more than ``FAR_OVER`` times it in one reading, goes on its fallback
        for ``fallback_retry`` steps. A retried layer is on probation until a reading at or below
        1: its first reading above 1 sends it back, for twice the previous wait (up to
        ``2^RETRY_DOUBLINGS`` times), so a layer that whitening
        keeps hurting costs one reading interval per retry, and retries grow rare. On the fallback
        the reading is GIFT's shadow's (``meter.py``): a retry is skipped while it reads above 1."""
        if not self.whitening_on():
            self.shadow_verdict.fill_(reading.verdict)
            return
        if self.config.adaptive_damping:
            self.adapt_damping(reading.verdict)
        if not self.config.fallback:
            return
        over = reading.verdict > 1.0
        self.meter_over.fill_(int(self.meter_over) + 1 if over else 0)
        if not over:
            self.fallbacks_in_a_row.zero_()
        retried = int(self.fallbacks_in_a_row)
        patience = 1 if retried or reading.verdict > FAR_OVER else self.config.fallback_patience
        if int(self.meter_over) >= patience:
            self._fall_back(from_step=(int(self.step) if step is None else step) + 1)
            self.meter_over.zero_()
            log.warning(
                "GIFT layer %s: delivered error %.2fx (accumulated %s) the Euclidean route's for %d reading(s)%s; sending "
                "it as Euclidean until step %d, then retrying", self.fqn, reading.one_step,
                "-" if reading.accumulated is None else f"{reading.accumulated:.2f}x", patience,
                f" (retry {retried} failed)" if retried else "", int(self.fallback_until),
            )

    def adapt_damping(self, verdict: float) -> None:
        """One step of a hill climb on the meter's verdict: the damping moves by a factor of 2,
        on in the direction of its last move if this reading (taken with the moved damping) is no
        worse than the one before, else back the other way; at either end of its range it stays
        and turns. Lower damping whitens more; higher moves ``T`` towards a multiple of ``I``
        (Euclidean)."""
        if float(self.last_verdict) >= 0 and verdict > float(self.last_verdict):
            self.damping_direction.neg_()
        self.last_verdict.fill_(verdict)
        if abs(int(self.damping_exponent) + int(self.damping_direction)) > DAMPING_OCTAVES:
            self.damping_direction.neg_()
        else:
            self.damping_exponent.add_(self.damping_direction)

    # -- periodic factors --------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, layer_input: torch.Tensor, group=None) -> None:
        """Recompute the factors from this step's statistics, identically on every rank.

        Called again in the same step (FSDP2: a later forward replaced one without backward),
        it starts over from the moment it started from, so only the latest forward counts."""
        if self._refresh_start is not None and self._refresh_start[0] == int(self.step):
            self.moment.copy_(self._refresh_start[1])
            self.refreshes.fill_(self._refresh_start[2])
        else:
            self._refresh_start = (int(self.step), self.moment.clone(), int(self.refreshes))
        group = resolve_group(group)
        moment, tokens = second_moment(layer_input.detach(), self.config.stats_max_tokens)
        packed = torch.cat([moment.reshape(-1), moment.new_tensor([tokens])])
        dist.all_reduce(packed, group=group)
        mean = packed[:-1].reshape(moment.shape) / packed[-1].clamp_min(1)
        if not bool(torch.isfinite(mean).all()):
            log.warning("GIFT layer %s: non-finite input statistics at step %d; keeping the previous factors", self.fqn, int(self.step))
            return
        decay = self.config.ema_decay if int(self.refreshes) > 0 else 0.0
        self.moment.mul_(decay).add_(mean, alpha=1.0 - decay)
        low_rank = None if self.config.whitening_layout == "dense" and self.config.low_rank is None else self.low_rank
        new = factorize(self.moment, factorization=self.config.factorization, rank=low_rank,
                        damping=self.config.damping, seed=int(self.refreshes))
        src = dist.get_global_rank(group, 0)
        for name, tensor in new.tensors.items():
            dist.broadcast(tensor, src=src, group=group)
            getattr(self, f"factor_{name}").copy_(tensor)
        self.refreshes += 1


# The config fields a saved state's meaning depends on: its buffers (a basis or dense factors,
# residuals or none, an all-gather residual) cannot be used under other values.
LAYOUT_FIELDS = ("factor_source", "factorization", "low_rank", "error_feedback", "euclidean_error_feedback", "all_gather_dtype")


class GiftState(nn.Module):
    """All layers' state, keyed by FQN; created lazily with the gradient's shape.

    ``state_dict`` also records who saved it (rank and data-parallel size: residuals and
    meters are per rank) and the config fields of :data:`LAYOUT_FIELDS`; ``load_state_dict``
    checks all of that, every layer's shape and every buffer's finiteness before it changes
    anything, so an unusable checkpoint is refused when it is loaded, naming what is wrong,
    never at a later backward."""

    def __init__(self, config: GiftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict()

    def layer(
        self,
        fqn: str,
        d_out: int | None = None,
        d_in: int | None = None,
        device: torch.device | None = None,
        *,
        whitened: bool = True,
    ) -> GiftLayerState:
        """The state of layer ``fqn``, created for ``(d_out, d_in)`` gradients and placed on
        ``device`` (a gradient's ``.device``) when those are given."""
        key = state_key(fqn)
        if key not in self.layers:
            if d_out is None or d_in is None:
                raise KeyError(f"no GIFT state for layer {fqn!r}; known layers: {self.fqns()}")
            self.layers[key] = GiftLayerState(fqn, d_out, d_in, self.config, whitened=whitened, device=device)
        state = self.layers[key]
        if d_out is not None and (state.d_out, state.d_in) != (d_out, d_in):
            raise ValueError(f"GIFT layer {fqn!r} was created for ({state.d_out}, {state.d_in}) gradients, got ({d_out}, {d_in})")
        if device is not None:
            state.place_on(device)
        return state

    def get_extra_state(self) -> str:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return json.dumps({"saved_by": [rank, world], "layout": {name: getattr(self.config, name) for name in LAYOUT_FIELDS}})

    def set_extra_state(self, state) -> None:
        pass  # checked by load_state_dict before anything is loaded

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False, *, shapes: dict[str, tuple[int, int]] | None = None):
        """Check the checkpoint (class docstring), create the layers it holds (their shapes are
        saved with them), then load. ``shapes`` (``{Linear FQN: (d_out, d_in)}``, e.g.
        ``selection.linear_weight_shapes(model)``) also checks each layer against the model."""
        state_dict = dict(state_dict)
        state_dict.setdefault("_extra_state", "")  # saved before this record existed: nothing to check
        layers = self._check_loadable(state_dict, shapes)
        for key, (d_out, d_in, whitened) in layers.items():
            layer = self.layer(key.replace("/", "."), d_out, d_in, whitened=whitened)
            state_dict.setdefault(f"layers.{key}.fallbacks_in_a_row", torch.zeros((), dtype=torch.int64))  # saved before retries doubled
            if whitened:  # saved before the retry was gated
                state_dict.setdefault(f"layers.{key}.shadow_verdict", torch.full((), NO_VERDICT, dtype=torch.float64))
            gathered = state_dict.get(f"layers.{key}.gather_residual")
            if gathered is not None:
                layer.ensure_gather_residual(*gathered.shape)
            if layer.current_step:  # saved before the sketch had a scale (start it at 1) or adaptive damping
                state_dict.setdefault(f"layers.{key}.sketch_scale", torch.ones(()))
                for name, value in ADAPTIVE_DAMPING_START.items():
                    state_dict.setdefault(f"layers.{key}.{name}", value.clone())
        expected = self.state_dict()
        for name, value in state_dict.items():
            if isinstance(value, torch.Tensor) and name in expected and value.shape != expected[name].shape:
                layer, _, buffer = name.removeprefix("layers.").rpartition(".")
                raise ValueError(f"GIFT checkpoint: layer {layer.replace('/', '.')!r} buffer {buffer!r} has shape "
                                 f"{tuple(value.shape)}, this config and layer need {tuple(expected[name].shape)}")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _check_loadable(self, state_dict, shapes) -> dict[str, tuple[int, int, bool]]:
        """Everything :meth:`load_state_dict` refuses, before it changes anything; returns the
        layers the checkpoint holds as ``{key: (d_out, d_in, whitened)}``."""
        if state_dict["_extra_state"]:
            record = json.loads(state_dict["_extra_state"])
            rank, world = record["saved_by"]
            if dist.is_initialized() and (rank, world) != (dist.get_rank(), dist.get_world_size()):
                raise ValueError(
                    f"GIFT checkpoint: saved by rank {rank} of {world} ranks, loaded on rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}; GIFT's residuals and meters are per rank: resume on {world} ranks, "
                    "each loading the state it saved (or start GIFT's state fresh)"
                )
            for name, saved in record["layout"].items():
                if saved != getattr(self.config, name):
                    raise ValueError(
                        f"GIFT checkpoint: saved with {name}={saved!r}, this config has {name}={getattr(self.config, name)!r}; "
                        f"its buffers cannot be used with another {name}: resume with the same value (or start GIFT's state fresh)"
                    )
        layers = {}
        for name, value in state_dict.items():
            key, _, buffer = name.removeprefix("layers.").rpartition(".")
            fqn = key.replace("/", ".")
            if buffer == "shape":
                d_out, d_in, whitened = (int(v) for v in value.tolist())
                layers[key] = (d_out, d_in, bool(whitened))
                known = self.layers[key] if key in self.layers else None
                want = (known.d_out, known.d_in) if known is not None else (shapes or {}).get(fqn.partition("#")[0])
                if want is not None and tuple(want) != (d_out, d_in):
                    raise ValueError(f"GIFT checkpoint: layer {fqn!r} was saved for ({d_out}, {d_in}) gradients, "
                                     f"this model's layer has {tuple(want)}")
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad = int((~torch.isfinite(value)).sum())
                raise ValueError(f"GIFT checkpoint: layer {fqn!r} buffer {buffer!r} holds {bad} non-finite value(s) "
                                 "(NaN/Inf): the checkpoint is corrupt, and a step from it would send NaN gradients")
            if buffer == "shadow_verdict" and float(value) < 0 and float(value) != NO_VERDICT:
                raise ValueError(f"GIFT checkpoint: layer {fqn!r} buffer 'shadow_verdict' is {float(value)}, neither a "
                                 f"ratio (>= 0) nor {NO_VERDICT} (none yet): the checkpoint is corrupt")
            allowed = {"damping_exponent": range(-DAMPING_OCTAVES, DAMPING_OCTAVES + 1), "damping_direction": (-1, 1),
                       "fallbacks_in_a_row": range(0, MAX_INT + 1)}.get(buffer)
            if allowed is not None and int(value) not in allowed:
                shown = f"[{allowed.start}, {allowed.stop - 1}]" if isinstance(allowed, range) else str(list(allowed))
                raise ValueError(f"GIFT checkpoint: layer {fqn!r} buffer {buffer!r} is {int(value)}, outside {shown}: "
                                 "the checkpoint is corrupt")
        return layers

    def fqns(self) -> list[str]:
        return [layer.fqn for layer in self.layers.values()]

    def checksum(self) -> torch.Tensor:
        """A float64 fingerprint of every basis and factor (tests compare it across ranks)."""
        total = torch.zeros((), dtype=torch.float64)
        for layer in self.layers.values():
            for i, t in enumerate(layer.geometry_tensors()):
                total += (t.detach().double().cpu().reshape(-1) * torch.arange(1, t.numel() + 1, dtype=torch.float64).cos()).sum() * math.sqrt(i + 1)
        return total
