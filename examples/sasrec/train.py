"""Train and evaluate the multi-label SASRec: `python -m examples.sasrec`.

Every non-padding position predicts its next 8 items. `--loss` picks how:
`cutbce` is the exact full-catalogue BCE (`keras_cutbce.CutBCELoss`, no logits
tensor), `dense` the same BCE through the full logits, `sampled` BCE on each
positive plus `--num-negatives` uniformly drawn negatives (the original SASRec
recipe with 1), `softmax` full-catalogue softmax cross-entropy, `cutsoftmax`
the same softmax without the logits (`keras_cutbce.cut_categorical_crossentropy`,
the op of `CutSoftmaxLoss`). Every loss
trains the same model (tied item table, learned per-item output bias) and is
scored by the same evaluation: each user's last 8 items are held out, the
hidden state at the last training position is ranked against the whole
catalogue with `keras_cutbce.metrics.TopKRetrieval` (items the user has
already seen excluded), and the most-popular-items baseline is scored on the
same split.

Example:

```
python -m examples.sasrec --backend torch --epochs 3 --json runs/sasrec.json
python -m examples.sasrec --data movielens --data-dir ~/data/ml-latest-small --loss dense
python -m examples.sasrec --loss sampled --num-negatives 256 --eval-each-epoch
```
"""

import json
import os
import resource
import sys
import time

import keras
import numpy as np

from examples import default_verbosity  # noqa: F401  (re-exported: the verbosity rule)
from examples import set_random_seed
from examples.sasrec import data as data_lib
from examples.sasrec.cli import LOSSES, build_parser, parse_args  # noqa: F401
from examples.sasrec.losses import CutSoftmaxCrossEntropyLoss, NegativeSamplingBatches
from examples.sasrec.losses import SampledBCELoss, SoftmaxCrossEntropyLoss
from examples.sasrec.model import DenseBCELoss, build_sasrec
from examples.sasrec.tables import run_name, sasrec_table

NUM_TARGETS = 8  # L: next items per position, and held-out items per user
KS = (8, 10)


def load_sequences(args):
    """`(sequences, num_items)` for `--data`."""
    if args.data == "synthetic":
        sequences = data_lib.synthetic_sequences(
            num_users=args.num_users, num_items=args.num_items, seed=args.seed
        )
        return sequences, args.num_items
    if args.data == "movielens":
        return data_lib.load_movielens(args.data_dir)
    if args.data_dir is None:
        raise SystemExit("--data yambda needs --data-dir DIR (a folder of Yambda parquet files).")
    return data_lib.load_yambda(args.data_dir)


class StepTimer(keras.callbacks.Callback):
    """Wall time of every training step (`on_train_batch_begin` to `_end`)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    def steps_per_second(self, warmup=2):
        """1 / median step time after `warmup` steps (a recompile, e.g. for the
        last partial batch, does not count)."""
        times = self.times[warmup:] if len(self.times) > warmup else self.times
        return float(1.0 / max(np.median(times), 1e-12))


def peak_memory_mb():
    """Peak resident set size of this process so far (host RAM, MiB).

    `ru_maxrss` is in KiB on Linux and bytes on macOS. It measures host
    memory only; on an accelerator see the device's own counters.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def popularity_metrics(counts, held_out, seen, ks=KS):
    """hit@k, recall@k, ndcg@k of ranking items by training popularity.

    Every user gets the globally most popular items they have not seen
    (`seen` ids excluded; -1 is padding). Binary relevance: recall@k is the
    fraction of the user's held-out items in the top k, ndcg@k is DCG over
    the ideal DCG of `min(k, |held out|)` hits.

    Args:
        counts: `[V]` popularity of every id.
        held_out: `[U, L]` held-out ids (-1 = padding).
        seen: `[U, H]` ids to exclude (-1 = padding).
        ks: cut-offs.

    Returns:
        dict `{"hit@k", "recall@k", "ndcg@k"}` averaged over users.
    """
    kmax = max(ks)
    order = np.argsort(-np.asarray(counts), kind="stable")
    candidates = order[: kmax + seen.shape[1]]
    top = np.empty((len(held_out), kmax), np.int64)
    for u in range(len(held_out)):
        keep = ~np.isin(candidates, seen[u])
        top[u] = candidates[keep][:kmax]
    return ranking_metrics(top, held_out, ks)


