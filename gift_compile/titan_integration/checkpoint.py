"""GIFT state in torchtitan checkpoints.

The trainer adds a :class:`GiftCheckpointState` to the checkpointer's ``states`` dict under
``"gift"``; DCP then saves and restores it with the model and optimizer. Factors are the same
on every rank but error-feedback residuals are not, and DCP keeps one copy of a plain tensor
saved under the same key on several ranks, so every key carries the rank
(``rank{r}/<layer>/<buffer>``). Resuming therefore needs the same data-parallel world size.
Layer states must exist before a load (DCP loads into the tensors ``state_dict()`` returns):
the session creates the selected layers' states when the trainer is built. The checkpoint
also records which layers it holds state for, so a resume that whitens other layers (notably
``layers = "auto"``, which chooses only after profiling) fails with a clear error instead of
silently running without the saved state.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from gift_compile.runtime import GiftRuntime

KEY = "gift"
SELECTED = "selected_layers"


def mismatch_message(saved: list[str], current: list[str]) -> str:
    return (
        f"GIFT: the checkpoint holds state for the whitened layers {saved}, but this run whitens {current}. "
        "Resume with the same [gift] layers; a layers = \"auto\" run chooses its layers only after profiling and "
        "writes them to [gift] layers_file in its dump folder: pass that list back in as layers."
    )


def saved_layers(checkpoint_id: str) -> list[str]:
    """The layers a DCP checkpoint holds GIFT state for (from its metadata, without loading it)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    layers = set()
    for key in keys:
        _, _, rest = key.partition(f"{KEY}.rank0/layers.")
        if rest and not key.startswith(f"{KEY}.rank0/{SELECTED}"):
            layers.add(rest.rpartition(".")[0].replace("/", "."))
    return sorted(layers)


def explain_failed_loads(checkpointer, runtime: GiftRuntime) -> None:
    """A resume whose GIFT layers differ from the checkpoint's fails inside DCP ("Missing key
    ... gift.rank0/layers..."), before our ``load_state_dict`` runs: say what differs instead."""
    original = checkpointer.dcp_load

    def dcp_load(state_dict, checkpoint_id, *args, **kwargs):
        try:
            return original(state_dict, checkpoint_id, *args, **kwargs)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            if f"Missing key in checkpoint state_dict: {KEY}." not in f"{error!s}{error!r}":
                raise
            current = sorted(runtime.state.fqns())
            raise ValueError(mismatch_message(saved_layers(checkpoint_id), current)) from error

    checkpointer.dcp_load = dcp_load


class GiftCheckpointState(Stateful):
    def __init__(self, runtime: GiftRuntime) -> None:
        self.runtime = runtime

    @property
    def prefix(self) -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}/"

    def state_dict(self) -> dict[str, Any]:
        state = {self.prefix + k: v for k, v in self.runtime.state.state_dict().items()}
        state[self.prefix + SELECTED] = ",".join(self.selected())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own = {k[len(self.prefix):]: v for k, v in state_dict.items() if k.startswith(self.prefix)}
        saved = [fqn for fqn in own.pop(SELECTED).split(",") if fqn]
        if saved != self.selected():
            raise ValueError(mismatch_message(saved, self.selected()))
        self.runtime.state.load_state_dict(own, strict=True)

    def selected(self) -> list[str]:
        return sorted(self.runtime.state.fqns())


__all__ = ["KEY", "GiftCheckpointState", "explain_failed_loads", "saved_layers"]
