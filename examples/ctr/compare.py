"""`python -m examples.ctr --compare`: every mode in one process, timed alternating.

A machine shared with other jobs changes speed by several times within a
minute, so modes timed one after the other measure the load, not the schedule.
Here:

- QPS: one process builds every mode's model (same seed, same initial weights,
  torch's same intra-op threads; `"threaded"` splits them between its two
  threads, so every mode has the same thread budget) and trains them in turn,
  `--interleave-steps` steps each, over the same shuffled batches, until each
  has trained its epoch(s). A *repeat* is one such block of steps per mode, the
  blocks of one round being adjacent in time. Each step is timed around
  `train_on_batch` (CUDA synchronized). The first `--warmup-steps` steps of each
  mode are not timed.
- Gain: per repeat, `p(mode) / p(baseline) - 1` of the two adjacent blocks
  (p50 or p90 of per-step examples/s, p90 = the fast end as in the ERASE paper);
  the table gives the gain of the pooled steps and the spread (min..max) of the
  per-repeat gains. A gain whose spread includes 0 is marked "no gain".
- NE / AUC: every mode from this run (the first seed); the other `--seeds` are
  trained the same way for `baseline` and `detached` only: every ERASE schedule
  computes the detached model's gradients (its NE equals `detached`'s to float
  rounding, shown on the first seed), so more seeds of them would only repeat it.

Example:

>>> spread_gain([0.10, -0.02, 0.05])
(0.05, -0.02, 0.1, False)
"""

import keras
import numpy as np

from examples import set_random_seed
from examples.ctr.model import NormalizedEntropy, build_ctr_model
from keras_erase.throughput import examples_per_second

__all__ = ["compare_modes", "interleaved_run", "spread_gain"]

NE_SEED_MODES = ("baseline", "detached")  # the modes whose NE differs


def spread_gain(per_repeat):
    """Summarises per-repeat gains: `(median, min, max, clear)`; `clear` is False inside the spread.

    A gain is clear only when every repeat agrees on its sign (the spread does
    not include 0).
    """
    values = np.asarray(per_repeat, dtype=np.float64)
    low, high = float(values.min()), float(values.max())
    clear = bool(low > 0.0 or high < 0.0)
    return round(float(np.median(values)), 12), low, high, clear


def build_mode_model(mode, args, train, seed, erase_options):
    """Returns the compiled CTR model of `mode` from the initial weights of `seed`."""
    set_random_seed(seed)
    model = build_ctr_model(
        detached=mode != "baseline",
        buckets=args.buckets,
        embedding_dim=args.embedding_dim,
        width=args.width,
        depth=args.depth,
        initial_ctr=float(np.clip(train["label"].mean(), 0.01, 0.99)),
        **erase_options.get(mode, {}),
    )
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.BinaryCrossentropy(),
        metrics=[NormalizedEntropy(name="ne"), keras.metrics.AUC(name="auc")],
    )
    return model


def _batches(train, args, seed):
    """The epoch(s) of shuffled batches every mode trains on: a list of index arrays."""
    rng = np.random.default_rng(seed)
    n = len(train["label"])
    per_epoch = n // args.batch_size
    if args.steps_per_epoch is not None:
        per_epoch = min(per_epoch, args.steps_per_epoch)
    batches = []
    for _ in range(args.epochs):
        order = rng.permutation(n)
        batches += [order[i * args.batch_size:(i + 1) * args.batch_size] for i in range(per_epoch)]
    return batches


