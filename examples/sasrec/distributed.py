"""SASRec with its item table split along V over JAX processes: `python -m examples.sasrec.distributed`.

The code path of a multi-host TPU pod, run on one machine: the launcher
starts `--num-processes` JAX processes (CPU devices, a localhost coordinator,
gloo collectives), each with `--devices-per-process` devices. Every worker
joins them with `keras.distribution.initialize`, lays the item table
(`items/embeddings`, `("model", None)`) and the output bias
(`item_bias/bias`, `("model",)`) out over a `("data", "model")` `DeviceMesh`
of shape `(1, all devices)` with `keras.distribution.ModelParallel`, and runs
the example's training (`examples.sasrec.train.run`, the arguments after
`--`). `CutBCELoss` then takes the vocab-sharded path
(`keras_cutbce.backends.jax.sharded`): each device holds `V / devices` table
rows and their gradient, one `psum` combines the loss terms. Every process
feeds the same batches (the data axis has size 1). Process 0 prints the
results, including the loss of every step (`step_losses`).

`--num-processes 1 --devices-per-process 2` is the same program in one
process with 2 devices: the two give the same losses and metrics.

Example:

```
python -m examples.sasrec.distributed --num-processes 2 -- --epochs 1 --num-items 1999
python -m examples.sasrec.distributed --num-processes 1 --devices-per-process 2 -- --epochs 1 --num-items 1999
```

`V = num_items + 1` (row 0 is padding) must be divisible by the device count.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

from examples import positive_int

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m examples.sasrec.distributed",
        description="Train the SASRec example with the item table split over JAX processes "
        "(arguments after `--` go to `python -m examples.sasrec`).",
    )
    parser.add_argument("--num-processes", type=positive_int, default=2,
                        help="JAX processes to start on this machine")
    parser.add_argument("--devices-per-process", type=positive_int, default=1,
                        help="CPU devices of each process")
    parser.add_argument("--port", type=int, default=0,
                        help="coordinator port on localhost (0: a free one)")
    parser.add_argument("--timeout", type=positive_int, default=1800,
                        help="seconds before the workers are stopped")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="`-- ARGS` for python -m examples.sasrec")
    return parser


def _free_port():
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launch(args, train_argv):
    """Starts the worker processes and waits for them; returns the exit status."""
    port = args.port or _free_port()
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(filter(None, [
        env.get("XLA_FLAGS"), f"--xla_force_host_platform_device_count={args.devices_per_process}"
    ]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "examples.sasrec.distributed",
             "--num-processes", str(args.num_processes),
             "--devices-per-process", str(args.devices_per_process),
             "--port", str(port), "--process-id", str(rank), "--", *train_argv],
            cwd=ROOT, env=env,
            stdout=None if rank == 0 else subprocess.DEVNULL,
        )
        for rank in range(args.num_processes)
    ]
    status = 0
    for worker in workers:
        try:
            status = status or worker.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            status = 124
    for worker in workers:  # a failed worker leaves the others waiting on a collective
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    return status


def _vocab_layout(devices):
    import keras

    mesh = keras.distribution.DeviceMesh((1, len(devices)), ("data", "model"), devices)
    layout = keras.distribution.LayoutMap(mesh)
    layout["items/embeddings"] = ("model", None)
    layout["item_bias/bias"] = ("model",)
    # The data axis has size 1: every process feeds the whole (same) batch.
    return keras.distribution.ModelParallel(
        layout_map=layout, batch_dim_name="data", auto_shard_dataset=False
    )


def _sharded_loss_programs():
    """How many vocab-sharded loss programs this process built (0: the path was not taken)."""
    from keras_cutbce.backends.jax import sharded

    return sharded.loss._loss_program.cache_info().currsize  # every family's


class _ShardedRun:
    """Keras callback (built lazily, after the backend is chosen): per-step losses, shard size."""

    def __new__(cls):
        import keras

        class Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.losses, self.table_rows = [], None

            def on_train_batch_end(self, batch, logs=None):
                self.losses.append(float(logs["loss"]))

            def on_train_end(self, logs=None):
                table = self.model.get_layer("items").embeddings.value
                self.table_rows = int(table.addressable_shards[0].data.shape[0])

        return Recorder()


def _probes(model, train_args, users=16):
    """After training, on the first `users` evaluation users: `cut_top_k` (k = 10, seen items
    excluded) and the `MeanReciprocalRank` and `ThresholdConfusion` results, over the sharded table."""
    import numpy as np

    from examples.sasrec import data as data_lib
    from examples.sasrec import train
    from keras_cutbce import MeanReciprocalRank, ThresholdConfusion, cut_top_k

    sequences, _ = train.load_sequences(train_args)
    kept, held_out = data_lib.split_leave_last_out(sequences, holdout=train.NUM_TARGETS)
    inputs, held, seen = (a[:users] for a in data_lib.evaluation_arrays(
        kept, held_out, train_args.max_len))
    hidden = model.predict(inputs, verbose=0)[:, -1, :]
    items, bias = model.get_layer("items"), model.get_layer("item_bias").bias
    scores, ids = cut_top_k(hidden, items, 10, bias=bias, exclude_ids=seen)
    probes = {"top_k_scores": np.asarray(scores).tolist(), "top_k_ids": np.asarray(ids).tolist()}
    rank = MeanReciprocalRank(items, bias=bias, exclude_ids=[0])
    rank.update_state(held, hidden, exclude_ids=seen)
    confusion = ThresholdConfusion(items, bias=bias, threshold=0.01)
    confusion.update_state(held, hidden)
    for metric in (rank, confusion):
        probes.update({k: float(np.asarray(v)) for k, v in metric.result().items()})
    return probes


def work(args, train_argv):
    """One worker: joins the processes, sets the distribution, trains; returns the results."""
    import keras

    if args.num_processes > 1:
        keras.distribution.initialize(
            f"localhost:{args.port}", args.num_processes, args.process_id
        )
    from examples.sasrec import train

    train_args = train.parse_args(train_argv)
    devices = keras.distribution.list_devices()
    vocab = train_args.num_items + 1
    if train_args.data != "synthetic" or vocab % len(devices):
        raise SystemExit(
            f"--num-items + 1 ({vocab}) must be divisible by the {len(devices)} devices "
            "(synthetic data)."
        )
    keras.distribution.set_distribution(_vocab_layout(devices))
    record = _ShardedRun()
    if args.process_id:
        train_args.verbose = 0
    results = train.run(train_args, callbacks=[record])
    results.update(_probes(record.model, train_args))
    results.update(
        step_losses=record.losses, table_rows_per_device=record.table_rows,
        sharded_loss_programs=_sharded_loss_programs(),
        processes=args.num_processes, devices=len(devices),
    )
    if not args.process_id:
        print(json.dumps(results))
    return results


def main(argv=None):
    args = build_parser().parse_args(argv)
    train_argv = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.process_id is None:
        return launch(args, train_argv)
    work(args, train_argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
