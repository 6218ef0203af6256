"""The SASRec example with its table split over 2 gloo ranks (`torchrun -m examples.sasrec.torch_distributed`).

The same small config in one process (`python -m examples.sasrec`) is the
reference: the 2-rank run reaches its hit@10 (each rank trains on half of
every global batch, in its own shuffled order: the runs are not step for step
the same, the metrics within 0.05).
"""

import json
import os
import subprocess
import sys

import keras
import pytest

from tests.backend_utils import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="torch.distributed ranks run on the torch backend"
)]
ARGS = ["--epochs", "2", "--batch-size", "32", "--num-items", "199", "--num-users", "300",
        "--max-len", "10", "--dim", "16", "--blocks", "1", "--dropout", "0", "--eval-users", "128",
        "--verbose", "0"]


def _env():
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def test_two_gloo_ranks_reach_one_process_hit_at_10(tmp_path):
    multi = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "examples.sasrec.torch_distributed", *ARGS],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900,
    )
    assert multi.returncode == 0, multi.stdout[-3000:] + multi.stderr[-6000:]
    multi = json.loads(multi.stdout.strip().splitlines()[-1])
    path = tmp_path / "one.json"
    single = subprocess.run(
        [sys.executable, "-m", "examples.sasrec", "--backend", "torch", *ARGS, "--json", str(path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900,
    )
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-6000:]
    single = json.loads(path.read_text())
    assert (multi["ranks"], multi["table_rows_per_rank"]) == (2, 100)  # V = 200
    assert multi["eval_users"] == single["eval_users"] == 128
    assert multi["hit@10"] >= single["hit@10"] - 0.05, (multi["hit@10"], single["hit@10"])
