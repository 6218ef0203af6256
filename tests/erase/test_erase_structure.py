"""`keras_erase`'s layout rules, read from the source of every module (subpackages included).

Every `import` / `from ... import` anywhere in a module counts, function-level
ones included, so the checks run the same on every backend:

- only `keras_erase/torch/` imports torch, and the backend-neutral code
  reaches `keras_erase.torch` through one door (`keras_erase.runtime`);
- the import graph is one-way: no module imports (even lazily) one that
  imports it back.
"""

import ast
import os

PACKAGE = "keras_erase"
ROOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), PACKAGE
)


def _sources():
    """`{module: path}` for every module of the package, named relative to it.

    `"model"`, `"torch.train_step"`; a package is named by its folder
    (`"torch.schedules"` for `torch/schedules/__init__.py`, `""` for the root).
    """
    sources = {}
    for folder, _, files in os.walk(ROOT):
        relative = os.path.relpath(folder, ROOT)
        prefix = "" if relative == "." else relative.replace(os.sep, ".")
        for name in files:
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            if stem == "__init__":
                module = prefix
            else:
                module = f"{prefix}.{stem}" if prefix else stem
            sources[module] = os.path.join(folder, name)
    return sources


def _imports(path):
    """`(module paths imported, names imported)` by every import statement of a file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def _resolve(module_path, name, modules):
    """The package module that `from module_path import name` (or `import module_path`) loads."""
    parts = module_path.split(".")[1:]
    target = ".".join(parts)
    if name is not None and (f"{target}.{name}" if target else name) in modules:
        return f"{target}.{name}" if target else name
    while target not in modules and target:
        target = target.rpartition(".")[0]
    return target


def import_graph():
    """`{module: set of package modules it imports}` for every module of the package."""
    sources = _sources()
    graph = {}
    for module, path in sources.items():
        deps = {
            _resolve(imported, name, sources)
            for imported, name in _imports(path)
            if imported.split(".")[0] == PACKAGE
        }
        graph[module] = deps - {module}
    return graph


def torch_importers():
    """Modules with an `import torch...` / `from torch... import` anywhere."""
    return sorted(
        module
        for module, path in _sources().items()
        if any(imported.split(".")[0] == "torch" for imported, _ in _imports(path))
    )


def _in_torch_package(module):
    return module == "torch" or module.startswith("torch.")


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


def test_the_layout_is_read_recursively():
    graph = import_graph()
    assert {
        "model", "detach_block", "runtime", "torch.train_step", "torch.schedules",
        "torch.schedules.placements", "torch.cuda_graphs.runner", "torch.distributed",
    } <= set(graph)
    assert "torch.schedules.placements" in graph["torch.schedules"]


def test_only_the_torch_package_imports_torch():
    importers = torch_importers()
    assert importers, "the scan found no torch import at all"
    assert [m for m in importers if not _in_torch_package(m)] == []


def test_the_backend_neutral_code_enters_the_torch_package_in_one_place():
    graph = import_graph()
    doors = sorted(
        module
        for module, deps in graph.items()
        if not _in_torch_package(module) and any(_in_torch_package(d) for d in deps)
    )
    assert doors == ["runtime"]


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_the_torch_step_layers_point_down():
    graph = import_graph()
    assert "torch.schedules.base" in graph["torch.schedules"]
    assert "torch.schedules" not in graph["torch.schedules.base"]
    assert graph["torch.tensors"] == set()
    assert "model" not in graph["torch.train_step"]
    assert not any(_in_torch_package(d) for d in graph["model"])
