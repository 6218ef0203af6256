"""The packages' import graph has no cycle: every import, at module level or inside a function."""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(package):
    """Returns {dotted module name: path} of a package's modules (`pkg.sub` for `pkg/sub/__init__.py`)."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(REPO, package)):
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, name), REPO)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = os.path.join(folder, name)
    return modules


def _imports(path, name, modules):
    """The package modules `path` imports: `from a import b` is `a.b` when that is a module, else `a`."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {module for module in found if module in modules and module != name}


def _cycle(graph):
    """Returns one import cycle of `graph` as a list of modules, or None."""
    state = {}

    def visit(module, stack):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target, stack + [target])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("package", ["keras_cutbce"])
def test_no_import_cycle(package):
    modules = _modules(package)
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 50  # the parser sees the imports
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
