"""Train the CTR model with ERASE: `python -m examples.ctr`.

Modes (the same network and initial weights in every mode):

| mode | model and schedule |
|---|---|
| `baseline` | no detachment, Keras's standard step (the quality baseline) |
| `detached` | `EraseModel(dispatch="standard")`: detached towers, standard step |
| `erase-blocking` | early backward of each tower, inline (torch) |
| `erase-threaded` | early backward on a worker thread (torch) |
| `erase-streams` | early backward on CUDA streams (torch + CUDA) |
| `erase-graphs` | streams with each tower captured as a CUDA Graph (torch + CUDA) |

Reported: normalized entropy (NE) and AUC on a held-out split, and the
training throughput after warm-up: examples/s of every step (from
`on_train_batch_begin` to `on_train_batch_end`), p50 and p90 over steps (the
p90 is the 90th percentile of per-step examples/s). `--compare` runs every
mode available here and prints one table with each mode's QPS gain and NE
gap against `baseline`, and saves a plot of the training NE per step.

Example:

```
python -m examples.ctr --backend torch --mode erase-threaded --json runs/ctr.json
python -m examples.ctr --backend torch --compare --plot runs/ctr_ne.png
```
"""

import argparse
import json
import os
import time

import keras
import numpy as np

from examples.ctr import data as data_lib
from examples.ctr.model import NormalizedEntropy, build_ctr_model

MODES = (
    "baseline",
    "detached",
    "erase-blocking",
    "erase-threaded",
    "erase-streams",
    "erase-graphs",
)
ERASE_OPTIONS = {
    "detached": {"dispatch": "standard"},
    "erase-blocking": {"dispatch": "blocking"},
    "erase-threaded": {"dispatch": "threaded"},
    "erase-streams": {"dispatch": "streams"},
    "erase-graphs": {"dispatch": "streams", "cuda_graphs": True},
}


def _cuda_available():
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.cuda.is_available()


def available_modes():
    """Modes that run on this backend and device.

    The early-backward schedules exist on torch only (JAX and TensorFlow
    train an `EraseModel` with the standard step, i.e. `detached`); streams
    and CUDA Graphs need CUDA.
    """
    modes = ["baseline", "detached"]
    if keras.backend.backend() == "torch":
        modes += ["erase-blocking", "erase-threaded"]
        if _cuda_available():
            modes += ["erase-streams", "erase-graphs"]
    return modes


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m examples.ctr", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--backend", choices=["jax", "torch", "tensorflow"],
                        help="Keras backend (default: $KERAS_BACKEND)")
    parser.add_argument("--mode", choices=MODES, default="erase-threaded")
    parser.add_argument("--compare", action="store_true",
                        help="run every available mode and print the comparison table")
    parser.add_argument("--plot", default="runs/ctr_ne.png",
                        help="--compare: PNG of the training NE per step and mode")
    parser.add_argument("--data", choices=["synthetic", "criteo"], default="synthetic")
    parser.add_argument("--data-dir", default=None, help="Criteo TSV file or folder")
    parser.add_argument("--num-examples", type=int, default=60_000,
                        help="synthetic examples (train + test), or max Criteo rows")
    parser.add_argument("--buckets", type=int, default=1000, help="hashed ids per feature")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps-per-epoch", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="steps left out of the throughput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--verbose", type=int, default=1, help="fit's verbosity (1: progress bar)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="torch: N local gloo ranks, data parallel; QPS is summed over ranks")
    return parser


class Throughput(keras.callbacks.Callback):
    """Per-step examples/s (`on_train_batch_begin` to `_end`) and NE per step."""

    def __init__(self, batch_size):
        super().__init__()
        self.batch_size = batch_size
        self.seconds = []
        self.ne = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)
        if logs and "ne" in logs:
            self.ne.append(float(logs["ne"]))

    def percentiles(self, warmup):
        """`(p50, p90)` examples/s: the batch over the median and the 90th-percentile
        step time (p90 is the throughput 90% of steps reach, as in the benchmarks)."""
        seconds = np.asarray(self.seconds[warmup:] if len(self.seconds) > warmup else self.seconds)
        seconds = np.maximum(seconds, 1e-12)
        return (float(self.batch_size / np.percentile(seconds, 50)),
                float(self.batch_size / np.percentile(seconds, 90)))


