"""EraseModel under torch.distributed (gloo, 2 CPU processes on 127.0.0.1).

Two ranks, each on its half of every batch, must end with the same weights as one
process on the full batches (mean-reduced main and local losses, SGD), for the
"standard", "blocking", "threaded" and "auto" dispatches with detached block
inputs, and "blocking"/"threaded" with non-detached ones. Rank 1 starts from different weights: the broadcast
from rank 0 at the start of `fit` must fix them. The ranks also report the order
in which they launched their gradient all-reduces (block order, then the rest).

This file is also the rank's entry point: `python -m tests.test_distributed_torch
RANK WORLD PORT WORKDIR` (run by the test in subprocesses).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (dispatch, detach_input): every schedule with detached inputs; the early
# schedules also with non-detached inputs (local losses reach the shared stem).
CASES = (
    ("standard", True),
    ("blocking", True),
    ("threaded", True),
    ("auto", True),
    ("blocking", False),
    ("threaded", False),
)
DETACH = (True, False)
N, BATCH, EPOCHS, TOWERS = 64, 32, 4, 3  # 2 steps per epoch: K = 8 steps
LR = 0.5


def _backend():
    from tests.backend_utils import BACKEND

    return BACKEND


pytestmark = pytest.mark.skipif(_backend() != "torch", reason="torch.distributed test")


def _shard(array, rank, world):
    """Rank `rank`'s rows of every full batch of `BATCH` rows (same split as the global batch)."""
    per = BATCH // world
    rows = [np.arange(start + rank * per, start + (rank + 1) * per) for start in range(0, N, BATCH)]
    return array[np.concatenate(rows)]


def _train(dispatch, detach_input, x, y, batch_size, initial=None, seed=0):
    import keras

    from tests.test_erase import build_ctr

    model = build_ctr(
        dispatch,
        num_towers=TOWERS,
        detach_input=detach_input,
        seed=seed,
        auto_steps=1,
        intra_op_threads=None,
    )
    if initial is not None:
        model.set_weights(initial)
    model.compile(keras.optimizers.SGD(LR), keras.losses.BinaryCrossentropy())
    model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def _rank_main(rank, world, port, workdir):
    """One rank: trains every (mode, detach_input) case on its shard, saves the weights."""
    os.environ.update(
        KERAS_BACKEND="torch",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
    )
    import datetime

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    from tests.backend_utils import to_numpy
    from tests.test_erase import ctr_data

    x, y = ctr_data(N)
    x, y = _shard(x, rank, world), _shard(y, rank, world)
    results, report = {}, {}
    for detach_input in DETACH:
        initial = np.load(os.path.join(workdir, f"initial_{detach_input}.npz"))
        initial = [initial[f"w{i}"] for i in range(len(initial.files))]
        for mode in [m for m, d in CASES if d == detach_input]:
            # Rank 0 starts from the saved weights, rank 1 from other ones (seed 1):
            # the broadcast at the start of fit must give every rank rank 0's.
            model = _train(
                mode,
                detach_input,
                x,
                y,
                BATCH // world,
                initial=initial if rank == 0 else None,
                seed=rank,
            )
            for i, w in enumerate(model.get_weights()):
                results[f"{mode}_{detach_input}_{i}"] = to_numpy(w)
            report[f"{mode}_{detach_input}"] = {
                "launch_order": model._grad_sync.launch_order,
                "choice": model.dispatch_choice,
            }
    np.savez(os.path.join(workdir, f"rank{rank}.npz"), **results)
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world, workdir, timeout=240):
    port = _free_port()
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.test_distributed_torch", str(r), str(world),
             str(port), str(workdir)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("distributed ranks timed out:\n" + "\n".join(o[-3000:] for o in outputs))
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r][-4000:]}"


def test_two_gloo_ranks_on_half_batches_match_one_process_on_full_batches(tmp_path):
    from tests.backend_utils import to_numpy
    from tests.test_erase import build_ctr, ctr_data

    # Initial weights (saved for rank 0) and the single-process reference (stock step).
    x, y = ctr_data(N)
    initials, references = {}, {}
    for detach_input in DETACH:
        initial = [to_numpy(w) for w in build_ctr("standard", num_towers=TOWERS,
                                                   detach_input=detach_input).get_weights()]
        np.savez(tmp_path / f"initial_{detach_input}.npz",
                 **{f"w{i}": w for i, w in enumerate(initial)})
        initials[detach_input] = initial
        model = _train("standard", detach_input, x, y, BATCH, initial=initial)
        references[detach_input] = [to_numpy(w) for w in model.get_weights()]
        moved = max(np.abs(a - b).max() for a, b in zip(references[detach_input], initial))
        assert moved > 1e-2

    _launch(2, tmp_path)

    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    blocks = [f"tower_{i}" for i in range(TOWERS)]
    for detach_input in DETACH:
        reference = references[detach_input]
        for mode in [m for m, d in CASES if d == detach_input]:
            key = f"{mode}_{detach_input}"
            for i, ref in enumerate(reference):
                w0, w1 = ranks[0][f"{key}_{i}"], ranks[1][f"{key}_{i}"]
                np.testing.assert_array_equal(w0, w1, err_msg=f"rank 1 != rank 0: {key} #{i}")
                np.testing.assert_allclose(w0, ref, rtol=1e-5, atol=2e-6, err_msg=f"{key} #{i}")
            order = [r[key]["launch_order"] for r in reports]
            assert order[0] == order[1], key
            choice = [r[key]["choice"] for r in reports]
            assert choice[0] == choice[1], key  # "auto" picks the same schedule everywhere
            expected = ["remainder"] if choice[0] == "standard" else blocks + ["remainder"]
            assert order[0] == expected, key


def test_gradient_sync_is_inactive_without_a_process_group():
    from keras_erase import distributed

    assert not distributed.active()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
