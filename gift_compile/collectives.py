"""Gradient reduce-scatter and all-reduce in FP8, FP4, bf16 or fp32 over a process group.

Low-precision values never meet arithmetic on the wire (docs/design.md §1)::

    x (rows, ...)                      each rank
      pad rows to world * c, view (world, c', cols)       c = ceil(rows / world)
      encode with this rank's own scale(s)                 one uint8 message per destination j:
                                                           [payload_j | scales_j as bytes]
      all_to_all_single                                    one message per peer
      decode each sender's chunk with *its* scales, sum in fp32   -> my shard (c rows)

The encodings (``WireFormat.dtype``): ``fp8`` (e4m3/e5m2, one fp32 scale per tensor or per
row block) and ``fp4`` (E2M1, two values per byte, block scales along the last dimension:
``fp4.py``). An all-reduce is that reduce-scatter, a re-encoding of the reduced shard and an
``all_gather`` of its bytes; every rank then decodes the same bytes with the same scales, so
all ranks end with bit-identical results.

Built on the functional collectives (``torch.ops._c10d_functional``) so the same code runs
eagerly, is traced by ``make_fx`` into a graph the GIFT pass splices in, and compiles with Inductor.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gift_compile import fp4, timing
from gift_compile.config import GiftConfig
from gift_compile.numerics import block_amax, boundary_hits, dequantize, quantize

ReduceOp = str  # "sum" or "avg"
_REDUCE_OPS = ("sum", "avg")
_SCALE_BYTES = 4  # fp32


QUANTIZED = ("fp8", "fp4")


@dataclass(frozen=True)
class WireFormat:
    """How one gradient travels: the dtype on the wire and, for FP8/FP4, its encoding."""

    dtype: str = "fp8"  # "fp8", "fp4", "bf16" or "fp32"
    fp8_format: str = "e4m3"
    scaling: str = "tensor"  # FP8: "tensor" or "row_block"
    block_rows: int = 128
    scale_mode: str = "per_rank"  # FP8: or "global_max"
    fp4_format: str = "nvfp4"  # FP4: "nvfp4" or "mxfp4"

    @property
    def quantized(self) -> bool:
        """Encoded with scales and decoded before any sum (FP8, FP4), not a plain dtype."""
        return self.dtype in QUANTIZED

    @classmethod
    def of(cls, dtype: str, config: GiftConfig) -> WireFormat:
        """``dtype`` on the wire, encoded as ``config`` says."""
        return cls(dtype, config.fp8_format, config.scaling, config.scale_block_rows, config.scale_mode, config.fp4_format)

    @classmethod
    def gift(cls, config: GiftConfig) -> WireFormat:
        """The wire format of layers sent in whitened coordinates."""
        return cls.of(config.gift_dtype, config)

    @classmethod
    def euclidean(cls, config: GiftConfig) -> WireFormat:
        """The wire format of Linear weight gradients that are not whitened."""
        return cls.of(config.euclidean_dtype, config)


class Layout(NamedTuple):
    """How a tensor of ``rows`` rows is cut into ``world`` chunks and scale blocks."""

    rows: int
    cols: int
    world: int
    shard_rows: int  # c = ceil(rows / world): rows each rank owns after the reduce-scatter
    block_rows: int  # rows per scale block (c for tensor scaling)
    padded_shard_rows: int  # c rounded up to a multiple of block_rows

    @property
    def blocks_per_chunk(self) -> int:
        return self.padded_shard_rows // self.block_rows

    @property
    def chunk_numel(self) -> int:
        return self.padded_shard_rows * self.cols


def layout(shape: torch.Size | tuple[int, ...], world: int, wire: WireFormat) -> Layout:
    if len(shape) == 0:
        raise ValueError("cannot reduce-scatter a 0-d tensor; reshape it to 1-D first")
    rows = shape[0]
    cols = math.prod(shape[1:])
    shard_rows = -(-rows // world)
    row_blocks = wire.dtype == "fp8" and wire.scaling == "row_block"  # FP4's blocks run along the columns
    block_rows = min(wire.block_rows, shard_rows) if row_blocks else shard_rows
    block_rows = max(block_rows, 1)
    padded = -(-shard_rows // block_rows) * block_rows
    return Layout(rows, cols, world, shard_rows, block_rows, padded)


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``None`` means the default (world) group, as in ``torch.distributed``."""
    return dist.group.WORLD if group is None else group