def interleaved_run(modes, args, train, test, seed, erase_options, synchronize=None, clock=None):
    """Trains `modes` in alternating blocks of steps in this process; returns one result per mode.

    Each result has the keys of `train.run_mode`'s result plus `repeats`: per
    repeat, the step seconds of that block (after warm-up).
    """
    import time

    clock = clock or time.perf_counter
    models = {mode: build_mode_model(mode, args, train, seed, erase_options) for mode in modes}
    batches = _batches(train, args, seed)
    block = max(1, int(args.interleave_steps))
    seconds = {mode: [] for mode in modes}
    repeats = {mode: [] for mode in modes}
    curves = {mode: [] for mode in modes}
    for model in models.values():
        model.reset_metrics()
    print(f"[ctr] seed={seed}: {', '.join(modes)} in one process, {block} steps each in turn, "
          f"{len(batches)} steps per mode", flush=True)
    for round_index, start in enumerate(range(0, len(batches), block)):
        shift = round_index % len(modes)  # no mode always runs first
        for mode in modes[shift:] + modes[:shift]:
            model, times = models[mode], []
            for index in batches[start:start + block]:
                x = {"dense": train["dense"][index], "sparse": train["sparse"][index]}
                if synchronize is not None:
                    synchronize()
                begin = clock()
                logs = model.train_on_batch(x, train["label"][index], return_dict=True)
                if synchronize is not None:
                    synchronize()
                elapsed = clock() - begin
                curves[mode].append(float(logs["ne"]))
                if len(curves[mode]) > args.warmup_steps:
                    times.append(elapsed)
            if times:
                seconds[mode] += times
                repeats[mode].append(times)
    results = []
    for mode in modes:
        model = models[mode]
        scores = model.evaluate(
            {"dense": test["dense"], "sparse": test["sparse"]}, test["label"],
            batch_size=max(args.batch_size, 2048), return_dict=True, verbose=0,
        )
        print(f"[ctr] mode={mode} seed={seed}: held-out NE {float(scores['ne']):.4f} "
              f"AUC {float(scores['auc']):.4f}", flush=True)
        results.append({
            "mode": mode,
            "seed": seed,
            "dispatch_choice": getattr(model, "dispatch_choice", None),
            "dispatch_explanation": getattr(model, "dispatch_explanation", None),
            "ne": float(scores["ne"]),
            "auc": float(scores["auc"]),
            "steps": len(curves[mode]),
            "timed_steps": len(seconds[mode]),
            "step_seconds": seconds[mode],
            "repeats": repeats[mode],
            "train_ne_per_step": curves[mode],
            "backend": keras.backend.backend(),
        })
    return results


def gains(result, base, batch_size, q):
    """Per-repeat gains of `result` over `base` at percentile `q` (the adjacent blocks)."""
    out = []
    for mine, theirs in zip(result["repeats"], base["repeats"]):
        a = np.percentile(examples_per_second(mine, batch_size), q)
        b = np.percentile(examples_per_second(theirs, batch_size), q)
        out.append(a / b - 1.0)
    return out


def compare_modes(modes, args, train, test, erase_options, synchronize=None, aggregate=None):
    """The whole `--compare`: the timed run (first seed) plus the other seeds' NE runs."""
    first = interleaved_run(modes, args, train, test, args.seed, erase_options, synchronize)
    per_mode = {r["mode"]: [r] for r in first}
    ne_modes = [m for m in modes if m in NE_SEED_MODES]
    for seed in range(args.seed + 1, args.seed + args.seeds):
        for r in interleaved_run(ne_modes, args, train, test, seed, erase_options, synchronize):
            per_mode[r["mode"]].append(r)
    results = []
    for mode in modes:
        runs = per_mode[mode]
        summary = aggregate(runs, args.batch_size)
        timed = runs[0]  # QPS: the alternating run only
        summary.update(step_seconds=timed["step_seconds"], timed_steps=timed["timed_steps"],
                       repeats=timed["repeats"], dispatch_explanation=timed["dispatch_explanation"])
        rates = examples_per_second(timed["step_seconds"], args.batch_size)
        summary.update(qps_p50=float(np.percentile(rates, 50)),
                       qps_p90=float(np.percentile(rates, 90)))
        results.append(summary)
    base = results[0]
    for r in results:
        r["gain_p50"] = spread_gain(gains(r, base, args.batch_size, 50))
        r["gain_p90"] = spread_gain(gains(r, base, args.batch_size, 90))
    return results