def ranking_metrics(top, held_out, ks=KS):
    """hit@k, recall@k and ndcg@k of ranked ids `top [U, >= max(ks)]`."""
    relevant = held_out >= 0
    num_relevant = relevant.sum(axis=1)
    hits = np.zeros(top.shape, bool)
    for u in range(len(top)):
        hits[u] = np.isin(top[u], held_out[u][relevant[u]])
    discounts = 1.0 / np.log2(np.arange(top.shape[1]) + 2.0)
    out = {}
    for k in ks:
        h = hits[:, :k]
        ideal = np.array([discounts[: min(k, n)].sum() for n in num_relevant])
        out[f"hit@{k}"] = float(h.any(axis=1).mean())
        out[f"recall@{k}"] = float((h.sum(axis=1) / np.maximum(num_relevant, 1)).mean())
        out[f"ndcg@{k}"] = float(((h * discounts[:k]).sum(axis=1) / np.maximum(ideal, 1e-12)).mean())
    return out


def retrieval_metrics(model, items, bias, inputs, held_out, seen, batch_size=256):
    """Model metrics through `keras_cutbce.metrics.TopKRetrieval`.

    The hidden state at the last position of each user's input is scored
    against the whole item table (the `items` Embedding) plus the output
    `bias`, seen ids excluded.
    """
    from keras_cutbce.metrics import MeanReciprocalRank, TopKRetrieval

    hidden = model.predict(inputs, batch_size=batch_size, verbose=0)[:, -1, :]
    metrics = [TopKRetrieval(items, bias=bias, k=KS, exclude_ids=[0]),  # row 0 is padding
               MeanReciprocalRank(items, bias=bias, exclude_ids=[0])]
    out = {}
    for metric in metrics:
        for start in range(0, len(hidden), batch_size):
            stop = start + batch_size
            metric.update_state(held_out[start:stop], hidden[start:stop], exclude_ids=seen[start:stop])
        out.update({name: float(keras.ops.convert_to_numpy(v)) for name, v in metric.result().items()})
    return out


def make_loss(kind, items, bias, pos_weight=1.0, num_negatives=1, args=None, counts=None):
    """The `--loss` object, reading the model's item table and output bias."""
    if kind == "sampledsoftmax":  # row 0 (padding) is never drawn: a count of 0
        from keras_cutbce import SampledSoftmaxLoss

        uniform = np.ones_like(counts)
        uniform[0] = 0
        return SampledSoftmaxLoss(
            items, num_negatives, bias=bias, sampler=counts if args.sampler == "popularity" else uniform,
            in_batch_negatives=args.in_batch_negatives, item_counts=counts,
            logq_correction=not args.no_logq_correction, seed=args.seed)
    if kind == "cutbce":
        from keras_cutbce import CutBCELoss

        return CutBCELoss(items, bias, pos_weight=pos_weight)
    if kind == "dense":
        return DenseBCELoss(items, bias, pos_weight=pos_weight)
    if kind == "sampled":
        return SampledBCELoss(items, bias, num_targets=NUM_TARGETS, num_negatives=num_negatives)
    if kind == "softmax":
        return SoftmaxCrossEntropyLoss(items, bias, padding_id=0)
    if kind == "cutsoftmax":
        return CutSoftmaxCrossEntropyLoss(items, bias, padding_id=0)
    raise ValueError(f"Unknown loss {kind!r}; expected one of {LOSSES}.")


class EpochRetrieval(keras.callbacks.Callback):
    """Leave-last-out metrics after every epoch (`evaluate()` returns a metrics dict)."""

    def __init__(self, evaluate):
        super().__init__()
        self.evaluate = evaluate
        self.history = []

    def on_epoch_end(self, epoch, logs=None):
        self.history.append(self.evaluate())


def _rank_part(arrays, ranks):
    """Rank `r`'s windows `[r::R]` of each array, all ranks the same count (`ranks`: `(r, R)` or None)."""
    if ranks is None:
        return arrays
    rank, world = ranks
    count = len(arrays[0]) // world
    return tuple(a[rank::world][:count] for a in arrays)


