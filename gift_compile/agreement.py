"""Ranks agree or stop: one small collective before GIFT's first collective of a graph or group.

Sums of whitened gradients are only meaningful when every rank sends the same layers, with
the same shapes, on the same wire, with the same config (docs/design.md §3). When ranks
disagree, the collectives either have equal sizes and silently give each rank a different
"average" (rank 0 whitening ``fa``, rank 1 ``fb``), or reach gloo/NCCL with different sizes
(an abort or a hang). So each rank first describes what it is about to do, as ``{key:
value}`` (every config field, then one entry per gradient collective GIFT rewrites), and
:func:`agree` compares a digest of that over the group in one ``all_gather`` of two int64.
Only when the digests differ do the ranks exchange the descriptions themselves
(``all_gather_object``); every rank then raises the same :class:`GiftConfigMismatch`, naming
each key that differs and each rank's value. Nothing of GIFT's own reaches the wire before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import torch
import torch.distributed as dist

from gift_compile.config import GiftConfig


class GiftConfigMismatch(RuntimeError):
    """The ranks of a group would send different GIFT collectives (config, layers, shapes or paths)."""


def describe(config: GiftConfig, collectives: Iterable[tuple[str, str]]) -> str:
    """What a rank is about to do: every config field, then ``(key, what)`` per collective, in order."""
    entries = {f"config.{name}": repr(getattr(config, name)) for name in GiftConfig.field_names()}
    entries.update(collectives)
    return json.dumps(entries)


def agree(description: str, group: dist.ProcessGroup, device: torch.device) -> None:
    """Return if every rank of ``group`` holds the same ``description``; else raise
    :class:`GiftConfigMismatch` on every rank (module docstring)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    digest = torch.frombuffer(bytearray(hashlib.sha256(description.encode()).digest()[:16]), dtype=torch.int64).to(device)
    digests = torch.empty(world * 2, dtype=torch.int64, device=device)
    dist.all_gather_single(digests, digest, group=group)
    if bool((digests.view(world, 2) == digest).all()):
        return
    descriptions: list[str | None] = [None] * world
    dist.all_gather_object(descriptions, description, group=group)
    raise GiftConfigMismatch(mismatch_message([json.loads(d) for d in descriptions], dist.get_process_group_ranks(group)))


def mismatch_message(descriptions: list[dict[str, str]], ranks: list[int]) -> str:
    """Every key whose value differs between the ranks' descriptions, with each rank's value."""
    keys = list(dict.fromkeys(k for d in descriptions for k in d))
    lines = []
    for key in keys:
        values = [d.get(key, "(absent)") for d in descriptions]
        if len(set(values)) > 1:
            label = key.removeprefix("config.") if key.startswith("config.") else f"layer {key!r}"
            lines.append(f"  {label}: " + "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, values)))
    if not lines:  # the same entries in a different order
        lines = [f"  order: rank {r}: {list(d)}" for r, d in zip(ranks, descriptions)]
    return (
        "GIFT: the ranks of this group disagree on what to send, so their gradient sums would be wrong "
        "(or their collectives would not match); every rank must use the same config, layers and model:\n"
        + "\n".join(lines)
    )


__all__ = ["GiftConfigMismatch", "agree", "describe", "mismatch_message"]
