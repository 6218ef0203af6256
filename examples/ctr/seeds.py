"""Results of one CTR mode over several training seeds: NE and AUC as mean +- sd.

Held-out NE of the same mode moves by about 1% between runs on weight
initialisation and shuffling alone, so one run cannot resolve a 1% gap. A
mode's runs over `--seeds N` training seeds are summarised here: NE and AUC as
mean and sample standard deviation (`ddof=1`; 0 for one seed), QPS p50/p90
over every timed step of every seed, the training NE curve as the mean per step.

Example:

>>> runs = [{"mode": "baseline", "ne": 0.75, "auc": 0.70, "step_seconds": [0.1],
...          "train_ne_per_step": [0.9], "steps": 2, "timed_steps": 1, "seed": 0},
...         {"mode": "baseline", "ne": 0.77, "auc": 0.72, "step_seconds": [0.1],
...          "train_ne_per_step": [1.1], "steps": 2, "timed_steps": 1, "seed": 1}]
>>> summary = aggregate(runs, batch_size=100)
>>> round(summary["ne"], 4), round(summary["ne_sd"], 4), summary["seeds"]
(0.76, 0.0141, [0, 1])
>>> mean_sd(summary["ne"], summary["ne_sd"], summary["seeds"])
'0.7600 ± 0.0141'
"""

import numpy as np

from keras_erase.throughput import throughput_percentiles


def _sd(values):
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def mean_sd(mean, sd, seeds):
    """`"mean ± sd"` (4 decimals); only the mean for a single seed."""
    if len(seeds) < 2:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {sd:.4f}"


def aggregate(runs, batch_size):
    """One mode's summary from its per-seed results (see the module docstring).

    Args:
        runs: the results of `run_mode` for each seed (same mode), each with
            its `seed`.
        batch_size: global examples per step (for the QPS percentiles); a
            `--nproc` run's `step_seconds` are its global steps' seconds.

    Returns:
        A dict with the first run's keys plus `ne`, `auc` (means), `ne_sd`,
        `auc_sd`, `ne_per_seed`, `auc_per_seed`, `seeds`, pooled
        `step_seconds` and QPS, and `train_ne_per_step` (mean over seeds) with
        `train_ne_sd_per_step`.
    """
    summary = dict(runs[0])
    ne = [r["ne"] for r in runs]
    auc = [r["auc"] for r in runs]
    seconds = [s for r in runs for s in r["step_seconds"]]
    summary.update(
        ne=float(np.mean(ne)),
        ne_sd=_sd(ne),
        auc=float(np.mean(auc)),
        auc_sd=_sd(auc),
        ne_per_seed=ne,
        auc_per_seed=auc,
        seeds=[r["seed"] for r in runs],
        step_seconds=seconds,
        timed_steps=len(seconds),
        dispatch_choices=[r.get("dispatch_choice") for r in runs],
    )
    if seconds:
        stats = throughput_percentiles(seconds, batch_size)
        summary.update(qps_p50=stats["p50"], qps_p90=stats["p90"])
    curves = [r["train_ne_per_step"] for r in runs if r["train_ne_per_step"]]
    if curves:
        length = min(len(c) for c in curves)
        stacked = np.array([c[:length] for c in curves])
        summary["train_ne_per_step"] = stacked.mean(axis=0).tolist()
        sd = stacked.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(length)
        summary["train_ne_sd_per_step"] = sd.tolist()
    if len(runs) > 1:  # per-rank details of one seed's run only
        for key in ("rank_qps_p50", "rank_step_seconds"):
            summary.pop(key, None)
    summary.pop("seed", None)
    return summary