def run(args, callbacks=(), ranks=None):
    """Trains and evaluates; returns the results dict (the `--json` content).

    `callbacks` are extra Keras callbacks for `fit` (e.g. the per-step loss
    recorder of `examples.sasrec.distributed`). `ranks=(rank, R)`: one rank
    of a torch.distributed run (`examples.sasrec.torch_distributed`): the
    table is split over the ranks, each trains on its part of every global
    batch of `--batch-size` windows and evaluates its part of the users; the
    metrics are the global ones.
    """
    start = time.perf_counter()
    sequences, num_items = load_sequences(args)
    train, held_out = data_lib.split_leave_last_out(sequences, holdout=NUM_TARGETS)
    if not train:
        raise SystemExit(f"No user has more than {NUM_TARGETS + 1} interactions.")
    inputs, targets, weights = data_lib.training_arrays(train, args.max_len, NUM_TARGETS)
    eval_inputs, eval_held_out, seen = data_lib.evaluation_arrays(train, held_out, args.max_len)
    if args.eval_users:
        eval_inputs, eval_held_out, seen = (
            a[: args.eval_users] for a in (eval_inputs, eval_held_out, seen)
        )
    eval_users, all_held_out, all_seen = len(eval_inputs), eval_held_out, seen  # the baseline's
    inputs, targets, weights = _rank_part((inputs, targets, weights), ranks)
    eval_inputs, eval_held_out, seen = _rank_part((eval_inputs, eval_held_out, seen), ranks)
    batch_size = args.batch_size if ranks is None else max(1, args.batch_size // ranks[1])
    negatives = f" num_negatives={args.num_negatives}" if args.loss == "sampled" else ""
    print(
        f"[sasrec] backend={keras.backend.backend()} data={args.data} loss={args.loss}"
        f"{negatives} users={len(train)} items={num_items} windows={len(inputs)} "
        f"max_len={args.max_len}"
    )

    set_random_seed(args.seed)
    model = build_sasrec(
        num_items, args.max_len, args.dim, args.blocks, dropout=args.dropout,
        num_targets=NUM_TARGETS, vocab_parallel=ranks is not None,
    )
    items = model.get_layer("items")
    bias = None if ranks is not None else model.get_layer("item_bias").bias  # split: the table's own
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=make_loss(args.loss, items, bias, args.pos_weight, args.num_negatives, args,
                       data_lib.item_counts(train, num_items)),
    )

    def evaluate():
        return retrieval_metrics(model, items, bias, eval_inputs, eval_held_out, seen)

    timer = StepTimer()
    callbacks = [timer, *callbacks]
    per_epoch = EpochRetrieval(evaluate) if args.eval_each_epoch else None
    if per_epoch is not None:
        callbacks.append(per_epoch)
    if args.loss == "sampled":
        data = NegativeSamplingBatches(
            inputs, targets, weights, args.batch_size, num_items, args.num_negatives,
            seed=args.seed,
        )
        fit_args = (data,)
        fit_kwargs = {}
    else:
        fit_args = (inputs, targets)
        fit_kwargs = {"sample_weight": weights, "batch_size": batch_size, "shuffle": True}
    history = model.fit(
        *fit_args,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=callbacks,
        verbose=args.verbose,
        **fit_kwargs,
    )

    model_metrics = per_epoch.history[-1] if per_epoch is not None else evaluate()
    counts = data_lib.item_counts(train, num_items)
    popular = popularity_metrics(counts, all_held_out, all_seen)
    results = {
        "loss": args.loss,
        "num_negatives": args.num_negatives if args.loss == "sampled" else None,
        "train_loss": float(history.history["loss"][-1]),
        "hit@8": model_metrics["hit@8"],
        "hit@10": model_metrics["hit@10"],
        "mrr": model_metrics["mrr"],
        "ndcg@10": model_metrics["ndcg@10"],
        "recall@10": model_metrics["recall@10"],
        "popularity_hit@8": popular["hit@8"],
        "popularity_ndcg@10": popular["ndcg@10"],
        "popularity_recall@10": popular["recall@10"],
        "steps_per_second": timer.steps_per_second(),
        "peak_memory_mb": peak_memory_mb(),
        "wall_seconds": time.perf_counter() - start,
        "num_items": int(num_items),
        "num_users": len(train),
        "eval_users": eval_users,
        "loss_kind": args.loss,
        "data": args.data,
        "backend": keras.backend.backend(),
        "epochs": args.epochs,
        "steps": len(timer.times),
    }
    if args.loss == "sampledsoftmax":
        results["variant"] = sampled_softmax_variant(args)
    if per_epoch is not None:
        for key in ("hit@8", "ndcg@10", "recall@10"):
            results[f"{key}_per_epoch"] = [m[key] for m in per_epoch.history]
    return results


def sampled_softmax_variant(args):
    """The row name of a `--loss sampledsoftmax` run: its negatives and correction."""
    parts = [f"{args.num_negatives} {args.sampler}"] if args.num_negatives else []
    parts += ["in-batch"] * args.in_batch_negatives
    correction = "no logQ" if args.no_logq_correction else "logQ"
    return f"sampled softmax ({' + '.join(parts)}, {correction})"


def main(argv=None):
    args = parse_args(argv)
    results = run(args)
    print(sasrec_table({run_name(results): results}))
    if args.json:
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"[sasrec] results written to {path}")
    return results