c10d = torch.ops._c10d_functional


# The collectives below are issued as the raw functional ops and waited on explicitly
# (:func:`received`), not through ``_functional_collectives``, which puts its own ``wait_tensor``
# right after each collective it traces. The graphs are the same (the overlap pass moves those
# waits); the explicit wait is what the FSDP route's time meter swaps for a timed one
# (``timing.codec_section``).


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, piece_bytes: int = 0) -> torch.Tensor:
    """Equal 1-D chunks of ``x``, chunk ``j`` to rank ``j``; waited. On gloo, a chunk larger than
    ``piece_bytes`` (``0``: no limit) travels in pieces (:func:`pieces_for`)."""
    world = _world(group)
    pieces = pieces_for(x, group, piece_bytes)
    if pieces > 1:
        return all_to_all_in_pieces(x, world, pieces, group.group_name)
    split = [x.numel() // world] * world
    return received(c10d.all_to_all_single(x, split, split, group.group_name))


def pieces_for(x: torch.Tensor, group: dist.ProcessGroup, piece_bytes: int) -> int:
    """How many calls an ``all_to_all`` of ``x`` over ``group`` takes with at most ``piece_bytes``
    per destination (``0``: one). Only on gloo, which moves one large call at a fraction of a
    slow link's rate and the same bytes in pieces issued together at nearly all of it; NCCL
    pipelines a large message itself (``passes/pieces.py``, docs/design.md §10)."""
    if piece_bytes <= 0 or dist.get_backend(group) != "gloo":
        return 1
    return math.ceil(x.numel() * x.element_size() // _world(group) / piece_bytes)


def all_to_all_in_pieces(x: torch.Tensor, world: int, pieces: int, group_name: str) -> torch.Tensor:
    """:func:`all_to_all` as ``pieces`` calls on column slices of the per-destination rows of
    ``x``, all issued before the first wait, their results concatenated back: every rank
    receives the same bytes in the same place as from one call."""
    per_destination = x.reshape(world, -1)
    width = math.ceil(per_destination.shape[1] / pieces)
    parts = [per_destination[:, start:start + width].contiguous().reshape(-1) for start in range(0, per_destination.shape[1], width)]
    splits = [[part.numel() // world] * world for part in parts]
    sent = [c10d.all_to_all_single(part, split, split, group_name) for part, split in zip(parts, splits)]
    return torch.cat([received(s).reshape(world, -1) for s in sent], dim=1).reshape(x.shape)  # a row per sender


SLOW_LINK_MBIT = 300.0
"""``parameter_piece_kib = "auto"`` sends pieces where one 1 MiB ``all_to_all`` moves slower than
this (Mbit/s per direction). Gloo moves one large call at about half a slow link's rate, so
this parts links of 200 Mbit/s and less (pieces pay or cost nothing) from 1 Gbit/s and more
(their per-call cost shows); docs/design.md §10 has the probe's readings on the shaped link."""
AUTO_PIECE_KIB = 128
PROBE_BYTES = 1 << 20


def one_call_mbit(group: dist.ProcessGroup, nbytes: int = PROBE_BYTES) -> float:
    """Mbit/s per direction of one ``all_to_all`` of ``nbytes`` per destination on ``group``, as
    the slowest rank timed it: every rank returns the same number (a collective; call it on all)."""
    world = _world(group)
    sent = torch.zeros(world * nbytes, dtype=torch.uint8)
    arrived = torch.empty_like(sent)
    dist.all_to_all_single(arrived[:world], sent[:world], group=group)  # connections up, untimed
    dist.barrier(group=group)
    start = time.perf_counter()
    dist.all_to_all_single(arrived, sent, group=group)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return nbytes * 8 / elapsed.item() / 1e6


def parameter_piece_kib_for(group: dist.ProcessGroup) -> tuple[int, float | None]:
    """``parameter_piece_kib = "auto"`` resolved on ``group``: ``(piece KiB, the probe's Mbit/s)``;
    ``(0, None)`` off gloo (NCCL pipelines a large message itself) or on one rank."""
    if dist.get_backend(group) != "gloo" or _world(group) < 2:
        return 0, None
    rate = one_call_mbit(group)
    return (AUTO_PIECE_KIB if rate < SLOW_LINK_MBIT else 0), rate


def all_gather_pieces(x: torch.Tensor, group: dist.ProcessGroup, piece_bytes: int) -> int:
    """How many calls :func:`all_gather` of ``x`` takes: its ``all_to_all`` sends ``x`` to every rank."""
    return pieces_for(x.reshape(1, -1).expand(_world(group), -1), group, piece_bytes)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, piece_bytes: int = 0) -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0; waited. On gloo it travels as an ``all_to_all``
    that sends ``x`` to every rank (in pieces of at most ``piece_bytes``): the same bytes on the
    wire and in the result, without the race below."""
    world = _world(group)
    if dist.get_backend(group) == "gloo":
        to_everyone = x.reshape(1, -1).expand(world, -1).reshape(-1)
        return all_to_all(to_everyone, group, piece_bytes).reshape(world * x.shape[0], *x.shape[1:])
    return received(c10d.all_gather_into_tensor(x, world, group.group_name))


# torch 2.13's ``ProcessGroupGloo`` worker threads (two per group) each write the name of the
# collective they just finished into one shared ``std::string`` without a lock. Names of up to
# 15 characters stay inside the string object; a functional ``all_gather_into_tensor`` finishes
# as ``ALLGATHER_COALESCED`` (19), which the string keeps on the heap, so two collectives
# finishing at once can free that buffer twice or write into it after it is freed: glibc then
# aborts the rank in an unrelated allocation ("malloc(): unaligned tcache chunk detected").
# With the graph routes' messages in pieces (``passes/pieces.py``), all issued at once, the main
# job died within 40-100 steps in each of 3 runs on loopback, against 0 of 3 runs of 90 steps
# with one call per message; an ``all_to_all`` finishes as a short name, with nothing on the
# heap (docs/design.md §10; ``benchmarks/gloo_race.py`` reproduces it without the job).


def _reduce_scatter_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return received(c10d.reduce_scatter_tensor(x, "sum", _world(group), group.group_name))


def _all_reduce(x: torch.Tensor, reduce_op: str, group: dist.ProcessGroup) -> torch.Tensor:
    return received(c10d.all_reduce(x, reduce_op, group.group_name))


def received(t: torch.Tensor) -> torch.Tensor:
    """Wait for a collective's result: ``wait_tensor``, or the time meter's timed wait where one is on."""
    namespace = timing.timed_waits_namespace()
    return c10d.wait_tensor(t) if namespace is None else torch.ops.gift.timed_wait(t, namespace)


# The current-step statistics travel on a process group of their own, with the gradient group's
# ranks. A backend runs one group's collectives on a few worker threads in issue order (gloo: 2
# per group): a statistics all-reduce issued while FSDP's prefetched parameter all-gather is on
# the wire holds a worker until the bytes queued ahead of it have gone, and the next all-gather
# waits for that worker, so the forward's link stalls once per block (docs/design.md §10).
_STATISTICS_GROUPS: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def separate_statistics_group(group: dist.ProcessGroup) -> None:
    """Send the statistics of gradients reduced over ``group`` over a new process group with the
    same ranks (:func:`statistics_group_name`). Every rank of ``group`` calls this, in the same
    order relative to its other group creations; when ``group`` is not the whole world, the
    other ranks need not call it."""
    if dist.get_world_size(group) == 1 or statistics_group_name(group.group_name) != group.group_name:
        return
    ranks = dist.get_process_group_ranks(group)
    own = dist.new_group(ranks, timeout=_timeout(group), backend=dist.get_backend(group),
                         group_desc=f"gift_statistics_{group.group_desc}", use_local_synchronization=len(ranks) < dist.get_world_size())
    _STATISTICS_GROUPS[group.group_name] = (group, own)


def match_statistics_timeouts() -> None:
    """Give every statistics group its gradient group's current timeout. Call it after changing
    a gradient group's (torchtitan shortens every mesh group's after the first step): a
    statistics all-reduce that waits longer than its gradients would keep a rank whose peer hung
    alive past the job's timeout."""
    for name in list(_STATISTICS_GROUPS):
        if statistics_group_name(name) != name:  # both groups still exist
            group, own = _STATISTICS_GROUPS[name]
            own.set_timeout(_timeout(group))


def _timeout(group: dist.ProcessGroup):
    return group._get_backend(torch.device(group._device_types[0])).options._timeout


def statistics_group_name(group_name: str) -> str:
    """The group the statistics of gradients reduced over ``group_name`` are summed on: its own
    (:func:`separate_statistics_group`), or the gradient group itself."""
    entry = _STATISTICS_GROUPS.get(group_name)
    if entry is None:
        return group_name
    group, own = entry
    if dist.distributed_c10d._world.pg_names.get(group) != group_name or own not in dist.distributed_c10d._world.pg_names:
        del _STATISTICS_GROUPS[group_name]  # destroyed since (a name is reused by a later group): forget it
        return group_name
    return own.group_name


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _check(x: torch.Tensor, op: ReduceOp) -> None:
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported; allowed values: {list(_REDUCE_OPS)}")
    if x.dim() == 0:
        raise ValueError("cannot reduce a 0-d tensor through the FP8 path; reshape it to 1-D")


def _chunked(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """``x`` as ``(world, padded_shard_rows, cols)`` fp32 with zero padding rows."""
    # Zero rows by F.pad, not cat with zeros: torch 2.13's Inductor (CPU) writes a cat's inputs
    # into views of its output and could reuse that output's memory while such a view was
    # still live, which corrupted a second padded gradient in the same graph.
    flat = F.pad(x.reshape(lay.rows, lay.cols).float(), (0, 0, 0, lay.world * lay.shard_rows - lay.rows))
    return _pad_to_scale_blocks(flat.reshape(lay.world, lay.shard_rows, lay.cols), lay)


def _pad_to_scale_blocks(chunks: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Zero rows so each ``(n, shard_rows, cols)`` chunk holds whole scale blocks."""
    return F.pad(chunks, (0, 0, 0, lay.padded_shard_rows - lay.shard_rows))


def _encode(chunks: torch.Tensor, lay: Layout, wire: WireFormat, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode ``(n, padded_shard_rows, cols)`` chunks of one sender: ``(messages uint8 (n, bytes),
    what they decode to (chunks' shape), boundary hits [saturated, flushed])``."""
    n = chunks.shape[0]
    if wire.dtype == "fp4":
        return fp4.encode(chunks, fp4.fp4_format(wire.fp4_format))
    blocks = 1 if wire.scaling == "tensor" else n * lay.blocks_per_chunk
    amax = block_amax(chunks, blocks)
    if wire.scale_mode == "global_max":
        amax = _all_reduce(amax, "max", group)
    payload, scales = quantize(chunks, wire.fp8_format, blocks, amax=amax)
    scales = scales.reshape(-1, 1).expand(n, 1) if wire.scaling == "tensor" else scales.reshape(n, -1)
    payload = payload.reshape(n, -1)
    hits = boundary_hits(chunks, payload.reshape(chunks.shape), wire.fp8_format)
    sent = dequantize(payload, scales.reshape(-1), wire.fp8_format).reshape(chunks.shape)
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(n, -1)
    return torch.cat([payload, scale_bytes], dim=1), sent, torch.stack([hits.saturated, hits.flushed]).float()


def _decode(messages: torch.Tensor, lay: Layout, wire: WireFormat) -> torch.Tensor:
    """Inverse of ``_encode``: ``(n, padded_shard_rows, cols)`` fp32, each chunk with its own scales."""
    n = messages.shape[0]
    if wire.dtype == "fp4":
        return fp4.decode(messages, lay.padded_shard_rows, lay.cols, fp4.fp4_format(wire.fp4_format))
    payload = messages[:, : lay.chunk_numel]
    # A copy, never a view: the scale bytes start at offset chunk_numel, which need not be a
    # multiple of 4 (with one rank the slice is contiguous and .contiguous() would not copy).
    scales = messages[:, lay.chunk_numel :].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return dequantize(payload, scales.reshape(-1), wire.fp8_format).reshape(n, lay.padded_shard_rows, lay.cols)


def message_bytes(lay: Layout, wire: WireFormat) -> int:
    """Bytes of one chunk's message: payload and scales."""
    if wire.dtype == "fp4":
        return fp4.message_bytes(lay.padded_shard_rows, lay.cols, fp4.fp4_format(wire.fp4_format))
    return lay.chunk_numel + _SCALE_BYTES * (1 if wire.scaling == "tensor" else lay.blocks_per_chunk)


def round_trip(x: torch.Tensor, wire: WireFormat, world: int = 1, group=None) -> torch.Tensor:
    """What ``x`` (2-D) decodes to after one sender's encoding on a quantized ``wire`` for a
    reduce-scatter over ``world`` ranks, with no communication (but ``global_max`` scales,
    which are agreed over ``group``): the live meter's shadow of the Euclidean route."""
    lay = layout(x.shape, world, wire)
    _, sent, _ = _encode(_chunked(x, lay), lay, wire, group)
    return _unchunk(sent, lay, x.shape).to(x.dtype)


def encode_shard(shard: torch.Tensor, rows: int, group, wire: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """An owner's encoding of its reduced shard (``ceil(rows / world)`` rows) for the all-reduce's
    all-gather: ``(message, uint8 (1, bytes); what its own rows decode to)``."""
    group = resolve_group(group)
    lay = layout((rows, *shard.shape[1:]), _world(group), wire)
    chunk = _pad_to_scale_blocks(shard.reshape(1, lay.shard_rows, lay.cols).float(), lay)
    messages, sent, _ = _encode(chunk, lay, wire, group)
    return messages, sent[0, : lay.shard_rows].reshape(shard.shape)


def decode_gathered(gathered: torch.Tensor, shape: tuple[int, ...], group, wire: WireFormat) -> torch.Tensor:
    """Every owner's :func:`encode_shard` message (``(world, bytes)``, as gathered), each decoded
    with its own scales: the reduced tensor of ``shape``, fp32."""
    lay = layout(shape, _world(resolve_group(group)), wire)
    return _unchunk(_decode(gathered.reshape(lay.world, -1), lay, wire), lay, shape)


def shard_round_trip(shard: torch.Tensor, rows: int, group, wire: WireFormat) -> torch.Tensor:
    """What an owner's reduced shard decodes to after the all-gather's encoding (no communication
    but ``global_max`` scales): the live meter's shadow of the all-reduce's second stage."""
    return encode_shard(shard, rows, group, wire)[1]


class QuantizedReduction(NamedTuple):
    reduced: torch.Tensor
    """fp32: this rank's reduced rows ``(shard_rows, *x.shape[1:])`` (reduce-scatter) or the whole
    reduced tensor (all-reduce)."""
    sent: torch.Tensor
    """What this rank's payload decodes to, fp32, shaped like ``x``: ``x - sent`` is the
    quantization error that error feedback carries to the next step."""
    stats: torch.Tensor
    """fp32 ``[saturated, flushed, ||x - sent||^2, ||x||^2]`` of this rank's encoding."""


def quantized_reduce_scatter(x: torch.Tensor, op: ReduceOp, group, wire: WireFormat) -> QuantizedReduction:
    """Reduce-scatter ``x`` along dim 0 with FP8/FP4 payloads and per-sender scales."""
    encoded = encode_scatter(x, op, group, wire)
    return reduce_scattered(encoded, all_to_all(encoded.messages.reshape(-1), resolve_group(group)), x.shape, op, group, wire)


class Encoded(NamedTuple):
    """One sender's half of a quantized reduce-scatter, up to its exchange (a caller may send
    several of them in one ``all_to_all``: ``exchange``)."""

    messages: torch.Tensor
    """uint8 ``(world, bytes)``: row ``j`` goes to rank ``j``."""
    chunks: torch.Tensor
    """What was encoded: ``(world, padded_shard_rows, cols)`` fp32."""
    sent: torch.Tensor
    """What ``chunks`` decode to."""
    hits: torch.Tensor
    """fp32 ``[saturated, flushed]``."""


def encode_scatter(x: torch.Tensor, op: ReduceOp, group, wire: WireFormat) -> Encoded:
    """The first half of :func:`quantized_reduce_scatter`: this rank's messages."""
    group = resolve_group(group)
    _check(x, op)
    lay = layout(x.shape, _world(group), wire)
    chunks = _chunked(x, lay)
    messages, sent, hits = _encode(chunks, lay, wire, group)
    return Encoded(messages, chunks, sent, hits)


def reduce_scattered(encoded: Encoded, incoming: torch.Tensor, shape: torch.Size, op: ReduceOp, group,
                     wire: WireFormat) -> QuantizedReduction:
    """The second half of :func:`quantized_reduce_scatter`: ``incoming`` holds every sender's
    message to this rank (``encoded``'s shape), each decoded with its own scales and summed."""
    world = _world(resolve_group(group))
    lay = layout(shape, world, wire)
    reduced = _decode(incoming.reshape(world, -1), lay, wire).sum(dim=0)
    if op == "avg":
        reduced = reduced / world
    shard = reduced[: lay.shard_rows].reshape(lay.shard_rows, *shape[1:])
    chunks, sent = encoded.chunks, encoded.sent
    stats = torch.cat([encoded.hits, torch.stack([(chunks - sent).square().sum(), chunks.square().sum()])])
    return QuantizedReduction(shard, _unchunk(sent, lay, shape), stats)


def exchange(messages: list[torch.Tensor], group, piece_bytes: int = 0) -> list[torch.Tensor]:
    """Send several ``(world, bytes)`` messages in one ``all_to_all`` (row ``j`` of each to rank
    ``j``; on gloo in pieces of at most ``piece_bytes``); returns what every sender sent this
    rank, per message: the bytes each would receive alone, in one round trip
    (``passes/bucketing.py`` and ``passes/pieces.py`` do the same in a graph)."""
    group = resolve_group(group)
    whole = all_to_all(torch.cat(messages, dim=1).reshape(-1), group, piece_bytes).reshape(_world(group), -1)
    return list(torch.split(whole, [m.shape[1] for m in messages], dim=1))


def gather_many(messages: list[torch.Tensor], group, piece_bytes: int = 0) -> list[torch.Tensor]:
    """Several all-gathers in one: each message (any shape, one dtype for all) from every rank
    (on gloo in pieces of at most ``piece_bytes``); returns, per message, ``(world, numel)``, row
    ``r`` rank ``r``'s."""
    group = resolve_group(group)
    whole = all_gather(torch.cat([m.reshape(1, -1) for m in messages], dim=1), group, piece_bytes)
    return list(torch.split(whole, [m.numel() for m in messages], dim=1))


def reduce_many(rows: list[torch.Tensor], op: ReduceOp, group, wire: WireFormat, collective: str) -> list[torch.Tensor]:
    """Several dense tensors reduced in one call: each ``(world, n)`` for a reduce-scatter (row
    ``r`` is rank ``r``'s part) or ``(1, n)`` for an all-reduce; returns this rank's ``(n,)``
    result per tensor. Every element is summed as it would be alone."""
    whole = torch.cat(rows, dim=1)
    reduced = reduce_scatter(whole, op, group, wire) if collective == "reduce_scatter" else all_reduce(whole, op, group, wire)
    return list(torch.split(reduced.reshape(-1), [r.shape[1] for r in rows]))


def _unchunk(chunks: torch.Tensor, lay: Layout, shape: torch.Size) -> torch.Tensor:
    rows = chunks[:, : lay.shard_rows].reshape(lay.world * lay.shard_rows, lay.cols)
    return rows[: lay.rows].reshape(shape)


def quantized_all_gather(shard: torch.Tensor, rows: int, group, wire: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather equal shards of ``ceil(rows / world)`` rows in FP8/FP4, each encoded by its owner.

    Returns the first ``rows`` rows of the gathered tensor (fp32) and what this rank's own
    shard decodes to (``shard - own`` is its quantization error).
    """
    group = resolve_group(group)
    message, own = encode_shard(shard, rows, group, wire)
    return decode_gathered(all_gather(message, group), (rows, *shard.shape[1:]), group, wire), own


def quantized_all_reduce(x: torch.Tensor, op: ReduceOp, group, wire: WireFormat) -> QuantizedReduction:
    """All-reduce = quantized reduce-scatter, re-encode the reduced shard, quantized all-gather.

    Returns the full reduced tensor (fp32, ``x``'s shape) and what this rank sent.
    """
    scattered = quantized_reduce_scatter(x, op, group, wire)
    full, _ = quantized_all_gather(scattered.reduced, x.shape[0], group, wire)
    return QuantizedReduction(full.reshape(x.shape), scattered.sent, scattered.stats)


def reduce_scatter(x: torch.Tensor, op: ReduceOp, group, wire: WireFormat) -> torch.Tensor:
    """Reduce-scatter along dim 0; returns ``ceil(rows / world)`` rows (zero rows pad the last rank)."""
    group = resolve_group(group)
    _check(x, op)
    if wire.quantized:
        return quantized_reduce_scatter(x, op, group, wire).reduced.to(x.dtype)
    world = _world(group)
    lay = layout(x.shape, world, WireFormat("fp32"))
    padded = _chunked(x, lay).reshape(world * lay.shard_rows, *x.shape[1:])
    shard = _reduce_scatter_sum(padded.to(_torch_dtype(wire.dtype)), group).float()
    if op == "avg":
        shard = shard / world
    return shard.to(x.dtype)


def all_reduce(x: torch.Tensor, op: ReduceOp, group, wire: WireFormat) -> torch.Tensor:
    """All-reduce ``x`` through ``wire``; same shape and dtype out."""
    group = resolve_group(group)
    _check(x, op)
    if wire.quantized:
        return quantized_all_reduce(x, op, group, wire).reduced.to(x.dtype)
    reduced = _all_reduce(x.to(_torch_dtype(wire.dtype)), "sum", group).float()
    if op == "avg":
        reduced = reduced / _world(group)
    return reduced.to(x.dtype)


def _torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def bytes_sent(shape: tuple[int, ...], world: int, wire: WireFormat, collective: str, gather_dtype: str | None = None) -> int:
    """Bytes one rank puts on the wire for one ``collective`` ("reduce_scatter"/"all_reduce").

    FP8/FP4 count the payload and scales sent to the ``world - 1`` peers (the self chunk never
    leaves the rank). Dense dtypes count a bandwidth-optimal ring: ``(world - 1) / world`` of
    the tensor per reduce-scatter or all-gather phase. ``gather_dtype`` (quantized all-reduce
    only): ``"bf16"`` when the all-gather phase sends bf16 shards instead of the wire's encoding.
    """
    if collective not in ("reduce_scatter", "all_reduce"):
        raise ValueError(f"collective must be 'reduce_scatter' or 'all_reduce', got {collective!r}")
    if not wire.quantized:
        return (2 if collective == "all_reduce" else 1) * _dense_phase_bytes(shape, world, wire.dtype)
    lay = layout(shape, world, wire)
    scatter = (world - 1) * message_bytes(lay, wire)
    if collective == "reduce_scatter":
        return scatter
    if gather_dtype != "bf16":
        return 2 * scatter
    return scatter + (world - 1) * lay.shard_rows * lay.cols * 2  # bf16 shards, no padding to scale blocks


def _dense_phase_bytes(shape: tuple[int, ...], world: int, dtype: str) -> int:
    numel = math.prod(shape)
    padded = -(-numel // world) * world if len(shape) else numel
    return (world - 1) * (padded // world) * (2 if dtype == "bf16" else 4)


def all_reduce_bytes(numel: int, world: int, dtype: str = "fp32") -> int:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of ``numel`` values (ring)."""
    return 2 * _dense_phase_bytes((numel,), world, dtype)
