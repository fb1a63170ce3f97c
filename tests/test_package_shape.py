"""The package's import graph: layered, acyclic, and the library never imports its test helpers."""

from __future__ import annotations

from gift_compile.package_graph import import_graph as graph

# Lower layers first; a module may import only from its own layer or lower ones.
LAYERS = [
    {"config", "package_graph", "static_compile", "timing"},
    {"numerics", "geometry", "selection"},
    {"fp4"},
    {"collectives", "agreement"},
    {"comm", "policy"},
    {"meter"},
    {"state"},
    {"counters"},
    {"runtime"},
    {"layer_step"},
    {"ops", "fsdp", "replicate"},
    {"passes.graph_utils", "passes.overlap"},
    {"passes.time_meter", "passes.bucketing", "passes.pieces"},
    {"passes.gift_collectives"},
    {"passes.compiled_autograd"},
    {"backend", "reference"},
    {"titan_integration.cpu_support", "titan_integration.config", "titan_integration.autoselect", "titan_integration.datasets"},
    {"titan_integration.checkpoint", "titan_integration.graph_pass"},
    {"titan_integration.session"},
    {"titan_integration.trainer"},
    {"titan_integration.job_configs", "titan_integration.launcher", "titan_integration.entry"},
    {"testing.ranks", "testing.text", "testing.titan_jobs"},
]
LAYER_OF = {module: i for i, layer in enumerate(LAYERS) for module in layer}


def test_every_module_has_a_layer():
    assert set(graph()) == set(LAYER_OF)


def test_imports_point_down_the_layers_only():
    upward = [(a, b) for a, deps in graph().items() for b in deps if LAYER_OF[b] > LAYER_OF[a]]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    edges = graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(trail + [node, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [])


def test_the_library_does_not_import_its_test_helpers():
    library = {m: deps for m, deps in graph().items() if not m.startswith("testing.")}
    assert [(m, d) for m, deps in library.items() for d in deps if d.startswith("testing.")] == []
