"""Does exact pay? SASRec on ml-latest-small: sampled softmax (keras_cutbce.SampledSoftmaxLoss) beside the exact losses.

Every variant is one `python -m examples.sasrec --data movielens` run (same model, seed, batch and
evaluation: each user's last 8 items ranked against the whole catalogue, seen items excluded, by the
exact metrics `TopKRetrieval` and `MeanReciprocalRank`), in its own process, one after the other. Each
run's JSON is cached in `--runs-dir`, so an interrupted study resumes. `--synthetic-items N` instead times
a few steps per loss on a synthetic N-item catalogue (steps/s and peak RSS only: no quality result).

    KERAS_BACKEND=jax python benchmarks/sasrec_sampled.py --data-dir ../shared/data/ml-latest-small --epochs 3
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from benchmarks.common import write_results  # noqa: E402

SAMPLED = ["--loss", "sampledsoftmax", "--num-negatives"]
VARIANTS = {  # uniform without logQ is uniform with it: a constant shift of every logit
    "cutsoftmax": ["--loss", "cutsoftmax"],
    "cutbce": ["--loss", "cutbce"],
    "s256-uniform": SAMPLED + ["256"],
    "s4096-uniform": SAMPLED + ["4096"],
    "s256-popularity": SAMPLED + ["256", "--sampler", "popularity"],
    "s256-popularity-nologq": SAMPLED + ["256", "--sampler", "popularity", "--no-logq-correction"],
    "s4096-popularity": SAMPLED + ["4096", "--sampler", "popularity"],
    "s4096-popularity-nologq": SAMPLED + ["4096", "--sampler", "popularity", "--no-logq-correction"],
    "in-batch": SAMPLED + ["0", "--in-batch-negatives"],
}
COLUMNS = ["variant", "epochs", "hit@10", "ndcg@10", "mrr", "hit@8", "steps/s", "peak RSS (MiB)",
           "wall (s)", "load before", "load after"]


def run_variant(name, extra, args, path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if args.synthetic_items:
        data = ["--data", "synthetic", "--num-items", str(args.synthetic_items), "--num-users", "300",
                "--steps-per-epoch", str(args.steps), "--eval-users", "50"]
    else:
        data = ["--data", "movielens", "--data-dir", args.data_dir]
    argv = [sys.executable, "-m", "examples.sasrec", *data, *VARIANTS[name], "--epochs",
            str(args.epochs), "--max-len", str(args.max_len), "--seed", "0", "--json", path]
    before = os.getloadavg()[0]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
        return {"variant": name, "status": f"failed ({done.returncode})"}
    with open(path) as f:
        row = json.load(f)
    row.update(variant=name, load_before=before, load_after=os.getloadavg()[0])
    with open(path, "w") as f:
        json.dump(row, f, indent=2)
    return row


def table_row(row):
    if "status" in row:
        return {"variant": row["variant"], "epochs": row["status"]}
    return {"variant": row["variant"], "epochs": row["epochs"], "hit@10": round(row["hit@10"], 4),
            "ndcg@10": round(row["ndcg@10"], 4), "mrr": round(row["mrr"], 4),
            "hit@8": round(row["hit@8"], 4), "steps/s": round(row["steps_per_second"], 3),
            "peak RSS (MiB)": round(row["peak_memory_mb"]), "wall (s)": round(row["wall_seconds"]),
            "load before": round(row.get("load_before", float("nan")), 1),
            "load after": round(row.get("load_after", float("nan")), 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.path.join(REPO, "..", "shared", "data", "ml-latest-small"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=50)
    parser.add_argument("--synthetic-items", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6, help="--synthetic-items: training steps")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "sasrec_sampled"))
    args = parser.parse_args()
    prefix = args.out + (f"_{args.synthetic_items}" if args.synthetic_items else "")
    runs_dir = prefix + "_runs"
    os.makedirs(runs_dir, exist_ok=True)
    rows = []
    for name in args.variants:
        start = time.time()
        rows.append(run_variant(name, VARIANTS[name], args, os.path.join(runs_dir, name + ".json")))
        print(f"[sasrec_sampled] {name}: {time.time() - start:.0f} s", table_row(rows[-1]), flush=True)
    data = f"synthetic {args.synthetic_items} items" if args.synthetic_items else "ml-latest-small"
    what = (f"SASRec on {data}, one seed (0), {args.epochs} epoch(s), batch 64, max-len {args.max_len}, "
            "jax; hit@k / ndcg@10 / MRR over the whole catalogue (seen items excluded), exact metrics; "
            "steps/s: 1 / median step time after 2 warm-up steps; load: 1-minute load average.")
    table = markdown_table([table_row(r) for r in rows], COLUMNS)
    print(table)
    write_results(prefix, "Sampled softmax vs the exact losses (SASRec)", what, None,
                  machine_info(), table, {"runs": rows})


if __name__ == "__main__":
    main()
