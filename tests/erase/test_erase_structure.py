"""`keras_erase`'s import graph is one-way: no module imports (even lazily) one that imports it back.

Read from the source (every `import`/`from ... import` anywhere in a module,
function-level ones included), so it runs the same on every backend.
"""

import ast
import os

PACKAGE = "keras_erase"
ROOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), PACKAGE
)


def import_graph():
    """`{module: set of sibling modules it imports}` for every module of the package."""
    modules = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}
    graph = {}
    for module in modules:
        with open(os.path.join(ROOT, module + ".py")) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == PACKAGE:
                    deps.update(parts[1:2] or [a.name for a in node.names])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == PACKAGE:
                        deps.update(parts[1:2])
        graph[module] = (deps & modules) - {module, "__init__"}
    return graph


def cycles(graph):
    """Every import cycle, as the list of modules on it (depth-first search)."""
    found, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"dispatch", "streams", "cuda_graphs", "model", "torch_step"} <= set(graph)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_the_torch_step_layers_point_down():
    graph = import_graph()
    assert "streams" in graph["dispatch"] and "dispatch" not in graph["streams"]
    assert "torch_tensors" in graph["streams"] and graph["torch_tensors"] == set()
    assert "model" not in graph["torch_step"]
