"""``gift_backend(config)``: a torch.compile backend (AOTAutograd + Inductor) running the GIFT pass.

    compiled = torch.compile(model, backend=gift_backend(GiftConfig(layers=("fc2",))))

For each graph Dynamo hands over, the backend reads which ``nn.Linear`` layers it contains
(from ``nn_module_stack``; in compiled-autograd graphs, from the parameters they accumulate
into, see passes/compiled_autograd.py), selects those the config's patterns match, and
compiles with Inductor, with the GIFT pass installed as ``post_grad_custom_pre_pass`` (before
Inductor's own DDP bucketing). A model with graph breaks is several graphs, each with some of
its Linear layers, so a pattern may match nothing in one of them; it is an error (listing the
Linear FQNs seen) only if it matches nothing in any graph, checked when the first backward is
compiled: by then every forward graph of the first step has been seen.

The pass object is a ``CustomGraphPass`` whose ``uuid()`` covers the config, the namespace,
the graph's Linear FQNs and the source of every package module the pass module imports,
directly or not (``package_graph.source_files``: derived from the import graph, never a
hand-kept list), so Inductor's FX graph cache stays on, replays no graph made by older code,
and two structurally identical graphs of different layers never share a cache entry (their
state keys are baked into the code).

Every backend owns its state (``backend.state``, ``backend.runtime``): a second
``gift_backend(config)`` gets a fresh one under a new generated namespace, unless it asks to
share with ``share_state_with=``. A backend refuses a second model whose Linear layer has the
FQN of one it already serves (their states would mix).
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist
from torch import fx
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.weak import WeakIdKeyDictionary

from gift_compile.config import GiftConfig
from gift_compile.package_graph import source_files
from gift_compile.passes.compiled_autograd import LinearWeight, output_fqns, remember_linear_weights, tag_outputs
from gift_compile.passes.gift_collectives import find_gradient_collectives, gift_collectives_pass
from gift_compile.passes.graph_utils import is_linear_type, module_fqn
from gift_compile.passes.overlap import collectives_of, overlap_gradient_collectives
from gift_compile.passes.pieces import send_in_pieces
from gift_compile.runtime import GiftRuntime, is_registered, new_runtime
from gift_compile.selection import check_patterns, linear_weight_shapes, matching

log = logging.getLogger(__name__)

# Every module whose code the pass traces into a graph, or that runs when the graph does
# (layer_step, ops, runtime, state, ...): what the pass module imports, transitively.
_PASS_FILES = tuple(str(path) for path in source_files("backend"))


class GiftGraphPass(CustomGraphPass):
    """The GIFT pass as Inductor sees it: callable on a graph, with a cache-safe ``uuid``."""

    def __init__(
        self,
        config: GiftConfig,
        namespace: str,
        linears: tuple[str, ...],
        selected: frozenset[str],
        output_weights: tuple[LinearWeight | None, ...] | None = None,
    ) -> None:
        self.config, self.namespace, self.linears, self.selected = config, namespace, linears, selected
        self.output_weights = output_weights  # compiled-autograd graphs: the Linear weight behind each output
        self.before_backward = None  # the backend's check of its patterns against every graph seen
        self.saw_backward_without_collectives = False
        self.calls = 0  # graphs this pass rewrote in this process (0 on FX-graph-cache hits)
        self.collective_calls: list[int] = []  # collectives each rewritten graph issues per run

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1
        if self.output_weights is not None:
            tag_outputs(graph, self.output_weights)
        is_backward = any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder"))
        if is_backward and self.before_backward is not None:
            self.before_backward()
        if is_backward and not find_gradient_collectives(graph):
            self.saw_backward_without_collectives = True
            log.warning(
                "GIFT: this backward graph has no gradient collectives (all_reduce / reduce_scatter_tensor), "
                "so there is nothing to compress; gradients are whatever the training loop reduces itself. "
                "Use gift_compile.replicate(model) or DTensor Replicate parameters to put them in the graph."
            )
            return
        gift_collectives_pass(graph, self.config, self.namespace, self.selected)
        send_in_pieces(graph, self.config.wire_piece_kib * 1024)
        if self.config.overlap:
            overlap_gradient_collectives(graph)
        self.collective_calls.append(len(collectives_of(graph)))

    def uuid(self) -> bytes:
        digest = hashlib.sha256(get_hash_for_files(_PASS_FILES))
        # the collectives the pass traces depend on the backend (on gloo: all-gathers as
        # all_to_alls, messages in pieces), so a graph compiled for one must not replay on another
        backend = dist.get_backend() if dist.is_initialized() else None
        digest.update(repr((self.config, self.namespace, self.linears, sorted(self.selected), self.output_weights, backend)).encode())
        return digest.hexdigest().encode()


class GiftBackend:
    """A torch.compile backend; ``.state`` is the checkpointable GIFT state, ``.runtime`` the counters."""

    def __init__(self, config: GiftConfig, name: str = "gift", *, share_state_with: GiftBackend | None = None) -> None:
        if config.layers == "auto":
            raise ValueError("layers='auto' is resolved by the torchtitan integration's profiling run; give patterns here")
        self.config = config
        if share_state_with is not None:
            if share_state_with.config != config:
                raise ValueError("gift_backend(share_state_with=...): a shared state needs the same GiftConfig")
            self.name, self.runtime = share_state_with.name, share_state_with.runtime
        else:
            self.name, self.runtime = new_runtime(name, config)
        self.passes: list[GiftGraphPass] = []
        # Linear weight -> FQN, from forward graphs: compiled-autograd graphs name only parameters.
        self.linear_weights = WeakIdKeyDictionary()
        self.linears_seen: dict[str, None] = {}  # every Linear FQN of every graph, in first-seen order

    @property
    def state(self) -> torch.nn.Module:
        return self.runtime.state

    def load_state_dict(self, state_dict, model: torch.nn.Module | None = None) -> None:
        """Restore ``state.state_dict()`` (this rank's, from the same number of ranks), checked
        first (``GiftState.load_state_dict``), also against ``model``'s Linear shapes if given."""
        self.runtime.state.load_state_dict(state_dict, shapes=linear_weight_shapes(model) if model is not None else None)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        if not self.config.enabled:
            return compile_fx(gm, example_inputs)
        linears = linear_layers(gm)
        weight_inputs = remember_linear_weights(gm, linears, self.linear_weights)
        output_weights = output_fqns(gm, self.linear_weights)
        if output_weights is not None:
            linears = [w.fqn for w in output_weights if w is not None]
        self.linears_seen.update(dict.fromkeys(linears))
        selected = frozenset(matching(linears, self.config.layers))
        graph_pass = GiftGraphPass(self.config, self.name, tuple(linears), selected, output_weights)
        graph_pass.before_backward = self.check_patterns
        self.passes.append(graph_pass)
        compiled = compile_fx(gm, example_inputs, config_patches={"post_grad_custom_pre_pass": graph_pass})
        return self._claiming(compiled, weight_inputs) if weight_inputs else compiled

    def _claiming(self, compiled, weight_inputs: list[tuple[int, str]]):
        """``compiled``, checking at every call that its Linear weights are the ones this
        backend's state serves (``GiftRuntime.claim``): Dynamo may reuse one compiled graph for a
        second model of the same class, whose layers would then share the first one's state."""
        claim = self.runtime.claim

        def run(*args):
            for position, fqn in weight_inputs:
                claim(fqn, args[position])
            return compiled(*args)

        return run


    def check_patterns(self) -> None:
        """Raise if a layer pattern matches no Linear layer of any graph seen so far."""
        check_patterns(self.linears_seen, self.config.layers)


def linear_layers(gm: fx.GraphModule) -> list[str]:
    """FQNs of the ``nn.Linear`` modules a Dynamo graph calls, in first-use order."""
    found: dict[str, None] = {}
    for node in gm.graph.nodes:
        for path, module_type in (node.meta.get("nn_module_stack") or {}).values():
            if is_linear_type(module_type):
                found.setdefault(module_fqn(path))
    return list(found)


def gift_backend(config: GiftConfig | None = None, name: str = "gift", *, share_state_with: GiftBackend | None = None) -> GiftBackend:
    """The backend for ``torch.compile(model, backend=gift_backend(config))``.

    Each call owns a fresh state (``.state``, ``.runtime``); ``name`` only labels it (logs, the
    generated namespace). ``share_state_with=other`` reuses ``other``'s state instead: for
    several compiled functions of one model (a train step and an eval step), never for two models.
    """
    config = config or (share_state_with.config if share_state_with is not None else GiftConfig())
    return GiftBackend(config, name, share_state_with=share_state_with)


_DEFAULT: GiftBackend | None = None


def default_backend() -> GiftBackend:
    """The backend behind ``torch.compile(model, backend="gift")`` (default ``GiftConfig``): its
    ``.runtime.table()`` and ``.state`` are this process's. One model per process with it; give
    more models a ``gift_backend()`` each."""
    global _DEFAULT
    if _DEFAULT is None or not is_registered(_DEFAULT.name, _DEFAULT.runtime):  # runtimes forgotten (a test pool)
        _DEFAULT = gift_backend(GiftConfig(), name="gift")
    return _DEFAULT


def default_gift_backend(gm: fx.GraphModule, example_inputs):
    """``torch.compile(model, backend="gift")``: :func:`default_backend` (entry point)."""
    return default_backend()(gm, example_inputs)
