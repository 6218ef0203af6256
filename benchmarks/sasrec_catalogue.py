"""SASRec on a synthetic catalogue of 10^6 items: `CutBCELoss` vs dense BCE.

Runs `python -m examples.sasrec` once per (loss, batch size) case, each in its
own process (so peak memory is its own) under an address-space cap
(`--memory-cap-gib`, default 16 GiB of this machine's 24), for a fixed number of
training steps, and reports steps/s (after 2 warm-up steps), peak resident memory
and the retrieval metrics side by side. A run that hits the cap is reported as
out of memory, with the error line.

At batch 64 x 30 positions the dense loss needs the `[64, 30, 10^6]` logits in
float32 (7.2 GiB) plus the multi-hot targets and the gradient of the logits, so
it does not fit the cap; at batch 8 both run and can be timed side by side.

Usage:

    KERAS_BACKEND=torch python benchmarks/sasrec_catalogue.py      # writes
        benchmarks/results/sasrec_catalogue.{md,json}
    KERAS_BACKEND=torch python benchmarks/sasrec_catalogue.py --quick   # smoke run (/tmp)
"""

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.common import machine_info, markdown_table, run_capped, write_results  # noqa: E402

CASES = [("cutbce", 64), ("dense", 64), ("cutbce", 8), ("dense", 8)]


def run_case(loss, batch, args, backend):
    """One example run in a capped subprocess; returns its results row."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        command = [sys.executable, "-m", "examples.sasrec", "--loss", loss, "--num-items", str(args.num_items),
                   "--num-users", str(args.num_users), "--batch-size", str(batch), "--epochs", "1",
                   "--steps-per-epoch", str(args.steps), "--max-len", str(args.max_len), "--json", path,
                   "--verbose", "0"]
        row = {"loss": loss, "batch": batch, "num_items": args.num_items,
               **run_capped(command, args.memory_cap_gib, args.timeout, dict(os.environ, KERAS_BACKEND=backend))}
        if row["status"] == "ok":
            with open(path) as f:
                result = json.load(f)
            row.update(status="trained", steps=result["steps"], steps_per_second=result["steps_per_second"],
                       peak_memory_mb=result["peak_memory_mb"], hit_at_8=result["hit@8"],
                       popularity_hit_at_8=result["popularity_hit@8"])
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run, results in /tmp")
    parser.add_argument("--num-items", type=int, default=1_000_000)
    parser.add_argument("--num-users", type=int, default=1200)
    parser.add_argument("--max-len", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--memory-cap-gib", type=float, default=16.0)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results",
                                                      "sasrec_catalogue"))
    args = parser.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "torch")
    if args.quick:
        args.num_items, args.num_users, args.steps = 20_000, 200, 4
        if args.out == parser.get_default("out"):
            args.out = "/tmp/sasrec_catalogue_quick"
    rows = []
    for loss, batch in CASES:
        row = run_case(loss, batch, args, backend)
        rows.append(row)
        print(json.dumps(row), flush=True)
    by_case = {(r["loss"], r["batch"]): r for r in rows}
    for batch in sorted({b for _, b in CASES}):
        cut, dense = by_case.get(("cutbce", batch)), by_case.get(("dense", batch))
        if cut and dense and cut["status"] == dense["status"] == "trained":
            cut["speed_over_dense"] = cut["steps_per_second"] / dense["steps_per_second"]
            cut["memory_over_dense"] = cut["peak_memory_mb"] / dense["peak_memory_mb"]
    info = machine_info(backend=backend, num_items=args.num_items, num_users=args.num_users, max_len=args.max_len,
                        steps=args.steps, memory_cap_gib=args.memory_cap_gib,
                        threads="framework default (torch: one per core)")
    what = (f"{args.steps} training steps per run (steps/s after 2 warm-up steps), sequence length {args.max_len}, "
            f"each run in its own process capped at {args.memory_cap_gib:g} GiB of address space; peak RSS is the "
            "whole process (model, Adam state, data, evaluation). hit@8 after so few steps is not a quality result, "
            "only a check that the run finished.")
    table = markdown_table(rows, ["loss", "batch", "status", "steps_per_second", "peak_memory_mb", "speed_over_dense",
                                  "memory_over_dense", "hit_at_8", "error"],
                           ["loss", "batch", "status", "steps/s", "peak RSS (MiB)", "steps/s vs dense",
                            "memory vs dense", "hit@8", "error"])
    write_results(args.out, f"SASRec on a synthetic catalogue of {args.num_items:,} items: CutBCELoss vs dense BCE",
                  what, None, info, table, {"rows": rows})


if __name__ == "__main__":
    main()
