"""Multi-process JAX: the SASRec example with its item table split over 2 processes.

`python -m examples.sasrec.distributed` trains a tiny SASRec (3 steps) with
the table laid out `("model", None)` by `keras.distribution.ModelParallel`
over 2 JAX processes (localhost coordinator, gloo CPU collectives, 1 device
each), and over 1 process with 2 devices: the per-step losses and the
retrieval metrics (`TopKRetrieval`, `MeanReciprocalRank`, `ThresholdConfusion`)
and `cut_top_k` agree, each device holds half the table, and the loss took
the vocab-sharded path; for the BCE and the softmax loss. JAX only (the processes are subprocesses).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.backend_utils import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="multi-process training runs on JAX"
)]
TRAIN_ARGS = [
    "--epochs", "1", "--steps-per-epoch", "3", "--batch-size", "16", "--num-items", "199",
    "--num-users", "40", "--max-len", "6", "--dim", "8", "--blocks", "1", "--dropout", "0",
    "--eval-users", "16", "--verbose", "0",
]


def _train(num_processes, devices_per_process, loss="cutbce"):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "examples.sasrec.distributed",
         "--num-processes", str(num_processes),
         "--devices-per-process", str(devices_per_process), "--timeout", "800",
         "--", *TRAIN_ARGS, "--loss", loss],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("loss", ["cutbce", "cutsoftmax"])
def test_two_processes_train_like_one_process_with_two_devices(loss):
    single = _train(1, 2, loss)
    multi = _train(2, 1, loss)
    assert (single["processes"], single["devices"]) == (1, 2)
    assert (multi["processes"], multi["devices"]) == (2, 2)
    for run in (single, multi):
        assert run["sharded_loss_programs"] >= 1, "the loss did not take the vocab-sharded path"
        assert run["table_rows_per_device"] == 100  # V = 200 rows, split over 2 devices
        assert len(run["step_losses"]) == 3 and np.all(np.isfinite(run["step_losses"]))
    np.testing.assert_allclose(multi["step_losses"], single["step_losses"], rtol=1e-5)
    for key in ("hit@8", "ndcg@10", "recall@10", "mrr", "precision", "recall", "f1"):
        np.testing.assert_allclose(multi[key], single[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(multi["top_k_ids"], single["top_k_ids"])
    np.testing.assert_allclose(multi["top_k_scores"], single["top_k_scores"], rtol=1e-5)
