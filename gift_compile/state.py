"""Per-layer GIFT state: second moments, factors, error-feedback residual, step counter.

All of it lives in buffers of an ``nn.Module``, so ``state_dict()`` checkpoints it and
``load_state_dict()`` restores it exactly. The compiled path reaches it at run time through
opaque custom ops keyed by the layer's FQN (DESIGN.md decision 5), never as graph constants.

Refresh (every ``refresh_interval`` steps, on every rank of the group at the same step):

1. ``sum x x^T`` and the token count of this step's layer inputs, all-reduced over the group,
   give the token-weighted mean ``A`` (mixed into the previous one with ``ema_decay``).
2. Every rank factorizes the same ``A``; rank 0's factors are then broadcast so that every
   rank whitens with bit-identical ``T`` (sums in whitened coordinates need it: decision 3).
3. The residual is moved into the new coordinates: ``R <- (R T_old^-1) T_new``.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from gift_compile.collectives import resolve_group
from gift_compile.config import GiftConfig
from gift_compile.geometry import FACTOR_NAMES, Whitening, factorize, identity_whitening, second_moment, whitening_kind

log = logging.getLogger(__name__)

# Which K-FAC sides a ``GiftConfig.side`` whitens.
SIDES = {"input": ("input",), "output": ("output",), "both": ("input", "output"), "diag": ("input",), "none": ()}


def factor_shapes(config: GiftConfig, d_out: int, d_in: int) -> list[tuple[int, ...]]:
    """Shapes of ``GiftLayerState.factor_tensors()`` without building the state."""
    kind = whitening_kind(config.factorization, config.rank, config.side == "diag")
    shapes = []
    for side in SIDES[config.side]:
        dim = d_in if side == "input" else d_out
        rank = config.rank if config.rank is not None else dim
        shapes += {
            "dense": [(dim, dim), (dim, dim)],
            "lowrank": [(dim, rank), (rank,), (rank,), (), ()],
            "diag": [(dim,), (dim,)],
        }[kind]
    return shapes


# Host-side bookkeeping: Python reads these every step (is a refresh due?) and at load time,
# which must never wait for a GPU. Everything else lives on the device of the layer's gradient.
HOST_BUFFERS = ("shape", "step", "refreshes")


def state_key(fqn: str) -> str:
    """Module names may not contain dots; FQNs do."""
    return fqn.replace(".", "/")


class GiftLayerState(nn.Module):
    def __init__(self, fqn: str, d_out: int, d_in: int, config: GiftConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.fqn, self.d_out, self.d_in, self.config = fqn, d_out, d_in, config
        self.device = torch.device("cpu") if device is None else device
        self.sides = SIDES[config.side]
        for side in self.sides:
            dim = self.dim(side)
            if config.rank is not None and config.side != "diag" and config.rank > dim:
                raise ValueError(
                    f"GiftConfig.rank={config.rank} exceeds the {side} dimension {dim} of layer {fqn!r}; "
                    f"use rank <= {dim} or rank=None"
                )
            self.register_buffer(f"{side}_moment", torch.zeros(dim, dim, device=self.device))
            for name, tensor in identity_whitening(self.kind, dim, config.rank).tensors.items():
                self.register_buffer(f"{side}_{name}", tensor.to(self.device))
        self.register_buffer("residual", torch.zeros(d_out, d_in, device=self.device) if config.error_feedback else None)
        self.register_buffer("shape", torch.tensor([d_out, d_in]))  # lets a checkpoint rebuild the layer
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("refreshes", torch.zeros((), dtype=torch.int64))

    def place_on(self, device: torch.device) -> None:
        """Move the tensors the gradient meets (factors, moments, residual) to its device.

        A layer created before its first gradient (a checkpoint load, a torchtitan session)
        may sit elsewhere; the refresh collectives then also run on ``device``, where the
        gradient's process group expects its tensors (NCCL: CUDA).
        """
        if device != self.device:
            self.to(device)
            self.device = device

    def _apply(self, fn, recurse=True):
        # What Module.to(device) and friends call: every buffer moves but the host bookkeeping.
        host = {name: self._buffers[name] for name in HOST_BUFFERS}
        super()._apply(fn, recurse)
        self._buffers.update(host)
        moved = [b for name, b in self._buffers.items() if b is not None and name not in HOST_BUFFERS]
        if moved:
            self.device = moved[0].device
        return self

    @property
    def kind(self) -> str:
        return whitening_kind(self.config.factorization, self.config.rank, self.config.side == "diag")

    def dim(self, side: str) -> int:
        return self.d_in if side == "input" else self.d_out

    def whitening(self, side: str) -> Whitening:
        prefix = f"{side}_"
        return Whitening(self.kind, {name: getattr(self, prefix + name) for name in FACTOR_NAMES[self.kind]})

    def factor_tensors(self) -> list[torch.Tensor]:
        """Every factor tensor, sides in order, in a fixed order (what the compiled graph loads)."""
        return [t for side in self.sides for t in self.whitening(side).tensors.values()]

    def is_refresh_step(self) -> bool:
        return int(self.step) % self.config.refresh_interval == 0

    def begin_step(self, layer_input: torch.Tensor | None, grad_output: torch.Tensor | None, group=None) -> None:
        """Before this step's gradient is whitened: refresh the factors when a refresh is due."""
        if self.is_refresh_step():
            self.refresh(layer_input, grad_output, group)

    @torch.no_grad()
    def end_step(self, new_residual: torch.Tensor | None) -> None:
        """After the reduction: keep the new residual and count the step."""
        if self.residual is not None and new_residual is not None:
            if new_residual.shape != self.residual.shape or new_residual.dtype != self.residual.dtype:
                raise ValueError(f"GIFT layer {self.fqn!r}: new residual {tuple(new_residual.shape)} {new_residual.dtype} "
                                 f"does not match the state's {tuple(self.residual.shape)} {self.residual.dtype}")
            if new_residual.is_contiguous() and new_residual.untyped_storage().nbytes() == self.residual.untyped_storage().nbytes():
                self.residual = new_residual.detach()  # adopt it: a copy is a full pass over d_out x d_in
            else:
                self.residual.copy_(new_residual)  # a view into a larger buffer would pin that buffer
        self.step += 1

    @torch.no_grad()
    def refresh(self, layer_input: torch.Tensor | None, grad_output: torch.Tensor | None, group=None) -> None:
        """Recompute the factors from this step's statistics, identically on every rank."""
        group = resolve_group(group)
        self._check_same_shape(group)
        old = {side: self.whitening(side) for side in self.sides}
        sources = {"input": layer_input, "output": grad_output}
        for side in self.sides:
            if sources[side] is None:
                raise ValueError(f"layer {self.fqn!r}: a refresh of the {side}-side factor needs its {side} statistics")
            moment, tokens = second_moment(sources[side].detach(), self.config.stats_max_tokens)
            packed = torch.cat([moment.reshape(-1), moment.new_tensor([tokens])])
            dist.all_reduce(packed, group=group)
            mean = packed[:-1].reshape(moment.shape) / packed[-1].clamp_min(1)
            if not bool(torch.isfinite(mean).all()):
                log.warning("GIFT layer %s: non-finite %s statistics at step %d; keeping the previous factors", self.fqn, side, int(self.step))
                return
            moment_buffer = getattr(self, f"{side}_moment")
            decay = self.config.ema_decay if int(self.refreshes) > 0 else 0.0
            moment_buffer.mul_(decay).add_(mean, alpha=1.0 - decay)
            new = factorize(
                moment_buffer,
                factorization=self.config.factorization,
                rank=self.config.rank,
                damping=self.config.damping,
                diagonal=self.config.side == "diag",
                seed=int(self.refreshes),
            )
            src = dist.get_global_rank(group, 0)
            for name, tensor in new.tensors.items():
                dist.broadcast(tensor, src=src, group=group)
                getattr(self, f"{side}_{name}").copy_(tensor)
        if self.residual is not None and self.sides:
            euclidean = unwhiten(self.residual, old, self.sides)
            self.residual.copy_(whiten(euclidean, {s: self.whitening(s) for s in self.sides}, self.sides))
        self.refreshes += 1

    def _check_same_shape(self, group) -> None:
        world = dist.get_world_size(group)
        mine = torch.tensor([self.d_out, self.d_in], device=self.device)
        shapes = mine.repeat(world)
        dist.all_gather_single(shapes, mine, group=group)
        shapes = shapes.reshape(world, 2)
        if not bool((shapes == mine).all()):
            raise RuntimeError(f"GIFT layer {self.fqn!r} has different gradient shapes across ranks: {shapes.tolist()}")


