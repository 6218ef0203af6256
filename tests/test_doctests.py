"""Runs the `>>>` examples of every module of `keras_cutbce` and `keras_erase` (issue 11 A7).

Once per Keras backend, like the rest of the suite. A docstring example must
print the same text on every backend (e.g. `tuple(x.shape)`, not `x.shape`,
whose repr is `torch.Size([...])` on torch and `TensorShape([...])` on
TensorFlow), so the comparison is doctest's own, with `ELLIPSIS` and
`NORMALIZE_WHITESPACE` only. Kernel modules of another backend
(`keras_cutbce.backends.<other>`) are skipped: they run under their own
backend.
"""

import doctest
import importlib
import pkgutil

import keras
import pytest

PACKAGES = ("keras_cutbce", "keras_erase")
BACKENDS = ("jax", "torch", "tensorflow")


def _other_backend(name):
    """True for `keras_cutbce.backends.<b>...` modules of a backend that is not active."""
    parts = name.split(".")
    return (
        len(parts) >= 3
        and parts[1] == "backends"
        and parts[2] in BACKENDS
        and parts[2] != keras.backend.backend()
    )


def module_names():
    names = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        for info in pkgutil.walk_packages(package.__path__, prefix=package_name + "."):
            if not _other_backend(info.name):
                names.append(info.name)
    return sorted(names)


def _examples(module):
    return [t for t in doctest.DocTestFinder().find(module) if t.examples]


@pytest.mark.parametrize("name", module_names())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    report = []
    for test in _examples(module):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)


def test_the_public_ops_have_examples_that_run():
    """The doctests above are not vacuous: the public ops carry examples."""
    from keras_cutbce import ops

    tests = {t.name.rsplit(".", 1)[-1]: t for t in _examples(ops)}
    for name in ("cut_binary_crossentropy", "cut_top_k", "cut_count_at_least", "weighted_loss_sum"):
        assert name in tests, name
