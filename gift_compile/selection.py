"""Which ``nn.Linear`` layers travel in whitened coordinates.

Patterns are matched with ``fnmatch`` component by component against the trailing
components of a dotted FQN: ``"w2"`` matches ``layers.0.feed_forward.w2`` but not
``layers.0.feed_forward.xw2`` (no substring matching), and ``"layers.[0-3].*.w2"`` matches
the ``w2`` of the first four blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from torch import nn


def pattern_matches(pattern: str, fqn: str) -> bool:
    wanted, parts = pattern.split("."), fqn.split(".")
    if len(wanted) > len(parts):
        return False
    return all(fnmatchcase(part, want) for part, want in zip(parts[-len(wanted) :], wanted))


def linear_fqns(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def linear_weight_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{fqn: (d_out, d_in)}`` of every ``nn.Linear`` (global shapes, also for DTensor weights
    and weights read through a parametrization)."""
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            for pname, param in module.named_parameters(recurse=True):
                if pname == "weight" or pname.endswith("weight.original"):
                    shapes[name] = tuple(param.shape)
                    break
    return shapes


def matching(candidates: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The candidate FQNs matched by any pattern (a pattern may match none of them)."""
    return [fqn for fqn in candidates if any(pattern_matches(p, fqn) for p in patterns)]


def check_patterns(candidates: Iterable[str], patterns: Sequence[str]) -> None:
    """Every pattern must match one of the model's Linear layers: a typo must not silently
    whiten nothing."""
    candidates = list(candidates)
    unmatched = [p for p in patterns if not any(pattern_matches(p, fqn) for fqn in candidates)]
    if unmatched:
        raise ValueError(
            f"GIFT layer pattern(s) {unmatched} match no Linear layer; Linear layers in this model: {candidates}"
        )


def select_layers(candidates: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The candidate FQNs matched by any pattern; every pattern must match something."""
    candidates = list(candidates)
    check_patterns(candidates, patterns)
    return matching(candidates, patterns)
