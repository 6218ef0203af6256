"""Layout rules of both packages, read from the source tree (every backend)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 400  # small files, one job per module (docs/development.md)


def _modules():
    for package in ("keras_cutbce", "keras_erase"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), REPO)


def test_no_package_module_is_over_400_lines():
    sizes = {}
    for path in _modules():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            sizes[path] = sum(1 for _ in f)
    assert len(sizes) > 50  # the walk finds the code
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, (
        f"modules over {MAX_LINES} lines (split them by job, as docs/development.md's layout "
        f"does): {over}"
    )
