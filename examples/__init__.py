"""Runnable examples: `python -m examples.sasrec`, `python -m examples.ctr`, `python -m examples.run_all`."""

import argparse
import os

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
