"""GIFT on FSDP2 (``fully_shard``): a custom reduce-scatter, and statistics from the forward.

FSDP2 reduce-scatters one flat buffer per parameter group from a hook outside every traced
graph (docs/design.md §4), where no compiler pass reaches. ``FSDPModule.set_custom_reduce_scatter``
lets us own that collective. Its input is ``world * S`` elements: row ``r`` of
``input.view(world, S)`` is every parameter's ``r``-th dim-0 chunk (``ceil(d0 / world)`` rows,
zero-padded), concatenated in the group's parameter order; the output is this rank's ``S``.
So each parameter's slot, read across the ``world`` rows, is this rank's whole local gradient
(plus zero rows), and :class:`GiftReduceScatter` reduces it parameter by parameter, each
parameter's way:

* as ``policy.plan`` says, the same rule as every other route: selected Linear weights GIFT
  (``layer_step.reduce_layer``: input-side whitening acts on each row, so it commutes with the
  dim-0 split, docs/design.md §2); other Linear weights on ``euclidean_dtype`` (with error
  feedback when ``euclidean_error_feedback``); other 2-D weights on ``embedding_dtype``;
* 1-D parameters (norms): the reduce dtype, as FSDP would.

The factors need the layer's inputs, which the reduce-scatter never sees. A forward hook on
each selected ``nn.Linear`` calls ``gift::record_input`` (an opaque custom op: per-block
``torch.compile(fullgraph=True)`` traces the hook into the block's graph, no graph break, no
recompilation), which starts the step: ``layer_step.begin_eagerly`` sketches the input and
issues the all-reduce that sums the sketch over the shard group, once for the layers that read
the same input. The reduce-scatter waits for it when the gradient arrives. Everything else
(state, error feedback, meter, fallback, counters, checkpoints) is the same runtime the
compiled-graph route uses.

The parameters' messages travel together (``[gift] bucket``, the default): every parameter
of the group is encoded first (``comm.encode_reduction``: whiten, FP8/FP4 encode), then one
``all_to_all`` carries all the quantized messages and one reduce-scatter the dense ones (norm
weights in the reduce dtype), then each parameter is decoded, unwhitened and given its new
residual (``comm.reduce_received``). Each receives the bytes it would alone, so the gradients
are bit for bit those of one collective per parameter, in two calls per block instead of one per
parameter. FSDP2 hands over a block's gradients at once, so no gradient waits for another.
HSDP's replicate all-reduce does the same per phase: one ``all_to_all``, then one all-gather of
every owner's re-encoded shards (``collectives.gather_many``, ``comm.finish_gathered``), and one
all-reduce of the dense ones. The codec's parts run compiled: FSDP2 calls the reduce-scatter
eagerly, so :data:`COMPILED_CODEC` is ``torch.compile`` of each, one static-shape graph per
parameter shape and path, in which Inductor fuses the transforms with the casts as on the graph
route.

HSDP: on a 2-D mesh FSDP2 follows the reduce-scatter with a replicate-group ``all_reduce`` in
the reduce dtype, and torch 2.13 offers no hook to replace it (``set_all_reduce_hook`` runs
after it). What it does offer is FSDP2's "custom HSDP": ``fully_shard`` over the shard
dimension alone plus an all-reduce hook, which FSDP calls on every reduce-scatter output. So
for HSDP, :func:`install` takes the replicate group and the hook reduces each parameter's shard
across it: 2-D parameters in Euclidean FP8 (the wire the reduce-scatter used for Euclidean
weights; FP8 for whitened ones, whose factors differ between replicas because each shard group
sums its own statistics), 1-D parameters in the reduce dtype. A native-HSDP module is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

from gift_compile import policy, timing
from gift_compile.agreement import describe
from gift_compile.collectives import WireFormat, bytes_sent, exchange, gather_many, reduce_many
from gift_compile.config import GiftConfig
from gift_compile.comm import (
    STATS,
    EncodedReduction,
    Gathering,
    Reduction,
    encode_reduction,
    finish_gathered,
    reduce_received,
)
from gift_compile.layer_step import (CurrentFactors, EagerAccess, InputStatistics, LayerPlan, begin_eagerly, gradient_factors,
                                     prepare_reduction)
from gift_compile.policy import Plan
from gift_compile.runtime import GiftRuntime, get_runtime
from gift_compile.static_compile import static_compile

log = logging.getLogger(__name__)


class Codec(NamedTuple):
    """The quantized codec's parts, either side of its collectives (``comm.encode_reduction``,
    ``comm.reduce_received``, ``comm.finish_gathered``): compiled, or as they are."""

    encode: Callable[..., EncodedReduction]
    receive: Callable[..., Reduction | Gathering]
    gathered: Callable[..., Reduction]

    def pending(self, grad: torch.Tensor, whitening, residual, gather_residual, end: Callable[[Reduction], torch.Tensor],
                *, op: str, group, wire: WireFormat, collective: str, gather_dtype: str) -> Pending:
        """``comm.quantized_reduce`` of ``grad`` with its collectives left to the caller: encoded
        now; what arrives makes the result, ``end(reduction)``, or on the all-reduce route the
        all-gather's ``Pending`` first."""
        encoded = self.encode(grad, whitening, residual, op=op, group=group, wire=wire)

        def received(incoming: torch.Tensor) -> torch.Tensor | Pending:
            stage = self.receive(grad, whitening, residual, gather_residual, encoded, incoming, op=op, group=group,
                                 wire=wire, collective=collective, gather_dtype=gather_dtype)
            if isinstance(stage, Reduction):
                return end(stage)
            return Pending(stage.message, "all_gather", lambda gathered: end(
                self.gathered(grad, whitening, stage, gathered, group=group, wire=wire, gather_dtype=gather_dtype)))

        return Pending(encoded.scatter.messages, "all_to_all", received)


