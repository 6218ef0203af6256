"""Layout rules of both packages, read from the source tree (every backend; docs/development.md)."""

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("jax", "torch", "tensorflow")
# The modules of a backend folder that more than one implementation imports:
# the loss families (`math.py`) and, on JAX, the one custom_vjp (`vjp.py`).
SHARED = {"math", "vjp"}


def _modules(packages=("keras_cutbce",)):  # keras_erase: one module per job (below)
    for package in packages:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), REPO)


def _imports(path):
    """`(module, top_level)` for every `keras_cutbce` module `path` imports (`from a import b`: `a.b`)."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("keras_cutbce"):
            for alias in node.names:
                yield f"{node.module}.{alias.name}", id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("keras_cutbce"):
                    yield alias.name, id(node) in top


def _is_module(dotted):
    base = os.path.join(REPO, *dotted.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def test_each_registry_implementation_names_one_module():
    from keras_cutbce.registry import FITS, IMPLEMENTATIONS

    paths = [p for op in IMPLEMENTATIONS.values() for impl in op.values() for p in impl.values()]
    assert len(paths) > 20  # the registry is read
    for path in paths + list(FITS.values()):
        module, _, function = path.partition(":")
        assert function and _is_module(module), path


def test_each_chunked_implementation_is_one_module_beside_the_shared_ones():
    """`backends/<b>/chunked.py` imports only `math.py` (and JAX's `vjp.py`) from its folder."""
    for backend in BACKENDS:
        folder = f"keras_cutbce.backends.{backend}"
        for name in ("chunked", "math", "retrieval"):
            assert _is_module(f"{folder}.{name}"), (backend, name)
        own = {
            module[len(folder) + 1:].split(".")[0]
            for module, _ in _imports(f"keras_cutbce/backends/{backend}/chunked.py")
            if module.startswith(folder + ".")
        }
        assert own <= SHARED, (backend, own - SHARED)


def test_backend_folders_never_import_each_other():
    """And the backend-neutral modules import a backend only inside a function (lazily)."""
    found = 0
    for path in _modules():
        parts = path[:-3].split(os.sep)
        mine = parts[2] if parts[:2] == ["keras_cutbce", "backends"] and len(parts) > 3 else None
        for module, top_level in _imports(path):
            other = module.split(".")
            if other[:2] != ["keras_cutbce", "backends"] or len(other) < 3:
                continue
            found += 1
            if mine is None:
                assert not top_level, f"{path} imports {module} at import time"
            else:
                assert other[2] == mine, f"{path} imports {module}"
    assert found > 10  # the walk reads the imports


def test_no_module_reaches_into_another_modules_private_names():
    """Code two modules share is imported by its public name (issue 51): no `from m import _f` and no
    `m._f` on an imported package module, `_keras_private` (the one door to Keras's private API) aside."""
    imported, wrong = 0, []
    for path in _modules(("keras_cutbce", "keras_erase")):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        modules = set()  # the local names of this package's modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("keras_cutbce", "keras_erase"):
                for alias in node.names:
                    imported += 1
                    if alias.name.startswith("_") and not alias.name.startswith("__") and alias.name != "_keras_private":
                        wrong.append(f"{path}: from {node.module} import {alias.name}")
                    if _is_module(f"{node.module}.{alias.name}"):
                        modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules.update(a.asname for a in node.names if a.asname and a.name.startswith("keras_"))
        modules.discard("_keras_private")
        wrong += [f"{path}:{node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in modules and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert imported > 200  # the walk reads the imports
    assert wrong == []


def test_every_keras_erase_module_is_in_the_layout_and_every_listed_one_exists():
    """keras_erase's rule: one job per module, each named with its job in docs/development.md."""
    import re

    with open(os.path.join(REPO, "docs", "development.md"), encoding="utf-8") as f:
        text = f.read()
    layout = text[text.index("keras_erase/    "):text.index("examples/       ")]
    listed = set(re.findall(r"[a-z_]+\.py", layout))
    modules = {os.path.basename(p) for p in _modules(("keras_erase",))} - {"__init__.py"}
    assert len(modules) > 25  # the walk finds the code
    assert modules - listed == set(), "keras_erase modules missing from the layout"
    assert listed - modules - {"__init__.py"} == set(), "the layout names modules that are gone"


def test_benchmarks_and_tools_are_in_the_layout_and_out_of_the_packages():
    """One script per benchmark area, the compiler tools in tools/; the packages import neither."""
    import re

    with open(os.path.join(REPO, "docs", "development.md"), encoding="utf-8") as f:
        text = f.read()
    for folder, end in (("benchmarks", "tools/          "), ("tools", "scripts/        ")):
        layout = text[text.index(f"{folder}/ "):text.index(end)]
        listed = set(re.findall(r"[a-z_0-9]+\.py", layout))
        scripts = {name for name in os.listdir(os.path.join(REPO, folder)) if name.endswith(".py")}
        assert scripts - listed == set(), f"{folder}/ scripts missing from the layout"
        assert listed - scripts == set(), "the layout names scripts that are gone"
    imports = re.compile(r"^\s*(?:from|import) (?:benchmarks|tools)\b", re.M)
    for path in _modules(("keras_cutbce", "keras_erase")):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            assert not imports.search(f.read()), f"{path} imports benchmarks/ or tools/"


def test_tests_import_only_the_benchmark_plans_and_tools_never_import_benchmarks():
    """A benchmark runs as a script: tests import only its plan (`erase_gpu_plan`) or record (`sasrec_study`)
    modules; tools/ (compiler readers) never import benchmarks/, whose harness imports them."""
    import re

    imports = re.compile(r"^\s*(?:from benchmarks(?:\.(\w+))? import (\w+)|import benchmarks\.?(\w*))", re.M)
    allowed = {"erase_gpu_plan", "sasrec_study"}
    found = {"tests": 0, "tools": 0}
    for top in found:
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in (n for n in files if n.endswith(".py")):
                found[top] += 1
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    for match in imports.finditer(f.read()):
                        module = match.group(1) or match.group(3) or match.group(2)
                        assert top == "tests" and module in allowed, f"{top}/{name} imports benchmarks.{module}"
    assert found["tests"] > 20 and found["tools"] > 5  # the walks find the files


# benchmarks/*.py in all: fold what scripts share into benchmarks/common.py. Issue 51's goal is 3,500 (met:
# 3,479 lines, cutbce_cpu.py's 528 among them); a ratchet, lowered as they fold.
BENCHMARK_LINES = 3490
OLDER_CODE = re.compile(r"before|after|round_(?:one|two|three)|session_change|_vs_|_old\b|previous")
MACHINE_PATH = re.compile(r"(?<![\w.$])/(?:tmp|home|root|Users|work)/")


def test_benchmark_scripts_stay_small():
    """What scripts share lives in the harness, benchmarks/common.py (a ratchet under issue 51's 3,500 lines)."""
    scripts = [os.path.join(REPO, "benchmarks", n) for n in os.listdir(os.path.join(REPO, "benchmarks"))
               if n.endswith(".py")]
    lines = sum(sum(1 for _ in open(p, encoding="utf-8")) for p in scripts)
    assert 1000 < lines <= BENCHMARK_LINES, f"benchmarks/*.py: {lines} lines (at most {BENCHMARK_LINES})"


def test_results_describe_today():
    """results/ holds today's tables: none named after older code (history lives in git and the CHANGELOG),
    none naming a machine's paths, no raw profiler trace."""
    results = os.path.join(REPO, "benchmarks", "results")
    checked = 0
    for folder, _, files in os.walk(results):
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), results)
            assert not OLDER_CODE.search(path), f"results/{path} is named after older code"
            assert "_trace_" not in name or not name.endswith(".json"), f"results/{path}: a raw trace"
            if name.endswith((".md", ".json", ".txt", ".log")):
                checked += 1
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    found = MACHINE_PATH.search(f.read())
                assert not found, f"results/{path} names a machine path ({found and found.group(0)})"
    assert checked > 20  # the walk reads the results


