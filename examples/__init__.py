"""Runnable examples: `python -m examples.sasrec`, `python -m examples.ctr`, `python -m examples.run_all`."""

import argparse
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