COMPILED_CODEC = Codec(static_compile(encode_reduction), static_compile(reduce_received), static_compile(finish_gathered))
"""The codec compiled (module docstring); the same arguments and results, bit for bit."""
EAGER_CODEC = Codec(encode_reduction, reduce_received, finish_gathered)


@dataclass(frozen=True)
class Segment:
    """One parameter's slot in a group's flat reduce-scatter buffer."""

    name: str
    """The parameter's FQN (``layers.0.attention.wqkv.weight``)."""
    layer: str | None
    """The ``nn.Linear`` FQN when this is a Linear weight, else None."""
    offset: int
    """Where the slot starts in each of the ``world`` rows (and in the output)."""
    shard_rows: int
    """``ceil(d0 / world)``: the rows each rank owns (padded)."""
    shape: tuple[int, ...]
    """The unsharded parameter shape."""
    world: int
    """Ranks of the shard group that reduce-scatters it."""

    @property
    def numel(self) -> int:
        return self.shard_rows * self.cols

    @property
    def module(self) -> str:
        """The FQN of the module holding the parameter (the counters' key, as on the graph route)."""
        return self.name.rpartition(".")[0] or self.name

    @property
    def cols(self) -> int:
        return int(torch.Size(self.shape[1:]).numel())


def group_segments(fsdp_params, names: dict[nn.Module, str], world: int) -> list[Segment]:
    """The slots of an FSDP parameter group, in its buffer order (FQNs from the module tree:
    FSDP's own ``_param_fqn`` is only set at its lazy init)."""
    segments, offset = [], 0
    for param in fsdp_params:
        info = param._module_info
        prefix = names[info.module]
        name = f"{prefix}.{info.param_name}" if prefix else info.param_name
        layer = prefix if isinstance(info.module, nn.Linear) and info.param_name == "weight" else None
        shape = tuple(param._orig_size)
        rows = -(-shape[0] // world)
        segments.append(Segment(name, layer, offset, rows, shape, world))
        offset += rows * int(torch.Size(shape[1:]).numel())
    return segments


@dataclass
class FsdpRoute:
    """What the FSDP route keeps on its runtime (``GiftRuntime.integration``)."""

    namespace: str
    config: GiftConfig
    """The config every parameter's ``policy.plan`` comes from (``layers = "auto"`` profiles
    under the integration's FP8 config before it whitens)."""
    selected: frozenset[str] = frozenset()
    plans: dict[str, LayerPlan] = field(default_factory=dict)
    """Linear layer FQN -> its step's plan (the shard group, the unsharded shape, whitened or not)."""
    pending: dict[str, tuple[LayerPlan, torch.Tensor, InputStatistics | None]] = field(default_factory=dict)
    """Selected layer FQN -> ``layer_step.begin_eagerly``'s result, from its forward until its reduce-scatter."""
    segments: list[Segment] = field(default_factory=list)
    """Every parameter slot of every group (bytes accounting)."""
    hooked: set[str] = field(default_factory=set)
    replicate_group: dist.ProcessGroup | None = None
    """HSDP's replicate dimension (each group's all-reduce hook), or None."""
    codec: Codec = COMPILED_CODEC
    """The quantized codec: :data:`COMPILED_CODEC` (the default), or :data:`EAGER_CODEC` (``install(compile_codec=False)``)."""
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """Every group this route sends over (each shard group, the replicas), by name: the agreement's."""
    device: torch.device | None = None

    def select(self, model: nn.Module, layers, config: GiftConfig | None = None) -> None:
        """Whiten ``layers`` from the next step on (each gets its forward statistics hook once),
        under ``config`` if given. First the ranks agree on the whole route (agreement.py), on
        every group it sends over."""
        layers = frozenset(layers)
        if layers and not self.plans:
            log.info("GIFT: every FSDP shard group has one rank: nothing to communicate, gradients stay as they are")
            return
        missing = sorted(layers - set(self.plans))
        if missing:
            raise ValueError(f"GIFT layers {missing} are not Linear weights of any fully_shard parameter group; "
                             f"those are: {sorted(self.plans)}")
        config = config or self.config
        description = self.describe(config, layers)
        runtime = get_runtime(self.namespace)
        for group in self.groups.values():
            runtime.agree(group, description, self.device)
        for fqn in sorted(layers - self.hooked):
            model.get_submodule(fqn).register_forward_hook(_input_hook(self.namespace, fqn))
            self.hooked.add(fqn)
        self.config, self.selected = config, layers
        self.plans = {fqn: LayerPlan.of(fqn, p.d_out, p.d_in, config, whitened=fqn in layers, collective="reduce_scatter",
                                        op="sum", group_name=p.group_name) for fqn, p in self.plans.items()}

    def plan(self, segment: Segment, *, replicas: bool = False, config: GiftConfig | None = None,
             selected: frozenset[str] | None = None) -> Plan:
        """How this parameter travels (``policy.plan``): on its reduce-scatter, or across the replicas."""
        kind = "linear" if segment.layer is not None else ("vector" if len(segment.shape) == 1 else "matrix")
        selected = self.selected if selected is None else selected
        return policy.plan(config or self.config, kind, selected=segment.layer in selected,
                           collective="all_reduce" if replicas else "reduce_scatter", replicas=replicas)

    def describe(self, config: GiftConfig, selected: frozenset[str]) -> str:
        """What this rank's reduce-scatters (and replica all-reduces) will send, parameter by parameter."""
        entries = [("route", f"groups {len(self.groups)}")]
        for s in self.segments:
            plan = self.plan(s, config=config, selected=selected)
            entries.append((s.name, plan.describe(s.shape, "reduce_scatter", "sum", s.world)))
        return describe(config, entries)

    @classmethod
    def of(cls, runtime: GiftRuntime) -> FsdpRoute:
        if not isinstance(runtime.integration, FsdpRoute):
            raise RuntimeError("this GIFT runtime has no FSDP route: call gift_compile.fsdp.install(model, runtime, ...)")
        return runtime.integration


@dataclass
class Pending:
    """One parameter's reduction up to its next collective: the message it sends and what makes
    its result, or its next ``Pending``, from what arrives."""

    message: torch.Tensor
    via: str | WireFormat
    """How the message travels: ``"all_to_all"`` (quantized, uint8 ``(world, bytes)``, row ``j``
    to rank ``j``), ``"all_gather"`` (the all-reduce's reduced shard, to every rank), or the
    dense wire it is summed on (``(world, n)`` rows for a reduce-scatter, ``(1, n)`` for an
    all-reduce)."""
    complete: Callable[[torch.Tensor], torch.Tensor | Pending]


class GiftReduceScatter(ReduceScatter):
    """The reduce-scatter of one FSDP parameter group (module docstring)."""

    def __init__(self, segments: list[Segment], namespace: str) -> None:
        self.segments, self.namespace = segments, namespace
        self._op = "avg"  # the last reduce-scatter's op: the replicate all-reduce continues it

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # FSDP makes the sharded .grad tensors views into the output at absolute offsets: a
        # fresh tensor each call, never a reused buffer.
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group: dist.ProcessGroup, op, async_op: bool = False):
        world = dist.get_world_size(group)
        total = output_tensor.numel()
        if input_tensor.numel() != world * total or total != sum(s.numel for s in self.segments):
            raise RuntimeError(
                f"GIFT reduce-scatter: FSDP handed {input_tensor.numel()} elements for {world} ranks, expected "
                f"{world} x {sum(s.numel for s in self.segments)} for parameters {[s.name for s in self.segments]} "
                "(a parameter without a gradient? GIFT needs every parameter of a group to have one)"
            )
        kind, factor = normalize_op(op)
        # AVG over the shard group continues as AVG over the replicas; a sum (times FSDP's
        # divide factor, already applied to the shard) continues as a sum.
        self._op = kind
        with timing.codec_section(self.namespace, input_tensor.device):
            self._reduce_scatter(output_tensor, input_tensor.view(world, total), group, kind, factor)
        return None

    def _reduce_scatter(self, output_tensor, rows, group, kind: str, factor: float | None) -> None:
        runtime = get_runtime(self.namespace)
        world = rows.shape[0]
        opened = []
        for segment in self.segments:
            # this rank's whole gradient: the padding rows are zeros
            local = rows[:, segment.offset : segment.offset + segment.numel].reshape(world * segment.shard_rows, segment.cols)
            opened.append(self._begin(runtime, segment, local[: segment.shape[0]], group, kind))
        self._gradient_statistics(runtime, [o for o in opened if isinstance(o, OpenStep)])
        pending = [o.pending(FsdpRoute.of(runtime)) if isinstance(o, OpenStep) else o for o in opened]
        for segment, shard in zip(self.segments, self._exchange(runtime, pending, group, kind, "reduce_scatter")):
            if factor is not None:
                shard = shard * factor
            output_tensor[segment.offset : segment.offset + segment.numel].copy_(shard.reshape(-1))

    def all_reduce(self, reduce_output: torch.Tensor) -> None:
        """FSDP's all-reduce hook (HSDP's replicate dimension): reduce this rank's shard of every
        parameter across the replicas, in place (module docstring)."""
        with timing.codec_section(self.namespace, reduce_output.device):
            self._all_reduce(reduce_output)

    def _all_reduce(self, reduce_output: torch.Tensor) -> None:
        runtime = get_runtime(self.namespace)
        route = FsdpRoute.of(runtime)
        pending, flats = [], []
        for segment in self.segments:
            flat = reduce_output[segment.offset : segment.offset + segment.numel]
            shard = flat.view(segment.shard_rows, segment.cols) if len(segment.shape) > 1 else flat
            key = f"{segment.layer or segment.module}@replicate"
            pending.append(self._stateless(runtime, route.plan(segment, replicas=True), key, segment, shard,
                                           route.replicate_group, self._op, "all_reduce"))
            flats.append(flat)
        for flat, reduced in zip(flats, self._exchange(runtime, pending, route.replicate_group, self._op, "all_reduce")):
            flat.copy_(reduced.reshape(-1))

    @staticmethod
    def _exchange(runtime: GiftRuntime, pending: list[Pending], group, op: str, collective: str) -> list[torch.Tensor]:
        """Send every message and complete every reduction: with ``bucket``, the whole group's
        messages of a phase in one collective per way of travel (FSDP hands over a block's
        gradients together, so nothing waits longer); else one gradient at a time."""
        buckets = [pending] if runtime.config.bucket else [[p] for p in pending]
        piece_bytes = runtime.config.wire_piece_kib * 1024
        return [result for bucket in buckets for result in _send(bucket, group, op, collective, piece_bytes)]

    @staticmethod
    def _stateless(runtime: GiftRuntime, plan: Plan, key: str, segment: Segment, grad: torch.Tensor, group, op: str,
                   collective: str) -> Pending:
        """One reduction without state, counted under ``key`` when 2-D."""
        wire = plan.wire or WireFormat("bf16" if grad.dtype == torch.bfloat16 else "fp32")  # unchanged: the reduce dtype

        def counted(reduction: Reduction) -> torch.Tensor:
            if len(segment.shape) > 1:  # counted on every wire, fp32 included: the bytes metrics sum these
                # what this rank reduces: its whole gradient (reduce-scatter) or its shard (all-reduce)
                nbytes = bytes_sent(tuple(grad.shape), dist.get_world_size(group), wire, collective, plan.gather_dtype)
                runtime.record_euclidean(key, wire.dtype, reduction.stats, nbytes)
            return reduction.output

        if wire.quantized:
            return FsdpRoute.of(runtime).codec.pending(grad, None, None, None, counted, op=op, group=group, wire=wire,
                                                       collective=collective, gather_dtype=plan.gather_dtype)
        # a dense wire: the collective alone, nothing to compile; rows as ``collectives.reduce_many`` takes them
        rows = 1 if collective == "all_reduce" else dist.get_world_size(group)
        zeros = grad.new_zeros(len(STATS), dtype=torch.float32)
        return Pending(_rows_of(grad, rows), wire,
                       lambda reduced: counted(Reduction(reduced.to(grad.dtype), None, None, zeros)))

    @staticmethod
    def _gradient_statistics(runtime: GiftRuntime, opened: list[OpenStep]) -> None:
        """With ``bucket``, the gradient-statistics layers' sketches summed in one all-reduce
        (``layer_step.gradient_factors``; FSDP hands over their gradients together); else each
        layer's own, in ``prepare_reduction``."""
        waiting = [o for o in opened if o.step.gradient_statistics and o.factors is None]
        if runtime.config.bucket and waiting:
            factors = gradient_factors([(o.step, o.access, o.grad, o.token) for o in waiting])
            for o, f in zip(waiting, factors):
                o.factors = f

    def _begin(self, runtime: GiftRuntime, segment: Segment, grad: torch.Tensor, group, op: str) -> Pending | OpenStep:
        """A stateless segment's reduction, or a stateful layer's step begun (its factors, if
        any, from the forward's statistics)."""
        route = FsdpRoute.of(runtime)
        plan = route.plan(segment)
        if plan.whitened:
            pending = route.pending.pop(segment.layer, None)
            if pending is None:
                raise RuntimeError(
                    f"GIFT: no forward statistics for layer {segment.layer!r} this step: its gift::record_input "
                    "forward hook did not run (install with gift_compile.fsdp.install)"
                )
            step, token, statistics = pending
            step, access = dataclasses.replace(step, op=op), EagerAccess(runtime)
            factors = statistics.factors() if statistics is not None else None
        elif plan.stateful:
            # Euclidean with error feedback: the layer's step without whitening; it reads no
            # input, the gradient only gives the device.
            step, access, factors = dataclasses.replace(route.plans[segment.layer], op=op), EagerAccess(runtime), None
            token = access.begin(step, grad, None)
        else:
            return self._stateless(runtime, plan, segment.layer or segment.module, segment, grad, group, op, "reduce_scatter")
        return OpenStep(step, access, grad, token, factors)


