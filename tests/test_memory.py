"""Peak memory of forward+backward at a shape whose dense logits alone take 4 GiB.

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
def test_forward_backward_peak_is_under_ten_percent_of_dense_logits():
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=root, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    extra = result["peak"] - result["before"]
    assert result["finite"]
    assert extra < 0.10 * DENSE_BYTES, f"peak {extra / 2**20:.0f} MiB above the inputs"
