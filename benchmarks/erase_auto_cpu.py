"""`dispatch="auto"` against the standard step on CPU (torch), before / after a change.

Claim: on a CPU `EraseModel(dispatch="auto")` costs nothing: it runs the
standard step from the first step without measuring, so the median over
repeats of `p90(auto) / p90(standard)` is >= 0.98 at every size (on a quiet
machine; the spread says how far two runs of the same step differ here).
Before that change `auto` measured its candidates in the first steps and could
keep a schedule chosen under a load the rest of the fit did not share.

Model: `benchmarks.erase_cpu.build_ctr_model` (six detached towers of three
`Dense(width, relu)` layers on a 256-feature input, a top MLP), torch's default
intra-op threads, `EraseModel(intra_op_threads="auto")`.

For each checkout (`--repos NAME=PATH`, e.g. `before=/path/to/main after=.`),
each size `(batch, width)` and each repeat, one fresh process per mode
(`standard`, `auto`; `PYTHONPATH=PATH`, so that checkout's `keras_erase` is
imported) trains a fresh model for `--steps` steps with one `fit`. Per process:
`p90` = the 90th percentile of per-step examples/s over the steps after the
first `--warmup` (the fast end, as the ERASE paper reports it; `auto`'s
measuring steps after the warm-up are among them), and `epoch` = examples/s of
the whole `fit`, every measuring step included. Within a repeat the
processes of both checkouts and both modes alternate (the order rotates per
repeat), so a change of the machine's load hits them alike; `auto / standard`
is taken per repeat (the two processes of the same checkout, adjacent in time),
then the median and the spread (min..max) over the repeats are reported.

Usage:

    git worktree add /tmp/erase-before main
    KERAS_BACKEND=torch python benchmarks/erase_auto_cpu.py \\
        --repos before=/tmp/erase-before after=. --out benchmarks/results/erase_auto_cpu
"""

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [(256, 64), (512, 256), (1024, 256), (2048, 512)]
MODES = ("standard", "auto")


def run_cell(mode, batch, width, args):
    """One fresh model, one `fit` of `args.steps` steps, in this process: its row."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    sys.path.append(REPO)  # benchmarks/ if PYTHONPATH lacks it; keras_erase from PYTHONPATH
    import keras
    import numpy as np

    import keras_erase
    from benchmarks.erase_cpu import StepTimer, build_ctr_model, synthetic_ctr_data

    model = build_ctr_model(width, 6, 3, 256, dispatch=mode)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    x, y = synthetic_ctr_data(batch * args.steps, 256)
    timer = StepTimer()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    rates = batch / np.asarray(timer.steps[args.warmup:])
    selector = model._erase.selector  # None where auto measures nothing
    choice = model.dispatch_choice
    if selector is not None and selector.done and isinstance(selector.choice, tuple):
        choice = "@".join(map(str, selector.choice))  # an older checkout: mode@threads
    return {
        "mode": mode, "batch": batch, "width": width,
        "p90": float(np.percentile(rates, 90)),
        "p50": float(np.percentile(rates, 50)),
        "epoch": batch * len(timer.steps) / timer.epoch_seconds,
        "choice": choice,
        "measuring_steps": 0 if selector is None else selector.steps,
        "keras_erase": os.path.dirname(os.path.dirname(os.path.abspath(keras_erase.__file__))),
    }


def run_in_process(repo, mode, batch, width, args):
    from benchmarks.common import run_cell

    return run_cell([os.path.abspath(__file__), "--cell", f"{mode},{batch},{width}", "--steps", str(args.steps),
                     "--warmup", str(args.warmup)], repo, dict(os.environ, KERAS_BACKEND="torch"))


def summarize(rows, names, sizes):
    """Per size and checkout: median and spread over the repeats of auto / standard."""
    import numpy as np

    table = []
    for batch, width in sizes:
        entry = {"batch": batch, "width": width}
        for name in names:
            mine = [r for r in rows if r["repo"] == name and (r["batch"], r["width"]) == (batch, width)]
            reps = sorted({r["rep"] for r in mine})
            for key in ("p90", "epoch"):
                ratios = []
                for rep in reps:
                    pair = {r["mode"]: r for r in mine if r["rep"] == rep}
                    if set(pair) == set(MODES):
                        ratios.append(pair["auto"][key] / pair["standard"][key])
                entry[f"{name} {key}"] = (
                    f"{np.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
                    if ratios else "-"
                )
                entry[f"{name} {key} median"] = float(np.median(ratios)) if ratios else None
            autos = [r for r in mine if r["mode"] == "auto"]
            entry[f"{name} auto kept"] = ", ".join(str(r["choice"]) for r in autos)
            entry[f"{name} measuring steps"] = ", ".join(str(r["measuring_steps"]) for r in autos)
        table.append(entry)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repos", nargs="+", default=[f"this={REPO}"], help="NAME=PATH ...")
    parser.add_argument("--sizes", nargs="+", default=None, help="batch,width pairs")
    parser.add_argument("--steps", type=int, default=60, help="fit steps per process")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of p90")
    parser.add_argument("--reps", type=int, default=3, help="alternating repeats")
    parser.add_argument("--out", default="/tmp/erase_auto_cpu")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell is not None:
        mode, batch, width = args.cell.split(",")
        print("ROW " + json.dumps(run_cell(mode, int(batch), int(width), args)), flush=True)
        return None
    sizes = SIZES if not args.sizes else [tuple(int(v) for v in s.split(",")) for s in args.sizes]
    from benchmarks.common import machine_info, parse_repos, run_repos, write_results

    repos = parse_repos(args.repos)
    names = list(repos)
    started = time.perf_counter()
    cells = [(mode, batch, width) for batch, width in sizes for mode in MODES]
    rows = run_repos(repos, cells, args.reps, lambda path, cell: run_in_process(path, *cell, args))
    table = summarize(rows, names, sizes)
    columns = ["batch", "width"] + [
        f"{n} {k}" for n in names for k in ("p90", "epoch", "auto kept", "measuring steps")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for entry in table:
        lines.append("| " + " | ".join(str(entry[c]) for c in columns) + " |")
    what = (
        f"Each cell: auto / standard, median over {args.reps} alternating repeats, spread "
        f"(min..max) in brackets. p90: 90th percentile of per-step examples/s after the first "
        f"{args.warmup} of {args.steps} steps (the fast end); epoch: examples/s of the whole "
        "fit, every measuring step of auto included. 'auto kept': each repeat's "
        "dispatch_choice at the end of its fit (mode@main-thread intra-op threads where a "
        "checkout's auto measured thread budgets); 'measuring steps': the steps auto spent "
        f"measuring. torch default threads. Wall time {time.perf_counter() - started:.0f} s."
    )
    print("\n".join(lines))
    write_results(args.out, "auto / standard on CPU (torch)", what, None, machine_info(threads="torch default"),
                  "\n".join(lines), {"rows": rows, "table": table, "args": vars(args)})
    return table


if __name__ == "__main__":
    main()