@dataclass
class OpenStep:
    """A stateful layer's step in a reduce-scatter, begun: what ``prepare_reduction`` takes."""

    step: LayerPlan
    access: EagerAccess
    grad: torch.Tensor
    token: torch.Tensor
    factors: CurrentFactors | None

    def pending(self, route: FsdpRoute) -> Pending:
        prepared = prepare_reduction(self.step, self.access, self.grad, self.token, self.factors)
        return route.codec.pending(self.grad, prepared.whitening, prepared.residual, prepared.gather_residual,
                                   prepared.end, **self.step.reduction)


def _send(bucket: list[Pending], group, op: str, collective: str, piece_bytes: int) -> list[torch.Tensor]:
    """Complete ``bucket``'s reductions, phase by phase: each round sends every waiting message
    in one collective per way of travel and dtype (on gloo the quantized ones in pieces of at
    most ``piece_bytes`` per destination), and a completion may wait for another round (the
    all-reduce's all-gather). The order is the same on every rank: the segments'."""
    results: list[torch.Tensor | Pending] = list(bucket)
    while waiting := [i for i, r in enumerate(results) if isinstance(r, Pending)]:
        kinds: dict[tuple, list[int]] = {}
        for i in waiting:
            kinds.setdefault((results[i].via, results[i].message.dtype), []).append(i)
        arrived: dict[int, torch.Tensor] = {}
        for (via, _), same in kinds.items():
            messages = [results[i].message for i in same]
            if via == "all_to_all":
                got = exchange(messages, group, piece_bytes)
            elif via == "all_gather":
                got = gather_many(messages, group, piece_bytes)
            else:
                got = reduce_many(messages, op, group, via, collective)
            arrived.update(zip(same, got))
        for i in waiting:
            results[i] = results[i].complete(arrived[i])
    return results


