"""Backend-neutral helpers for tests: gradients and conversions on the active Keras backend."""

import contextlib
import json
import os
import subprocess
import sys

import keras
import numpy as np

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def to_numpy(x):
    """Converts a backend tensor (any dtype, bf16 included) to a float64/int numpy array."""
    if BACKEND == "torch":
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            if x.dtype in (torch.bfloat16, torch.float16):
                x = x.float()
            return x.numpy()
    x = keras.ops.convert_to_numpy(x)
    if x.dtype.kind == "f" or str(x.dtype) == "bfloat16":
        return np.asarray(x, dtype=np.float64)
    return np.asarray(x)


def value_and_grads(fn, *args):
    """Value of `fn(*args)` (a scalar) and its gradients for every arg.

    `args` are numpy arrays or backend tensors of float dtype; returns
    `(value, [grad, ...])` as numpy arrays (gradients keep the arg's dtype
    on the backend; `dtypes` of the gradients are checked by callers with
    `grad_dtypes`).
    """
    value, grads = value_and_grads_tensors(fn, *args)
    return to_numpy(value), [to_numpy(g) for g in grads]


def value_and_grads_tensors(fn, *args):
    """Like `value_and_grads` but returns backend tensors."""
    if BACKEND == "jax":
        import jax

        tensors = [keras.ops.convert_to_tensor(a) for a in args]
        value, grads = jax.value_and_grad(fn, argnums=tuple(range(len(args))))(*tensors)
        return value, list(grads)
    if BACKEND == "torch":
        import torch

        tensors = [
            keras.ops.convert_to_tensor(a).detach().clone().requires_grad_(True) for a in args
        ]
        value = fn(*tensors)
        grads = torch.autograd.grad(value, tensors, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]
        return value.detach(), grads
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tensors = [tf.convert_to_tensor(keras.ops.convert_to_tensor(a)) for a in args]
        with tf.GradientTape() as tape:
            for t in tensors:
                tape.watch(t)
            value = fn(*tensors)
        grads = tape.gradient(value, tensors)
        grads = [tf.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]
        return value, grads
    raise NotImplementedError(BACKEND)


# The mixed precision matrix: the Keras dtype policies users train with. `compile` wraps
# the optimizer of a `mixed_float16` model in a `LossScaleOptimizer`, whose gradients
# carry its scale (2^15 at the start).
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
LOSS_SCALE = 2.0**15


@contextlib.contextmanager
def dtype_policy(name):
    """Runs the body under Keras's global dtype policy `name`; the previous one is restored."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield keras.config.dtype_policy().compute_dtype
    finally:
        keras.config.set_dtype_policy(previous)


def loss_scale(policy):
    """The scale a policy's gradients carry: `LOSS_SCALE` under `mixed_float16`, else 1."""
    return LOSS_SCALE if policy == "mixed_float16" else 1.0


def worst_row_error(got, want):
    """Returns `max_r |got_r - want_r| / |want_r|` over the rows (leading axis) of two arrays.

    A 1-D array's rows are its elements. Every row counts alike, so a row of
    small values (the table gradient of an item no row targets) is not
    hidden behind large ones; a row whose `want` is below 2^-24 of the
    largest row's norm is measured against that.

    Example:

    >>> float(worst_row_error(np.array([[1.0, 0.0], [0.0, 0.01]]), np.array([[1.0, 0.0], [0.0, 0.02]])))
    0.5
    """
    got = np.asarray(got, np.float64).reshape(len(got), -1) if np.ndim(got) else np.reshape(got, (1, 1))
    want = np.asarray(want, np.float64).reshape(got.shape)
    norms = np.linalg.norm(want, axis=1)
    floor = 2.0**-24 * norms.max() if norms.size else 0.0
    return float(np.max(np.linalg.norm(got - want, axis=1) / np.maximum(norms, max(floor, 1e-300))))


def assert_within_low_precision(got, low, want, what, floor=2e-5):
    """Asserts `got` is as exact as the dense low-precision reference `low`, against float64 `want`.

    The bound of the mixed precision matrix, calibrated as Apple's Cut
    Cross-Entropy tests calibrate theirs: `got`'s worst row error
    (`worst_row_error`) is at most twice `low`'s, or `floor` (float32
    summation order). Returns both errors.
    """
    error, low_error = worst_row_error(got, want), worst_row_error(low, want)
    assert error <= max(2.0 * low_error, floor), (
        f"{what}: worst row error {error:.3g}, dense low precision {low_error:.3g}"
    )
    return error, low_error


def dtype_name(x):
    """Standardized Keras dtype name of a tensor."""
    return keras.backend.standardize_dtype(x.dtype)


class TorchOpRecorder:
    """A TorchDispatchMode that records every aten op and the largest tensor it creates."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recorder(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []
                self.largest = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                self.ops.append(func.overloadpacket.__name__)
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        self.largest = max(self.largest, t.numel())
                return out

        return Recorder()


def fit_tied_table_model():
    """Fits a tiny model whose `CutBCELoss` reads its input Embedding (chunked kernel).

    Each of 64 rows of 4 ids targets the next two ids; 3 epochs of Adam.
    Returns `(losses per epoch, table before fit, table after fit)` as numpy.
    """
    import keras_cutbce

    rng = np.random.default_rng(10)
    vocab, dim = 50, 8
    items = keras.layers.Embedding(vocab, dim, name="items")
    inputs = keras.Input((4,), dtype="int32")
    hidden = keras.layers.Dense(dim)(items(inputs))
    model = keras.Model(inputs, hidden)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras_cutbce.CutBCELoss(items, chunk_size=16, implementation="chunked"),
    )
    x = rng.integers(0, vocab, size=(64, 4)).astype("int32")
    y = np.stack([(x + 1) % vocab, (x + 2) % vocab], axis=-1).astype("int32")
    before = to_numpy(items.embeddings)
    history = model.fit(x, y, epochs=3, batch_size=16, verbose=0)
    return history.history["loss"], before, to_numpy(items.embeddings)


def run_child_script(path, env, args=(), timeout=600):
    """Runs a test file as a script in a fresh process and returns its JSON report.

    The child gets the repository on `PYTHONPATH` plus the `env` overrides (e.g. a
    backend or a simulated device count) and must print its report as JSON on its
    last stdout line; a non-zero exit fails with the tail of its output.
    """
    child_env = dict(os.environ)
    child_env.update(env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(path), *args],
        cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n" + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
