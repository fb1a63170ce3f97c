"""Run torchtitan 0.3.0 on a CPU-only torch with the gloo backend.

torchtitan 0.3.0 assumes an accelerator. Each shim below fixes one failure seen on torch
2.13.0+cpu with 2 gloo ranks, and is applied only when the condition that causes that failure
holds (no CUDA device, a missing attribute, gloo as the default backend). Nothing here runs on
import: the launcher's rank entry point calls :func:`apply_cpu_support` explicitly, before the
trainer is built. On a CUDA machine it applies nothing.

| shim                  | condition                            | error it avoids                                              |
|-----------------------|--------------------------------------|--------------------------------------------------------------|
| ``device_cpu``        | no CUDA device                       | ``torch._C`` has no ``_cuda_setDevice`` (device_type="cuda")  |
| ``set_timeout``       | ``torch.distributed.set_timeout`` missing | ``AttributeError`` in ``set_pg_timeouts`` after step 1   |
| ``pg_timeouts_barrier`` | no CUDA device                     | ``barrier(device_ids=["cpu"])`` ``TypeError``                 |
| ``fsdp_force_sum``    | gloo backend (checked when FSDP runs) | ``Cannot use ReduceOp.PREMUL_SUM with Gloo``                 |
| ``cpu_roofline``      | no CUDA device                       | ``0 active drivers`` (triton) in Inductor's runtime estimate  |

One more fix acts on a built model rather than on torchtitan's code, so the standard trainer
calls it after ``fully_shard``: :func:`overlap_fsdp_all_gathers` (gloo), without which FSDP2's
parameter all-gathers run between the blocks' compute instead of beside it.
"""

from __future__ import annotations

import logging
import os
import sys
import types

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

APPLIED: list[str] = []


class CpuDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda``-style calls torchtitan makes on ``device_module``
    (``metrics.DeviceMemoryMonitor``: device name and properties, memory stats, cache)."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 1 << 34
        return types.SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


CPU_DEVICE_MODULE = CpuDeviceModule()


def _device_cpu() -> None:
    # torchtitan.tools.utils computes `device_type = _get_available_device_type() or "cuda"` at
    # import time, and other modules copy it with `from ... import device_type, device_module`:
    # patch the source, then every copy already imported.
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", CPU_DEVICE_MODULE
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("torchtitan"):
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = CPU_DEVICE_MODULE


def _set_timeout() -> None:
    # torch 2.13 has ProcessGroup.set_timeout but no torch.distributed.set_timeout.
    def set_timeout(timeout, group=None):
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        pg.set_timeout(timeout)

    dist.set_timeout = set_timeout


def _pg_timeouts_barrier() -> None:
    # set_pg_timeouts calls barrier(device_ids=[device_module.current_device()]); on CPU that
    # id is the string "cpu", which BarrierOptions rejects. Same logic, no device_ids.
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout, parallel_dims):
        dist.barrier()
        groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in [*groups, None]:
            dist.set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def _fsdp_force_sum() -> None:
    # torchtitan calls set_gradient_divide_factor(1.0) on every FSDPModule, which makes FSDP2
    # reduce with PREMUL_SUM; gloo has no PREMUL_SUM (nor AVG). With factor 1.0 a plain SUM is
    # the same reduction, so force it, on gloo process groups only.
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor):
        original(self, factor)
        if dist.is_initialized() and dist.get_backend() == "gloo":
            self.set_force_sum_reduction_for_comms(True)

    set_gradient_divide_factor.__wrapped__ = original
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


CPU_DRAM_GBPS = 20.0
"""The memory bandwidth Inductor's roofline estimate assumes on a CPU (GB/s, one socket's order)."""


def _cpu_roofline() -> None:
    # graph_trainer's transformer-block bucketing/reordering pass (FSDP all-gather prefetch)
    # estimates each node's runtime with a roofline whose bandwidth comes from triton's GPU
    # driver. On a CPU it only needs a number of the right order: it ranks nodes, it times none.
    import torch.utils._runtime_estimation as estimation

    estimation.get_gpu_dram_gbps = lambda: CPU_DRAM_GBPS