def whiten(g: torch.Tensor, whitenings: dict[str, Whitening], sides: tuple[str, ...]) -> torch.Tensor:
    """``T_B^T G T_A`` restricted to ``sides`` (input side acts on rows, output side on columns)."""
    if "input" in sides:
        g = whitenings["input"].whiten(g)
    if "output" in sides:
        g = whitenings["output"].whiten(g.T).T
    return g


def unwhiten(u: torch.Tensor, whitenings: dict[str, Whitening], sides: tuple[str, ...]) -> torch.Tensor:
    if "output" in sides:
        u = whitenings["output"].unwhiten(u.T).T
    if "input" in sides:
        u = whitenings["input"].unwhiten(u)
    return u


class GiftState(nn.Module):
    """All layers' state, keyed by FQN; created lazily with the gradient's shape."""

    def __init__(self, config: GiftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict()

    def layer(
        self, fqn: str, d_out: int | None = None, d_in: int | None = None, device: torch.device | None = None
    ) -> GiftLayerState:
        """The state of layer ``fqn``, created for ``(d_out, d_in)`` gradients and placed on
        ``device`` (a gradient's ``.device``) when those are given."""
        key = state_key(fqn)
        if key not in self.layers:
            if d_out is None or d_in is None:
                raise KeyError(f"no GIFT state for layer {fqn!r}; known layers: {self.fqns()}")
            self.layers[key] = GiftLayerState(fqn, d_out, d_in, self.config, device)
        state = self.layers[key]
        if d_out is not None and (state.d_out, state.d_in) != (d_out, d_in):
            raise ValueError(f"GIFT layer {fqn!r} was created for ({state.d_out}, {state.d_in}) gradients, got ({d_out}, {d_in})")
        if device is not None:
            state.place_on(device)
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Create the layers a checkpoint holds (their shapes are saved with them), then load."""
        for name, value in state_dict.items():
            parts = name.split(".")
            if len(parts) == 3 and parts[0] == "layers" and parts[2] == "shape":
                d_out, d_in = (int(v) for v in value.tolist())
                self.layer(parts[1].replace("/", "."), d_out, d_in)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def fqns(self) -> list[str]:
        return [layer.fqn for layer in self.layers.values()]

    def checksum(self) -> torch.Tensor:
        """A float64 fingerprint of every factor (tests compare it across ranks)."""
        total = torch.zeros((), dtype=torch.float64)
        for layer in self.layers.values():
            for i, t in enumerate(layer.factor_tensors()):
                total += (t.detach().double().cpu().reshape(-1) * torch.arange(1, t.numel() + 1, dtype=torch.float64).cos()).sum() * math.sqrt(i + 1)
        return total
