"""Layout rules of both packages, read from the source tree (every backend)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 400  # small files, one job per module (docs/development.md)


def _modules(packages=("keras_cutbce",)):  # keras_erase: one module per job (below)
    for package in packages:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), REPO)


def test_no_package_module_is_over_400_lines():
    sizes = {}
    for path in _modules():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            sizes[path] = sum(1 for _ in f)
    assert len(sizes) > 40  # the walk finds the code
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, (
        f"modules over {MAX_LINES} lines (split them by job, as docs/development.md's layout "
        f"does): {over}"
    )


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
