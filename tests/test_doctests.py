"""Runs the `>>>` examples of every module of `keras_cutbce` and `keras_erase`.

Once per Keras backend, like the rest of the suite. A docstring example must
print the same text on every backend (e.g. `tuple(x.shape)`, not `x.shape`,
whose repr is `torch.Size([...])` on torch and `TensorShape([...])` on
TensorFlow), so the comparison is doctest's own, with `ELLIPSIS` and
`NORMALIZE_WHITESPACE` only.

The modules are listed from the source tree, not by importing the packages,
so a module that needs a library that is not installed is still listed, and
skips with the reason: modules of one backend (`keras_cutbce.backends.<b>`,
`keras_erase.torch`) run under that backend only, and a module whose import
needs a missing backend library skips, naming it.
"""

import doctest
import importlib
import os

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("keras_cutbce", "keras_erase")
BACKENDS = ("jax", "torch", "tensorflow")
OPTIONAL_LIBRARIES = ("jax", "jaxlib", "libtpu", "torch", "triton", "tensorflow")


def module_backend(name):
    """The Keras backend a module belongs to, or None for backend-neutral modules.

    Example:

    >>> module_backend("keras_cutbce.backends.jax.chunked"), module_backend("keras_erase.torch")
    ('jax', 'torch')
    >>> module_backend("keras_cutbce.ops") is None
    True
    """
    parts = name.split(".")
    if len(parts) >= 3 and parts[:2] == ["keras_cutbce", "backends"] and parts[2] in BACKENDS:
        return parts[2]
    if len(parts) >= 2 and parts[:2] == ["keras_erase", "torch"]:
        return "torch"
    return None


def module_names():
    """Every module of the packages, read from the source files."""
    names = []
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            prefix = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            for file in sorted(files):
                if not file.endswith(".py"):
                    continue
                stem = file[:-3]
                names.append(prefix if stem == "__init__" else f"{prefix}.{stem}")
    return sorted(names)


def _import_or_skip(name):
    backend = module_backend(name)
    if backend is not None and backend != keras.backend.backend():
        pytest.skip(f"{name} runs under KERAS_BACKEND={backend}")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing in OPTIONAL_LIBRARIES:
            pytest.skip(f"{name} needs {missing}, which is not installed")
        raise


def _examples(module):
    return [t for t in doctest.DocTestFinder().find(module) if t.examples]


# Interpreted Pallas kernels take seconds per example.
SLOW_PREFIXES = ("keras_cutbce.backends.jax.pallas",)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n.startswith(SLOW_PREFIXES) else n
    for n in module_names()
])
def test_docstring_examples(name):
    module = _import_or_skip(name)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    report = []
    for test in _examples(module):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)


def test_the_module_list_covers_both_packages_and_their_subpackages():
    names = module_names()
    assert {"keras_cutbce", "keras_cutbce.ops", "keras_erase", "keras_erase.model"} <= set(names)
    assert any(n.startswith("keras_erase.torch.") for n in names)
    assert any(n.startswith("keras_cutbce.backends.jax.") for n in names)


def test_the_public_ops_have_examples_that_run():
    """The doctests above are not vacuous: the public ops carry examples."""
    from keras_cutbce import ops

    tests = {t.name.rsplit(".", 1)[-1]: t for t in _examples(ops)}
    for name in ("cut_binary_crossentropy", "cut_top_k", "cut_count_at_least", "weighted_loss_sum"):
        assert name in tests, name
