"""``layers = "auto"``: choose the layers to whiten from FP8 boundary hits (paper, Figure 3).

During the first ``auto_profile_steps`` steps every Linear weight gradient travels as
Euclidean FP8 and the runtime counts, per layer, the elements that saturated or flushed to
zero (``LayerCounters.saturated`` / ``flushed``). The boundary-hit rate of a layer is those
hits per element sent. Layers are ranked by rate; the chosen ones are the top
``auto_max_layers`` or, without a cap, those before the largest drop between consecutive
rates. Layers with no hit at all are never chosen. Ranks sum their counts first
(:func:`global_hit_counts`), so every rank chooses the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LayerHitRate:
    fqn: str
    hits: int
    elements: int

    @property
    def rate(self) -> float:
        return self.hits / self.elements if self.elements else 0.0


def global_hit_counts(counters: dict, numel: dict[str, int], group=None, device: torch.device | None = None) -> list[LayerHitRate]:
    """Per-layer hits summed over the ranks of ``group`` (the default group when None); the
    sum runs on ``device``, the one the group's backend takes (NCCL: the rank's GPU)."""
    fqns = sorted(f for f in numel if f in counters)
    local = torch.tensor(
        [[counters[f].saturated + counters[f].flushed, numel[f] * counters[f].steps] for f in fqns], dtype=torch.float64, device=device
    ).reshape(-1, 2)
    if dist.is_initialized():
        dist.all_reduce(local, group=group)
    return [LayerHitRate(f, int(h), int(e)) for f, (h, e) in zip(fqns, local.tolist())]


def choose_layers(rates: list[LayerHitRate], max_layers: int | None = None) -> list[str]:
    """FQNs to whiten, highest boundary-hit rate first (module docstring)."""
    ranked = sorted((r for r in rates if r.hits > 0), key=lambda r: (-r.rate, r.fqn))
    if not ranked:
        return []
    if max_layers is not None:
        return [r.fqn for r in ranked[:max_layers]]
    if len(ranked) == 1:
        return [ranked[0].fqn]
    drops = [ranked[i].rate - ranked[i + 1].rate for i in range(len(ranked) - 1)]
    # the drop after the last layer with hits (to zero) counts too
    drops.append(ranked[-1].rate)
    cut = max(range(len(drops)), key=lambda i: (drops[i], -i))
    return [r.fqn for r in ranked[: cut + 1]]


def layers_toml(chosen: list[str], rates: list[LayerHitRate], steps: int) -> str:
    """The ``[gift]`` table a later run can reuse, with the profile as comments."""
    lines = [f"# chosen by layers = \"auto\" after {steps} profiling steps (boundary hits per element sent)"]
    for r in sorted(rates, key=lambda r: (-r.rate, r.fqn)):
        lines.append(f"# {r.fqn:40s} {r.rate:.3e}{'  <- chosen' if r.fqn in chosen else ''}")
    quoted = ", ".join(f'"{f}"' for f in chosen)
    lines += ["[gift]", f"layers = [{quoted}]", ""]
    return "\n".join(lines)


__all__ = ["LayerHitRate", "choose_layers", "global_hit_counts", "layers_toml"]