def load_data(args):
    """`(train, test)` dicts; the train size is a multiple of the batch size."""
    if args.data == "synthetic":
        data = data_lib.synthetic_ctr(args.num_examples, buckets=args.buckets, seed=args.seed)
    else:
        if args.data_dir is None:
            raise SystemExit("--data criteo needs --data-dir (a Criteo TSV file or folder).")
        data = data_lib.load_criteo(args.data_dir, buckets=args.buckets, max_rows=args.num_examples)
    train, test = data_lib.split(data)
    usable = (len(train["label"]) // args.batch_size) * args.batch_size
    if usable == 0:
        raise SystemExit(
            f"Only {len(train['label'])} training examples for --batch-size {args.batch_size}."
        )
    train = {k: v[:usable] for k, v in train.items()}
    return train, test


def run_mode(mode, args, train, test):
    """Trains one mode from the seed's initial weights; returns its results."""
    if mode not in available_modes():
        raise SystemExit(
            f"--mode {mode} is not available on backend {keras.backend.backend()!r} "
            f"here; available: {', '.join(available_modes())}."
        )
    keras.utils.set_random_seed(args.seed)
    model = build_ctr_model(
        detached=mode != "baseline",
        buckets=args.buckets,
        embedding_dim=args.embedding_dim,
        width=args.width,
        depth=args.depth,
        initial_ctr=float(np.clip(train["label"].mean(), 0.01, 0.99)),
        **ERASE_OPTIONS.get(mode, {}),
    )
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.BinaryCrossentropy(),
        metrics=[NormalizedEntropy(name="ne"), keras.metrics.AUC(name="auc")],
    )
    meter = Throughput(args.batch_size)
    features = {"dense": train["dense"], "sparse": train["sparse"]}
    print(f"[ctr] backend={keras.backend.backend()} mode={mode} train={len(train['label'])} "
          f"test={len(test['label'])} ctr={train['label'].mean():.3f}")
    model.fit(
        features,
        train["label"],
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        shuffle=True,
        callbacks=[meter],
        verbose=args.verbose,
    )
    scores = model.evaluate(
        {"dense": test["dense"], "sparse": test["sparse"]},
        test["label"],
        batch_size=max(args.batch_size, 2048),
        return_dict=True,
        verbose=0,
    )
    qps_p50, qps_p90 = meter.percentiles(args.warmup_steps)
    return {
        "mode": mode,
        "ne": float(scores["ne"]),
        "auc": float(scores["auc"]),
        "qps_p50": qps_p50,
        "qps_p90": qps_p90,
        "steps": len(meter.seconds),
        "train_ne_per_step": meter.ne,
        "backend": keras.backend.backend(),
    }


def compare_table(results):
    """Markdown table of the modes' results with gains against `baseline`."""
    base = next((r for r in results if r["mode"] == "baseline"), results[0])
    lines = [
        "| mode | NE | AUC | QPS p50 | QPS p90 | QPS gain p50 | QPS gain p90 | NE gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        gain50 = 100.0 * (r["qps_p50"] / base["qps_p50"] - 1.0)
        gain90 = 100.0 * (r["qps_p90"] / base["qps_p90"] - 1.0)
        gap = 100.0 * (r["ne"] / base["ne"] - 1.0)
        lines.append(
            f"| {r['mode']} | {r['ne']:.4f} | {r['auc']:.4f} | {r['qps_p50']:.0f} "
            f"| {r['qps_p90']:.0f} | {gain50:+.1f}% | {gain90:+.1f}% | {gap:+.2f}% |"
        )
    return "\n".join(lines)


def plot_ne(results, path):
    """Saves the training NE (running, per step) of every mode to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for r in results:
        ne = r["train_ne_per_step"]
        axis.plot(np.arange(1, len(ne) + 1), ne, label=r["mode"], linewidth=1.2)
    axis.set_xlabel("training step")
    axis.set_ylabel("normalized entropy (running, train)")
    axis.set_title(f"CTR: NE per step ({keras.backend.backend()})")
    axis.grid(alpha=0.3)
    axis.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def shard(train, rank, world, batch_size):
    """Rank `rank`'s equal share of the training rows (every rank takes the same steps)."""
    per_rank = (len(train["label"]) // (world * batch_size)) * batch_size
    if per_rank == 0:
        raise SystemExit(
            f"Too few training examples for --nproc {world} x --batch-size {batch_size}."
        )
    return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in train.items()}


def run_rank(rank, world, mode, args):
    """One rank of `--nproc`: trains `mode` on its shard (weights broadcast from rank 0)."""
    train, test = load_data(args)  # same seed: the same data on every rank
    if rank > 0:
        args.verbose = 0
    return run_mode(mode, args, shard(train, rank, world, args.batch_size), test)


def run_distributed(mode, args):
    """`--nproc N`: N local gloo ranks; global QPS = sum over ranks; NE/AUC of rank 0."""
    from keras_erase.launch import run_local

    if keras.backend.backend() != "torch":
        raise SystemExit("--nproc needs --backend torch (torch.distributed, gloo).")
    ranks = run_local(run_rank, args.nproc, args=(mode, args))
    result = dict(ranks[0])
    result.update(
        nproc=args.nproc,
        qps_p50=sum(r["qps_p50"] for r in ranks),
        qps_p90=sum(r["qps_p90"] for r in ranks),
        rank_qps_p50=[r["qps_p50"] for r in ranks],
    )
    return result


def _run(mode, args, train, test):
    if args.nproc > 1:
        return run_distributed(mode, args)
    return run_mode(mode, args, train, test)


def _summary(result):
    return {k: v for k, v in result.items() if k != "train_ne_per_step"}


def main(argv=None):
    args = build_parser().parse_args(argv)
    train, test = load_data(args)
    if args.compare:
        results = [_run(mode, args, train, test) for mode in available_modes()]
        table = compare_table(results)
        print(table)
        if args.plot:
            print(f"NE per step plot: {plot_ne(results, args.plot)}")
        output = {"runs": [_summary(r) for r in results], "table": table}
    else:
        result = _run(args.mode, args, train, test)
        print(compare_table([result]))
        output = _summary(result)
        results = [result]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(output, f, indent=2)
    return results