# Docstring lines over all lines of a package: the math and each contract written once, history in docs/ and
# the CHANGELOG (issue 51: at most 16%; 15.9% and 15.1% when this rule landed).
DOCSTRING_SHARE = 0.16


def test_docstrings_stay_short():
    """Docstrings (module, class and function) stay at most `DOCSTRING_SHARE` of each package's lines."""
    for package in ("keras_cutbce", "keras_erase"):
        total = docs = 0
        for path in _modules((package,)):
            with open(os.path.join(REPO, path), encoding="utf-8") as f:
                source = f.read()
            total += len(source.splitlines())
            for node in ast.walk(ast.parse(source)):
                kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
                if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
                    docs += node.body[0].end_lineno - node.body[0].lineno + 1
        assert total > 1000 and docs / total <= DOCSTRING_SHARE, f"{package}: {docs}/{total} docstring lines"


def _module_index(path):
    """`(functions, imports)` of a module: `{"f" | "Class.m": FunctionDef}` and `{local name: dotted target}`."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    functions = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            functions.update({f"{node.name}.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)})
    imports = {alias.asname or alias.name: f"{node.module}.{alias.name}" for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras_cutbce")
               for alias in node.names}
    return functions, imports


def _path_of(dotted):
    """The file of a dotted name `pkg.module[.name[.attr]]`, and the name inside it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = os.path.join(*parts[:cut])
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(os.path.join(REPO, candidate)):
                return candidate, ".".join(parts[cut:])
    return None, None


