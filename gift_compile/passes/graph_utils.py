"""Small FX helpers shared by the passes."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.operator_schemas import normalize_function
from torch.fx.passes.shape_prop import _extract_tensor_metadata


def splice_traced(
    graph: fx.Graph, fn: Callable[..., Any], args: list[fx.Node], *, before: fx.Node | None = None, after: fx.Node | None = None
) -> Any:
    """Trace ``fn`` on the fake values of ``args`` and copy its nodes into ``graph``, right
    ``before`` or ``after`` a node (``after`` a placeholder means before the first computation).

    The trace uses Inductor's decomposition table, so the copied nodes are post-grad ATen
    (e.g. ``clamp`` becomes ``clamp_min``/``clamp_max``), as ``pattern_matcher.fwd_only`` does.
    Every copied node keeps ``meta['val']`` and gets ``meta['tensor_meta']``. Returns ``fn``'s
    result with each tensor replaced by the node holding it (``None`` stays ``None``).
    """
    if (before is None) == (after is None):
        raise ValueError("give exactly one of before= and after=")
    fake_args = [a.meta["val"] for a in args]
    # Factory ops inside fn (zeros_like, arange) must create fake tensors of the same mode.
    with detect_fake_mode(fake_args), enable_python_dispatcher():
        traced = make_fx(fn, select_decomp_table(), tracing_mode="real")(*fake_args)
    placeholders = traced.graph.find_nodes(op="placeholder")
    env: dict[fx.Node, Any] = dict(zip(placeholders, args))
    result = None
    with _insertion_point(graph, before, after):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = fx.map_arg(node.args[0], lambda n: env[n])
                continue
            copied = graph.node_copy(node, lambda n: env[n])
            _add_tensor_meta(copied)
            env[node] = copied
    return result


def call_arguments(node: fx.Node) -> dict:
    """A call's arguments by name, positional or not (a collective's ``group_name``, split sizes)."""
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def waited_once(collective: fx.Node) -> bool:
    """Waited on by one ``wait_tensor`` and read by nothing else: a collective a pass may replace
    by rewiring that wait's users."""
    return len(collective.users) == 1 and next(iter(collective.users)).target is torch.ops._c10d_functional.wait_tensor.default


def equal_chunks(all_to_all: fx.Node) -> bool:
    """An ``all_to_all_single`` that sends and receives the same chunk size to and from every rank
    (what ``collectives.all_to_all`` issues)."""
    arguments = call_arguments(all_to_all)
    chunks = arguments["input_split_sizes"]
    return arguments["output_split_sizes"] == chunks and len(set(chunks)) == 1


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that reads ``node``'s value, directly or through others."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _insertion_point(graph: fx.Graph, before: fx.Node | None, after: fx.Node | None):
    if before is not None:
        return graph.inserting_before(before)
    if after.op == "placeholder":  # placeholders stay first: insert before the first computation
        first = next(n for n in graph.nodes if n.op != "placeholder")
        return graph.inserting_before(first)
    return graph.inserting_before(after.next)  # inserting_after(n) would put each new node right after n: reversed


def _add_tensor_meta(node: fx.Node) -> None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)


_MODULE_PATH_RULES = [
    (re.compile(r"^L\['[^']*'\]"), ""),  # dynamo's root: L['self'] / L['mod']
    (re.compile(r"\._modules\['([^']+)'\]"), r".\1"),
    (re.compile(r"\[(\d+)\]"), r".\1"),
    (re.compile(r"\['([^']+)'\]"), r".\1"),
    (re.compile(r"\.parametrizations\.[^.]+\.original$"), ""),
]


def module_fqn(dynamo_path: str) -> str:
    """``"L['self'].layers[0].feed_forward.w2"`` -> ``"layers.0.feed_forward.w2"``."""
    path = dynamo_path
    for pattern, replacement in _MODULE_PATH_RULES:
        path = pattern.sub(replacement, path)
    return path.lstrip(".")


def innermost_module(node: fx.Node) -> tuple[str, Any] | None:
    """``(fqn, module type)`` of the innermost module a node came from, from its meta.

    ``meta['custom']['module_fqn']`` (torchtitan's graph_trainer, ``fx.traceback.annotate``)
    wins; otherwise the last entry of ``fwd_nn_module_stack`` (backward nodes) or
    ``nn_module_stack`` (forward nodes). The type is None when only the custom FQN is known.
    """
    custom = node.meta.get("custom") or {}
    if isinstance(custom, dict) and custom.get("module_fqn"):
        return custom["module_fqn"], None
    for key in ("fwd_nn_module_stack", "nn_module_stack"):
        stack = node.meta.get(key)
        if stack:
            path, module_type = list(stack.values())[-1]
            return module_fqn(path), module_type
    return None


def is_linear_type(module_type: Any) -> bool:
    if isinstance(module_type, type):
        return issubclass(module_type, torch.nn.Linear)
    return isinstance(module_type, str) and module_type.rsplit(".", 1)[-1] in ("Linear", "NonDynamicallyQuantizableLinear")
