"""The gradient hand-off on the CTR example (torch CPU): embedding backwards per step and QPS.

Claim: with the hand-off, the shared embedding table's backward
runs once per step in every schedule (before: once per `detach_input=False`
tower, six on the CTR example), and the early schedules get faster.

For each checkout given with `--repos NAME=PATH` (e.g. the code before the
hand-off in a `git worktree` and this one) and each mode, a fresh process
(`PYTHONPATH=PATH`, so that checkout's `keras_erase` and `examples` are
imported) builds the CTR example model (`examples.ctr.model.build_ctr_model`,
the towers with `detach_input=False`) and:

1. counts the embedding table's backwards over `--count-steps` steps: the
   gradient accumulations into the table (a post-accumulate-grad hook: one per
   backward call that reaches it, on any thread);
2. trains `--steps` steps with `fit` and reports the p50/p90 of per-step
   examples/s after `--warmup` steps (p90 = the fast end, as in the ERASE
   paper).

Cells of all checkouts are interleaved (checkout, mode, repetition rotate), so
both see the same machine load; the table gives medians over `--reps` and the
ratio of each checkout to the first one.

Usage:

    git worktree add /tmp/erase-old COMMIT   # a commit before the hand-off
    KERAS_BACKEND=torch python benchmarks/erase_handoff.py \
        --repos before=/tmp/erase-old after=. --threads 2
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path and "--cell" not in sys.argv:  # a cell imports its checkout (PYTHONPATH)
    sys.path.insert(0, REPO)

MODES = {  # name -> (detached, dispatch)
    "baseline": (False, None),
    "detached": (True, "standard"),
    "erase-blocking": (True, "blocking"),
    "erase-threaded": (True, "threaded"),
    "erase-auto": (True, "auto"),
}


def run_cell(mode, args):
    """One fresh CTR model in this process: `{"mode", "backwards_per_step", "p50", "p90"}`."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import numpy as np
    import torch

    from benchmarks.erase_cpu import StepTimer
    from examples.ctr.data import synthetic_ctr
    from examples.ctr.model import build_ctr_model

    import keras_erase

    torch.set_num_threads(args.threads)
    detached, dispatch = MODES[mode]
    kwargs = {} if dispatch is None else {"dispatch": dispatch}
    keras.utils.set_random_seed(0)
    model = build_ctr_model(detached=detached, buckets=args.buckets, **kwargs)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy())
    data = synthetic_ctr(args.batch * (args.count_steps + args.steps), buckets=args.buckets)
    x = {"dense": data["dense"], "sparse": data["sparse"]}
    y = data["label"]
    table = model.get_layer("embeddings").embeddings.value
    accumulations = []
    hook = table.register_post_accumulate_grad_hook(lambda p: accumulations.append(1))
    n = args.batch * args.count_steps
    model.fit({k: v[:n] for k, v in x.items()}, y[:n], batch_size=args.batch, epochs=1,
              shuffle=False, verbose=0)
    hook.remove()
    timer = StepTimer()
    model.fit({k: v[n:] for k, v in x.items()}, y[n:], batch_size=args.batch, epochs=1,
              shuffle=False, verbose=0, callbacks=[timer])
    rates = np.sort(args.batch / np.asarray(timer.steps[args.warmup:]))
    return {
        "mode": mode,
        "backwards_per_step": len(accumulations) / args.count_steps,
        "p50": float(np.percentile(rates, 50)),
        "p90": float(np.percentile(rates, 90)),
        "dispatch_choice": getattr(model, "dispatch_choice", None),
        "keras_erase": os.path.dirname(os.path.dirname(os.path.abspath(keras_erase.__file__))),
    }


def run_in_process(repo, mode, args):
    from benchmarks.common import run_cell

    return run_cell([os.path.abspath(__file__), "--cell", *map(str, [
        mode, "--threads", args.threads, "--batch", args.batch, "--steps", args.steps,
        "--warmup", args.warmup, "--count-steps", args.count_steps, "--buckets", args.buckets,
    ])], repo, dict(os.environ, KERAS_BACKEND="torch"))


def summarize(rows, names, modes):
    import numpy as np

    lines = [
        "| mode | " + " | ".join(
            f"{n} backwards/step | {n} p50 | {n} p90" for n in names
        ) + " | p50 ratio | p90 ratio |",
        "|---|" + "---|" * (3 * len(names) + 2),
    ]
    summary = {}
    for mode in modes:
        cells, medians = [], {}
        for name in names:
            mine = [r for r in rows if r["repo"] == name and r["mode"] == mode]
            medians[name] = {
                k: float(np.median([r[k] for r in mine]))
                for k in ("backwards_per_step", "p50", "p90")
            }
            m = medians[name]
            cells.append(f"{m['backwards_per_step']:.0f} | {m['p50']:.0f} | {m['p90']:.0f}")
        first, last = medians[names[0]], medians[names[-1]]
        ratios = [last[k] / first[k] for k in ("p50", "p90")]
        summary[mode] = {"medians": medians, "p50_ratio": ratios[0], "p90_ratio": ratios[1]}
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {ratios[0]:.2f} | {ratios[1]:.2f} |")
    return "\n".join(lines), summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repos", nargs="+", default=[f"this={REPO}"], help="NAME=PATH ...")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40, help="timed fit steps")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of p50/p90")
    parser.add_argument("--count-steps", type=int, default=3, help="steps of the backward count")
    parser.add_argument("--buckets", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=2, help="processes per cell")
    parser.add_argument("--out", default="/tmp/erase_handoff")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell is not None:
        print("ROW " + json.dumps(run_cell(args.cell, args)), flush=True)
        return None
    from benchmarks.common import machine_info, parse_repos, run_repos, write_results

    repos = parse_repos(args.repos)
    names = list(repos)
    rows = run_repos(repos, args.modes, args.reps, lambda path, mode: run_in_process(path, mode, args))
    table, summary = summarize(rows, names, args.modes)
    what = (f"torch.set_num_threads({args.threads}), batch {args.batch}, {args.steps} steps "
            f"({args.warmup} warm-up), {args.reps} processes per cell (the checkouts alternating). "
            f"backwards/step: the shared embedding table's backwards per step; p50/p90: per-step "
            f"examples/s after the warm-up (p90 = the fast end). Ratios: {names[-1]} / {names[0]}.")
    print(table)
    write_results(args.out, "The gradient hand-off on the CTR example (torch CPU)", what, None,
                  machine_info(threads=args.threads), table, {"rows": rows, "summary": summary, "args": vars(args)})
    return rows


if __name__ == "__main__":
    main()
