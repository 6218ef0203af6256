"""Peak memory of forward+backward of the chunked kernels.

Runs in a subprocess on the active backend: resets the process's peak RSS
(`/proc/self/clear_refs`) once the inputs exist, runs the chunked loss and all
its gradients, and reports `VmHWM - VmRSS` (the peak above the inputs).
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest

ROWS, DIM, VOCAB = 8192, 16, 131072  # dense float32 logits: 4 GiB
DENSE_BYTES = ROWS * VOCAB * 4

SCRIPT = textwrap.dedent(
    f"""
    import json, os
    import numpy as np
    import keras
    from keras_cutbce import cut_binary_crossentropy
    from tests.backend_utils import value_and_grads_tensors

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    rng = np.random.default_rng(0)
    hidden = keras.ops.convert_to_tensor(rng.normal(size=({ROWS}, {DIM})).astype("float32"))
    table = keras.ops.convert_to_tensor(rng.normal(size=({VOCAB}, {DIM})).astype("float32") * 0.1)
    bias = keras.ops.convert_to_tensor(np.zeros({VOCAB}, "float32"))
    ids = keras.ops.convert_to_tensor(rng.integers(0, {VOCAB}, size=({ROWS}, 8)).astype("int32"))

    def loss(h, t, b):
        return keras.ops.sum(cut_binary_crossentropy(h, t, ids, b, implementation="chunked"))

    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    value, grads = value_and_grads_tensors(loss, hidden, table, bias)
    finite = bool(np.isfinite(keras.ops.convert_to_numpy(value)))
    peak = status("VmHWM")
    print(json.dumps({{"before": before, "peak": peak, "finite": finite}}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.slow
def test_forward_backward_peak_is_under_ten_percent_of_dense_logits():
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=root, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    extra = result["peak"] - result["before"]
    assert result["finite"]
    assert extra < 0.10 * DENSE_BYTES, f"peak {extra / 2**20:.0f} MiB above the inputs"


LOSS_PATH_SHAPE = (1024, 128, 262144)  # the [V, D] table gradient: 128 MiB
LOSS_PATH_LIMIT_MB = 300

LOSS_PATH_SCRIPT = textwrap.dedent(
    f"""
    import gc, json
    import numpy as np
    import keras
    from keras_cutbce.ops import weighted_loss_sum

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    rows, dim, vocab = {LOSS_PATH_SHAPE}
    rng = np.random.default_rng(0)
    hidden = (rng.normal(size=(rows, dim)) / np.sqrt(dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    bias = (rng.normal(size=(vocab,)) * 0.1).astype("float32")
    ids = keras.ops.convert_to_tensor(rng.integers(0, vocab, size=(rows, 8)).astype("int32"))
    weights = keras.ops.ones((rows,))
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        args = [torch.tensor(x, requires_grad=True) for x in (hidden, table, bias)]

        def step():
            value = weighted_loss_sum(args[0], args[1], ids, weights, args[2])
            return value, torch.autograd.grad(value, args)
    elif backend == "tensorflow":
        import tensorflow as tf

        args = [tf.constant(x) for x in (hidden, table, bias)]

        def step():
            with tf.GradientTape() as tape:
                tape.watch(args)
                value = weighted_loss_sum(args[0], args[1], ids, weights, args[2])
            return value, tape.gradient(value, args)
    else:
        import jax

        args = [jax.numpy.asarray(x) for x in (hidden, table, bias)]
        grad = jax.jit(jax.value_and_grad(
            lambda h, t, b: weighted_loss_sum(h, t, ids, weights, b), argnums=(0, 1, 2)))

        def step():
            value, grads = grad(*args)
            jax.block_until_ready(grads)
            return value, grads

    del hidden, table, bias
    before = status("VmRSS")
    value, grads = step()  # warm-up: traces and compiles
    del value, grads
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    value, grads = step()
    finite = bool(np.isfinite(float(value)))
    peak = status("VmHWM")
    print(json.dumps({{"before": before, "peak": peak, "finite": finite}}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_loss_path_peak_stays_under_the_limit():
    """Checks that `weighted_loss_sum` (what `fit` runs) peaks at about one table gradient.

    Forward and backward at `LOSS_PATH_SHAPE` after a warm-up call: the
    extra peak RSS stays under `LOSS_PATH_LIMIT_MB` (the `[V, D]` float32
    table gradient alone is 128 MiB).
    """
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="3")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", LOSS_PATH_SCRIPT], capture_output=True, text=True, env=env,
        cwd=root, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    extra_mb = (result["peak"] - result["before"]) / 2**20
    assert result["finite"]
    assert extra_mb < LOSS_PATH_LIMIT_MB, f"peak {extra_mb:.0f} MiB above the inputs"


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA memory analysis of the JAX kernel")
@pytest.mark.parametrize("path", ["forward", "per_row_grads", "fused_grads"])
def test_jax_chunked_temp_memory_when_tiles_do_not_divide_the_vocabulary(path):
    """V = 8292 over 256-wide tiles: no extra full copy of the table.

    XLA's compiled temp buffers must stay about one float32 table gradient
    (the `[D + 1, V]` buffer the tiles are written into) with gradients, and
    far below one table without; before, slicing the table into whole tiles
    copied it (forward: 1.0x the table) and concatenating the remainder's
    gradient copied the gradient (fused: 2.1x).
    """
    import jax
    import jax.numpy as jnp

    from keras_cutbce.backends.jax import chunked

    rows, dim, vocab = 64, 32, 8192 + 100
    table_bytes = vocab * dim * 4
    hidden, table = jnp.zeros((rows, dim)), jnp.zeros((vocab, dim))
    ids, weights = jnp.zeros((rows, 4), jnp.int32), jnp.ones((rows,))

    def per_row(h, t):
        return jnp.sum(chunked.cut_bce(h, t, ids, None, chunk_size=256))

    def fused(h, t):
        return chunked.cut_bce_weighted_sum(h, t, ids, None, weights, chunk_size=256)

    fn = {
        "forward": per_row,
        "per_row_grads": jax.value_and_grad(per_row, argnums=(0, 1)),
        "fused_grads": jax.value_and_grad(fused, argnums=(0, 1)),
    }[path]
    analysis = jax.jit(fn).lower(hidden, table).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this XLA backend has no memory analysis")
    limit = 0.25 if path == "forward" else 1.5
    assert analysis.temp_size_in_bytes < limit * table_bytes, (
        f"temp {analysis.temp_size_in_bytes / table_bytes:.2f}x the table"
    )