def _fsdp_already_patched() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule.set_gradient_divide_factor, "__wrapped__")


def needed_shims() -> list[str]:
    """Names of the shims whose condition holds in this process."""
    no_cuda = not torch.cuda.is_available()
    names = []
    if no_cuda:
        names.append("device_cpu")
    if not hasattr(dist, "set_timeout"):
        names.append("set_timeout")
    if no_cuda:
        names.append("pg_timeouts_barrier")
    if not _fsdp_already_patched():
        names.append("fsdp_force_sum")
    if no_cuda:
        names.append("cpu_roofline")
    return names


_SHIMS = {
    "device_cpu": _device_cpu,
    "set_timeout": _set_timeout,
    "pg_timeouts_barrier": _pg_timeouts_barrier,
    "fsdp_force_sum": _fsdp_force_sum,
    "cpu_roofline": _cpu_roofline,
}


def apply_cpu_support() -> list[str]:
    """Apply every shim whose condition holds; returns their names (idempotent)."""
    applied = []
    for name in needed_shims():
        if name in APPLIED and name != "device_cpu":
            continue
        _SHIMS[name]()
        applied.append(name)
        if name not in APPLIED:
            APPLIED.append(name)
    if applied:
        log.info("gift-titan: applied torchtitan CPU/gloo shims %s", applied)
    return applied


def overlap_fsdp_all_gathers(model: nn.Module) -> int:
    """Let FSDP2's parameter all-gathers run beside compute on gloo; returns the number of FSDP
    units chained (0: not gloo, or ``model`` is not ``fully_shard``-ed; nothing changed).

    FSDP2 overlaps an all-gather with compute through CUDA streams: its pre-forward and
    pre-backward unshards are synchronous (``async_op=False``), which on a GPU only enqueues the
    collective on a side stream. With gloo a synchronous all-gather holds the host until every
    byte has arrived, so on a slow link each block's parameters travel while no compute runs.
    The unshards are made asynchronous (``FSDPModule._set_unshard_async_op``) and each FSDP unit
    prefetches the next one's parameters once its own have arrived: FSDP2's explicit forward
    prefetch, which ``async_op=True`` needs to overlap at all (its docstring). The backward's
    default prefetch (the reverse of the forward's order) then issues asynchronous work too.
    Values are unchanged: the same collectives, issued earlier and waited on where needed.

    The chain follows the units' registration order (``model.modules()``), which is their forward
    order in torchtitan's decoders: the root, ``tok_embeddings``, ``layers.*``, ``[norm, lm_head]``
    (one unit). A unit is one FSDP state, however many modules one ``fully_shard`` call grouped.
    Every unit runs in every forward there, so each prefetched all-gather is waited on in the
    same forward (FSDP2 would hand a unit that skipped a forward its pending parameters at the
    next one: that is why the trainer applies this to torchtitan's models only)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule) or not dist.is_initialized() or dist.get_backend() != "gloo":
        return 0
    units: dict[int, FSDPModule] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), module)
    chain = list(units.values())
    model._set_unshard_async_op(True)
    for unit, following in zip(chain, chain[1:]):
        unit.set_modules_to_forward_prefetch([following])
    return len(chain)


FSDP_BUCKETING_PASS = "joint_transformer_block_bucketing_reordering_pass"
"""graph_trainer's FSDP bucketing/prefetch pass (runs on CPU through the ``cpu_roofline`` shim)."""


def cpu_disabled_graph_passes() -> list[str]:
    """graph_trainer passes that fail without a GPU (empty when CUDA is available)."""
    if torch.cuda.is_available():
        return []
    # "Activation checkpoint rematerialization ... does not support RNG ops in recompute regions".
    # (The FSDP bucketing/prefetch pass runs: the ``cpu_roofline`` shim gives its estimate a bandwidth.)
    return ["selective_activation_remat_pass"]


__all__ = ["APPLIED", "CPU_DEVICE_MODULE", "FSDP_BUCKETING_PASS", "apply_cpu_support", "cpu_disabled_graph_passes", "needed_shims",
           "overlap_fsdp_all_gathers"]
