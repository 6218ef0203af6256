"""The SASRec loss study's record (`benchmarks/sasrec_losses.py`): its cached runs (`run_missing` runs the
missing ones through the `run` it is given), the summary over seeds, its table and curves; `--speed`'s
per-round ratios."""

import argparse
import json
import os
import statistics

from benchmarks.common import fmt_spread, markdown_table, paired_ratios, read_json, spread, write_json

LOSSES = [("cutbce", 1), ("dense", 1), ("sampled", 1), ("sampled", 256), ("softmax", 1),
          ("cutsoftmax", 1)]


def loss_name(loss, num_negatives):
    return f"sampled ({num_negatives} neg.)" if loss == "sampled" else loss


QUALITY = ("hit@8", "ndcg@10", "recall@10")


def _mean_sd(values):
    """`(mean, sample sd)` of a list (sd None for one value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def _order(dataset, loss):
    """Sort key: real data first, then synthetic catalogues by size; losses as in `LOSSES`."""
    names = [loss_name(n, k) for n, k in LOSSES]
    digits = "".join(c for c in dataset if c.isdigit())
    size = int(digits) if dataset.startswith("synthetic") and digits else -1
    return (size, dataset, names.index(loss) if loss in names else len(names), loss)


def summarize(rows):
    """One summary per (dataset, loss) over the seeds that trained, in `_order`: quality and the per-epoch
    ndcg@10 curve as mean and sample sd over the seeds, cost (steps/s, peak RSS, wall time) as their median."""
    groups = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["loss"]), []).append(r)
    out = []
    for (dataset, loss), runs in sorted(groups.items(), key=lambda item: _order(*item[0])):
        trained = [r for r in runs if r.get("status") == "trained"]
        summary = {"dataset": dataset, "loss": loss, "seeds": sorted(r.get("seed", 0) for r in trained),
                   "status": "trained" if trained else runs[-1]["status"]}
        for key in QUALITY:
            values = [r[key] for r in trained if r.get(key) is not None]
            if values:
                summary[key], summary[key + "_sd"] = _mean_sd(values)
        for key in ("steps_per_second", "peak_memory_mb", "wall_seconds"):
            values = [r[key] for r in (trained or runs) if r.get(key) is not None]
            if values:
                summary[key] = spread(values)["median"]
        curves = [r["ndcg@10_per_epoch"] for r in trained if r.get("ndcg@10_per_epoch")]
        if curves and len({len(c) for c in curves}) == 1:
            columns = list(zip(*curves))
            summary["ndcg@10_per_epoch"] = [_mean_sd(list(c))[0] for c in columns]
            summary["ndcg@10_per_epoch_sd"] = [_mean_sd(list(c))[1] for c in columns]
        for key in ("popularity_hit@8", "popularity_ndcg@10", "popularity_recall@10"):
            if trained and trained[0].get(key) is not None:
                summary[key] = trained[0][key]
        if not trained and runs[-1].get("error"):
            summary["error"] = runs[-1]["error"]
        out.append(summary)
    return out


def _quality(summary, key):
    mean, sd = summary.get(key), summary.get(key + "_sd")
    if mean is None:
        return ""
    return f"{mean:.4f}" if sd is None else f"{mean:.4f} +- {sd:.4f}"


STUDY_COLUMNS = {"dataset": "data", "loss": "loss", "status": "status", "seeds": "seeds", "hit@8": "hit@8",
                 "ndcg@10": "ndcg@10", "recall@10": "recall@10", "steps_per_second": "train steps/s",
                 "peak_memory_mb": "peak RSS (MiB)", "wall_seconds": "wall time (s)"}
COST_FORMATS = {"steps_per_second": ".3g", "peak_memory_mb": ",.0f", "wall_seconds": ".0f"}


def study_table(summaries):
    """Markdown table: one row per (dataset, loss), plus each dataset's most-popular row."""
    rows, popular = [], {}
    for r in summaries:
        rows.append({"dataset": r["dataset"], "loss": r["loss"], "status": r["status"], "seeds": len(r["seeds"]) or "",
                     **{k: _quality(r, k) for k in QUALITY},
                     **{k: format(r[k], f) for k, f in COST_FORMATS.items() if r.get(k) is not None}})
        if r.get("popularity_hit@8") is not None:
            popular.setdefault(r["dataset"], r)
    rows += [{"dataset": dataset, "loss": "most popular", **{k: "-" for k in list(STUDY_COLUMNS)[2:]},
              **{k: f"{r['popularity_' + k]:.4f}" for k in QUALITY}} for dataset, r in popular.items()]
    return markdown_table(rows, list(STUDY_COLUMNS), list(STUDY_COLUMNS.values()))


