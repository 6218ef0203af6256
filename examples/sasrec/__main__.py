"""`python -m examples.sasrec [--backend jax|torch|tensorflow] ...`."""

import argparse
import os
import sys


def _select_backend(argv):
    """Sets KERAS_BACKEND from `--backend` before Keras is imported."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--backend", choices=["jax", "torch", "tensorflow"])
    known, _ = parser.parse_known_args(argv)
    if known.backend:
        os.environ["KERAS_BACKEND"] = known.backend


if __name__ == "__main__":
    _select_backend(sys.argv[1:])
    from examples.sasrec.train import main

    main(sys.argv[1:])
