"""Runnable examples: `python -m examples.sasrec`, `python -m examples.ctr`, `python -m examples.run_all`."""

import argparse
import os
import sys

# Where the examples and the main job write results unless told otherwise:
# `runs/` at the repository root (not the current directory).
DEFAULT_OUTPUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs")


BACKENDS = ("jax", "torch", "tensorflow")


def example_parser(prog, description):
    """The argument parser every example starts from: `--backend`, defaults shown in `--help`."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", choices=BACKENDS, help="Keras backend (None: $KERAS_BACKEND)")
    return parser


def add_run_arguments(parser):
    """Adds the arguments every example run takes: `--seed`, `--json`, `--verbose`."""
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--verbose", type=int, choices=[0, 1, 2], default=default_verbosity(),
                        help="fit's verbosity: 1 progress bar, 2 one line per epoch "
                             "(default: %(default)s here; 1 on a terminal, else 2)")


def select_backend(argv):
    """Sets KERAS_BACKEND from a `--backend` flag in `argv`, before Keras is imported.

    Example:

    >>> select_backend(["--epochs", "1"])  # no flag: the environment decides
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--backend", choices=BACKENDS)
    known, _ = parser.parse_known_args(argv)
    if known.backend:
        os.environ["KERAS_BACKEND"] = known.backend
    quiet_start(os.environ.get("KERAS_BACKEND"))


def quiet_start(backend):
    """Environment defaults, set before Keras is imported, that keep a run's stderr to its own backend's lines.

    - With `libtpu` installed (the project's environment has it for the TPU
      compile tests) but no TPU or GPU attached, JAX would load libtpu and probe
      for a TPU in every process (its log lines, its lock file): JAX runs on the
      CPU (`JAX_PLATFORMS=cpu`).
    - On JAX and torch, TensorFlow imported into the process (by
      `keras.utils.set_random_seed` when it is installed; the examples seed
      through `set_random_seed` below, which does not) would print its oneDNN
      and CPU-feature lines: they are turned off.

    A variable already set is kept.
    """
    import glob
    import importlib.util

    accelerators = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
    if importlib.util.find_spec("libtpu") is not None and not any(
        glob.glob(pattern) for pattern in accelerators
    ):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if backend != "tensorflow":
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def set_random_seed(seed):
    """Seeds a run as `keras.utils.set_random_seed(seed)` does, without importing TensorFlow on JAX or torch.

    Keras's function also seeds TensorFlow when it is installed (for `tf.data`
    pipelines), which imports it into a torch or JAX process: about 2 s of CPU
    and 420 MiB of resident memory in each of the main job's processes (the
    project's environment has every backend), counted in their peak memory.
    The examples use no `tf.data`: on JAX and torch this seeds what they draw
    from as Keras does (Python's `random`, from which Keras's initializers
    and layers take their seeds; NumPy; torch), on TensorFlow it is Keras's.
    """
    import random

    import keras
    import numpy as np

    backend = keras.backend.backend()
    if backend == "tensorflow":
        keras.utils.set_random_seed(seed)
        return
    random.seed(seed)
    np.random.seed(seed)
    if backend == "torch":
        import torch

        torch.manual_seed(seed)


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
unit_interval = _bounded(float, lambda v: 0.0 <= v < 1.0, "in [0, 1)")


def default_verbosity():
    """`fit`'s verbosity: a progress bar on a terminal, one line per epoch otherwise (logs)."""
    return 1 if sys.stdout.isatty() else 2