def _mentions(node, names):
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _walk(path, name, param, entered, seen):
    """Appends to `entered` the file of each package function `param` (or a value made from it) is passed to."""
    if (path, name) in seen:  # walked already
        return
    seen.add((path, name))
    functions, imports = _module_index(path)
    function = functions[name]
    tracked = {param}
    nodes = sorted((n for n in ast.walk(function) if isinstance(n, (ast.Call, ast.Assign))),
                   key=lambda n: (n.lineno, n.col_offset))
    for node in nodes:
        if isinstance(node, ast.Assign):
            if _mentions(node.value, tracked):
                tracked |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            continue
        func, target = node.func, None
        if isinstance(func, ast.Name):
            target = (path, func.id) if func.id in functions else _path_of(imports.get(func.id, ""))
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner == "self" and "." in name:
                target = (path, f"{name.split('.')[0]}.{func.attr}")
            elif owner in imports:
                target = _path_of(f"{imports[owner]}.{func.attr}")
        if target is None or target[0] is None:
            continue
        callee = _module_index(target[0])[0].get(target[1])
        if callee is None:
            continue
        params = [a.arg for a in callee.args.args]
        params = params[1:] if params[:1] == ["self"] else params
        passed = [(params[i], a) for i, a in enumerate(node.args[:len(params)]) if not isinstance(a, ast.Starred)]
        passed += [(k.arg, k.value) for k in node.keywords if k.arg in params + [a.arg for a in callee.args.kwonlyargs]]
        for callee_param, argument in passed:
            if _mentions(argument, tracked) and target not in seen:
                entered.append(target[0])
                _walk(target[0], target[1], callee_param, entered, seen)


# Each loss's way from its entry to the registry's kernel call, followed along its hidden states.
LOSS_ENTRIES = [
    ("keras_cutbce/loss.py", "CutLoss.call", "y_pred"),
    ("keras_cutbce/ops.py", "cut_binary_crossentropy", "hidden"),
    ("keras_cutbce/ops.py", "weighted_loss_sum", "hidden"),
    ("keras_cutbce/softmax.py", "cut_categorical_crossentropy", "hidden"),
]


def test_each_loss_takes_one_straight_path_to_its_kernel():
    """A loss's hidden states go from its module to the checks, then to the registry, which calls the
    implementation (docs/development.md): the files they enter, in order, never return to one left."""
    for path, name, param in LOSS_ENTRIES:
        entered = [path]
        _walk(path, name, param, entered, set())
        files = [f for i, f in enumerate(entered) if i == 0 or f != entered[i - 1]]
        assert files[:3] == [path, "keras_cutbce/checks.py", "keras_cutbce/registry.py"], (name, files)
        assert len(files) == len(set(files)), (name, files)
