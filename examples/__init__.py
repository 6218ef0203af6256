"""Runnable examples: `python -m examples.sasrec`, `python -m examples.ctr`, `python -m examples.run_all`."""

import argparse
import importlib.util
import os
import sys

# Where the examples and the main job write results unless told otherwise:
# `runs/` at the repository root (not the current directory).
DEFAULT_OUTPUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs")


def select_backend(argv):
    """Sets KERAS_BACKEND from a `--backend` flag in `argv`, before Keras is imported.

    Example:

    >>> select_backend(["--epochs", "1"])  # no flag: the environment decides
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--backend", choices=["jax", "torch", "tensorflow"])
    known, _ = parser.parse_known_args(argv)
    if known.backend:
        os.environ["KERAS_BACKEND"] = known.backend


def wants_help(argv):
    """True when `argv` asks for `--help` (`-h`).

    Example:

    >>> wants_help(["--epochs", "1", "-h"]), wants_help(["--epochs", "1"])
    (True, False)
    """
    return any(arg in ("-h", "--help") for arg in argv)


def backend_for_help(environ=None, installed=None):
    """Sets `KERAS_BACKEND` for printing `--help` when nothing chose a backend.

    Keras's default backend is TensorFlow, whose import takes seconds and logs
    lines that have nothing to do with the help; the help is the same on every
    backend, so this picks an installed lighter one (jax, then torch). A
    backend already chosen (the environment, `--backend`) is kept.

    Args:
        environ: the environment to update (default `os.environ`).
        installed: predicate on a module name (default: importable here).

    Returns:
        The backend set, or `None` when none was.

    Example:

    >>> env = {}
    >>> backend_for_help(env, installed=lambda name: name == "torch"), env
    ('torch', {'KERAS_BACKEND': 'torch'})
    >>> backend_for_help({"KERAS_BACKEND": "tensorflow"}) is None
    True
    """
    environ = os.environ if environ is None else environ
    installed = installed or (lambda name: importlib.util.find_spec(name) is not None)
    if environ.get("KERAS_BACKEND"):
        return None
    for backend in ("jax", "torch"):
        if installed(backend):
            environ["KERAS_BACKEND"] = backend
            return backend
    return None


def output_path(text):
    """argparse type: a path; a relative one is taken inside the output folder `runs/`.

    `runs/` is `DEFAULT_OUTPUT_DIR`, at the repository root whatever the
    current directory; absolute paths and `""` (nothing written) are kept.

    Example:

    >>> output_path("ctr_ne.png") == os.path.join(DEFAULT_OUTPUT_DIR, "ctr_ne.png")
    True
    >>> output_path("/tmp/ne.png")
    '/tmp/ne.png'
    """
    if not text:
        return text
    path = os.path.expanduser(text)
    return path if os.path.isabs(path) else os.path.join(DEFAULT_OUTPUT_DIR, path)


def _bounded(kind, ok, rule):
    def parse(text):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__doc__ = f"argparse type: a {kind.__name__} that is {rule}."
    return parse


positive_int = _bounded(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _bounded(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _bounded(float, lambda v: v > 0, "> 0")


def default_verbosity():
    """`fit`'s verbosity: a progress bar on a terminal, one line per epoch otherwise (logs)."""
    return 1 if sys.stdout.isatty() else 2