def plot_curves(summaries, path, dataset):
    """PNG of mean ndcg@10 after every epoch (+- sd band over seeds), one line per loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    popular = None
    styles = {"cutbce": {"linewidth": 4, "alpha": 0.5}, "dense": {"linestyle": ":"}}
    epochs = 1
    for r in summaries:
        curve = r.get("ndcg@10_per_epoch")
        if r["dataset"] != dataset or not curve:
            continue
        epochs = max(epochs, len(curve))
        x = list(range(1, len(curve) + 1))
        label = f"{r['loss']} ({len(r['seeds'])} seed{'s' if len(r['seeds']) != 1 else ''})"
        (line,) = axis.plot(x, curve, marker="o", markersize=3, label=label,
                            **styles.get(r["loss"], {}))
        sd = r.get("ndcg@10_per_epoch_sd") or []
        if sd and all(v is not None for v in sd):
            axis.fill_between(x, [m - v for m, v in zip(curve, sd)],
                              [m + v for m, v in zip(curve, sd)], color=line.get_color(), alpha=0.15)
        popular = r.get("popularity_ndcg@10", popular)
    axis.set_xticks(range(1, epochs + 1, max(1, epochs // 10)))
    if popular is not None:
        axis.axhline(popular, color="grey", linestyle="--", label="most popular")
    axis.set_xlabel("epoch")
    axis.set_ylabel("ndcg@10 (leave-last-8-out)")
    axis.set_title(f"SASRec on {dataset}: ndcg@10 after each epoch, per loss\n"
                   "(mean over seeds, band = +- 1 sd; cutbce and dense compute the same loss)",
                   fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def parse_losses(text):
    """`"cutbce,sampled:256"` -> `[("cutbce", 1), ("sampled", 256)]`, in the given order."""
    out = []
    for item in text.split(","):
        name, _, negatives = item.strip().partition(":")
        if (name, int(negatives or 1)) not in LOSSES:
            raise argparse.ArgumentTypeError(
                f"unknown loss {item!r}; expected some of "
                + ",".join(n if n != "sampled" else f"sampled:{k}" for n, k in LOSSES))
        out.append((name, int(negatives or 1)))
    return out


def run_path(runs_dir, dataset, loss, seed):
    """The cached row of one run: `<runs_dir>/<dataset>__<loss>__seed<seed>.json`."""
    slug = "__".join("".join(c if c.isalnum() else "-" for c in part).strip("-")
                     for part in (dataset, loss))
    return os.path.join(runs_dir, f"{slug}__seed{seed}.json")


def load_runs(runs_dir):
    """Every cached run row in `runs_dir` (sorted by file name)."""
    names = sorted(n for n in os.listdir(runs_dir) if n.endswith(".json")) if os.path.isdir(runs_dir) else []
    return [read_json(os.path.join(runs_dir, name)) for name in names]


def run_missing(runs_dir, seeds, cases, losses, run):
    """Runs and caches every `(seed, dataset, loss)` without a row in `runs_dir`, seed by seed: `cases` are
    `(dataset, example arguments)`, `losses` `(loss, negatives)`, `run(dataset, loss, negatives, args, seed)`."""
    for seed in range(seeds):
        for dataset, example_args in cases:
            for loss, negatives in losses:
                path = run_path(runs_dir, dataset, loss_name(loss, negatives), seed)
                if os.path.exists(path):
                    print(f"cached: {path}", flush=True)
                    continue
                row = run(dataset, loss, negatives, example_args, seed)
                row["load_average_1_5_15"] = [round(v, 2) for v in os.getloadavg()]
                write_json(path, row)
                print(json.dumps({k: v for k, v in row.items()
                                  if not k.endswith("_per_epoch")}), flush=True)


def speed_summaries(rows, losses):
    """One row per (dataset, loss): the spreads, and the per-round ratios to `losses[0]`."""
    out = []
    for dataset in sorted({r["dataset"] for r in rows}):
        mine = [r for r in rows if r["dataset"] == dataset]
        for loss in losses:
            runs = [r for r in mine if r["loss"] == loss]
            if not runs:
                continue
            row = {"data": dataset, "loss": loss, "rounds": len(runs)}
            for key, name in (("cpu_s_per_step", "CPU"), ("wall_s_per_step", "wall")):
                row[f"{name} s / step"] = fmt_spread(spread([r[key] for r in runs]))
                ratios = paired_ratios(mine, loss, ("loss", losses[0]), key)
                row[f"{name} / first loss"] = fmt_spread(ratios) if ratios else ""
                row[key] = spread([r[key] for r in runs])
            row["load (1 min)"] = fmt_spread(spread([r["load_1min"][0] for r in runs]), digits=2)
            out.append(row)
    return out