def _rows_of(grad: torch.Tensor, rows: int) -> torch.Tensor:
    """``grad`` zero-padded to a multiple of ``rows`` rows, as ``(rows, n)``: one row per rank."""
    padded = -(-grad.shape[0] // rows) * rows
    return torch.nn.functional.pad(grad.reshape(grad.shape[0], -1), (0, 0, 0, padded - grad.shape[0])).reshape(rows, -1)


def normalize_op(op) -> tuple[str, float | None]:
    """FSDP2's reduce op as ``("sum" | "avg", factor or None)``: ``PREMUL_SUM(f)`` (torchtitan's
    ``set_gradient_divide_factor``) is a sum times ``f`` (linear, so after the sum is the same)."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return "sum", None
    if kind == dist.ReduceOp.AVG:
        return "avg", None
    if kind == dist.ReduceOp.PREMUL_SUM:
        return "sum", float(op.factor) if hasattr(op, "factor") else None
    raise ValueError(f"GIFT reduce-scatter: FSDP reduce op {op!r} is not supported (SUM, AVG or PREMUL_SUM)")


@torch.library.custom_op("gift::record_input", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def record_input(namespace: str, fqn: str, layer_input: torch.Tensor) -> None:
    """Start a selected layer's step from its forward input (``layer_step.begin_eagerly``).

    The statistics a reduce-scatter uses are those of the layer's latest forward before it: a
    train-mode forward that no backward follows (a peek, a discarded micro-batch) is replaced
    by the next forward, so it changes nothing. A forward run inside the backward (activation
    checkpointing's recompute) keeps the original's; with gradient accumulation the last
    micro-batch's forward sets the factors."""
    runtime = get_runtime(namespace)
    route = FsdpRoute.of(runtime)
    if fqn not in route.selected:
        return
    earlier = route.pending.get(fqn)
    if earlier is not None and torch._C._current_graph_task_id() != -1:  # a recompute inside the backward
        return
    with timing.codec_section(namespace, layer_input.device):
        if earlier is not None and earlier[2] is not None:
            earlier[2].settle()  # its all-reduce is in flight: finish it, drop it
        # A layer that reads the input of one recorded earlier this step (q, k and v; w1 and w3) shares its statistics.
        taken = [statistics for _, _, statistics in route.pending.values() if statistics is not None]
        route.pending[fqn] = begin_eagerly(route.plans[fqn], EagerAccess(runtime), layer_input, taken)


@record_input.register_fake
def _(namespace, fqn, layer_input):
    return None


torch.fx.node.has_side_effect(torch.ops.gift.record_input.default)


def _input_hook(namespace: str, fqn: str):
    def hook(module, args, output):
        if torch.is_grad_enabled():  # an evaluation forward sends no gradient: no statistics either
            torch.ops.gift.record_input(namespace, fqn, args[0].detach().reshape(-1, args[0].shape[-1]))

    return hook


def install(model: nn.Module, runtime: GiftRuntime, namespace: str, selected=frozenset(),
            replicate_group: dist.ProcessGroup | None = None, compile_codec: bool = True) -> FsdpRoute:
    """Give every FSDP parameter group of ``model`` a :class:`GiftReduceScatter` and whiten the
    ``selected`` Linear layers (call after ``fully_shard``, before the first forward).

    HSDP: ``fully_shard`` over the shard dimension only and pass the replicate dimension's
    group as ``replicate_group``: each group's all-reduce hook then reduces across it (module
    docstring). ``compile_codec=False`` runs the quantized codec eagerly (the same arithmetic, bit
    for bit; no Inductor compile per parameter shape). Every parameter travels as ``policy.plan``
    says under the runtime's config."""
    if replicate_group is not None and dist.get_world_size(replicate_group) == 1:
        replicate_group = None  # one replica: nothing to all-reduce
    route = FsdpRoute(namespace, runtime.config, replicate_group=replicate_group,
                      codec=COMPILED_CODEC if compile_codec else EAGER_CODEC)
    runtime.integration = route
    names = {module: name for name, module in model.named_modules()}
    seen = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(f"GIFT: FSDP module {names[module]!r} has {len(groups)} parameter groups; one per fully_shard call is supported")
        if not groups or id(groups[0]) in seen:  # the root holds none; fully_shard([a, b]) shares one
            continue
        group = groups[0]
        seen.add(id(group))
        if isinstance(group.mesh_info, DDPMeshInfo):
            raise ValueError(
                f"GIFT: FSDP module {names[module]!r} is sharded on a 2-D (HSDP) mesh, whose replicate all_reduce FSDP "
                "runs in the reduce dtype with no hook to replace it: fully_shard over the shard mesh dimension and pass "
                "the replicate dimension's group as install(..., replicate_group=)"
            )
        shard_group = group.mesh_info.shard_process_group
        route.device = group.device
        segments = group_segments(group.fsdp_params, names, dist.get_world_size(shard_group))
        if dist.get_world_size(shard_group) == 1:
            if replicate_group is not None and dist.get_world_size(replicate_group) > 1:
                raise ValueError(f"GIFT: FSDP module {names[module]!r} has a shard group of one rank and replicas: "
                                 "GIFT whitens the reduce-scatter; shard over more than one rank")
            continue  # FSDP does not reduce-scatter over one rank (it copies): nothing to send
        route.segments += segments
        route.groups[shard_group.group_name] = shard_group
        comm = GiftReduceScatter(segments, namespace)
        module.set_custom_reduce_scatter(comm)
        if replicate_group is not None:
            module.set_all_reduce_hook(comm.all_reduce)
        for segment in segments:
            if segment.layer is not None:
                route.plans[segment.layer] = LayerPlan.of(segment.layer, segment.shape[0], segment.cols, runtime.config,
                                                          whitened=False, collective="reduce_scatter", op="sum",
                                                          group_name=shard_group.group_name)
    if replicate_group is not None and route.segments:
        route.groups[replicate_group.group_name] = replicate_group
    route.select(model, selected)
    return route


__all__ = ["COMPILED_CODEC", "Codec", "EAGER_CODEC", "FsdpRoute", "GiftReduceScatter", "Pending", "Segment", "group_segments",
           "install", "normalize_op"]
