"""Host time per CTR step for every ERASE schedule combination (torch CPU), checkouts side by side.

Claim: the launcher x placement x graphs options add no host
time over the schedules they replace. On a CPU the whole step is host time;
on a GPU this is the host path the device must hide.

For each checkout given with `--repos NAME=PATH` (e.g. the code before the
change, unpacked with `git archive`, and this one) and each schedule label
(`standard`, `blocking`, `threaded`, `streams`, `inline+block_streams`, each
optionally `+graphs`), a fresh process (`PYTHONPATH=PATH`) builds the CTR
example model (`examples.ctr.model.build_ctr_model`, towers with
`detach_input=False`), trains `--warmup` + `--steps` steps with `fit` and
reports the median and 90th percentile of the timed steps' wall time. On CPU
the block streams run on the stream stand-in `tests/erase/fake_streams.py`
(not watching: its waits and events only) and CUDA Graphs on the stand-in
capture `RecordingCapture`, which replays the recorded aten ops one by one in
Python: its host time is the stand-in's, not a CUDA Graph replay's (one
launch). A checkout that has no such schedule (streams on CPU before the
change) is skipped for it. Cells alternate between the checkouts.

Usage:

    mkdir /tmp/erase-before && git archive BASE | tar -x -C /tmp/erase-before
    KERAS_BACKEND=torch python benchmarks/erase_host_time.py \\
        --repos before=/tmp/erase-before after=. --steps 20
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path and "--cell" not in sys.argv:  # a cell imports its checkout (PYTHONPATH)
    sys.path.insert(0, REPO)

SCHEDULES = [
    "standard", "blocking", "threaded", "streams", "inline+block_streams",
    "blocking+graphs", "threaded+graphs", "streams+graphs", "inline+block_streams+graphs",
]
PRESETS = ("standard", "blocking", "threaded", "streams")


def build(label, buckets):
    """The CTR model trained with schedule `label` on this checkout (`None`: it has none on CPU)."""
    from examples.ctr.model import build_ctr_model

    graphs = label.endswith("+graphs")
    name = label[: -len("+graphs")] if graphs else label
    if graphs:
        from keras_erase.torch.cuda_graphs import capture

        capture.set_default_capture(capture.RecordingCapture)
    if "streams" in name:
        try:
            from keras_erase.torch.schedules import placements
        except ImportError:
            return None  # this checkout has no stream stand-in: streams need CUDA
        from tests.erase.fake_streams import CheckedStreams

        placements.set_default_streams(CheckedStreams)
    if name in PRESETS:
        return build_ctr_model(buckets=buckets, dispatch=name, cuda_graphs=graphs)
    from keras_erase.config import EraseConfig
    from keras_erase.runtime import EraseRuntime

    launcher, _, placement = name.partition("+")
    model = build_ctr_model(buckets=buckets, dispatch="standard")
    config = EraseConfig(dispatch="early", launcher=launcher, placement=placement,
                         cuda_graphs=graphs)
    model.__dict__["_erase"] = EraseRuntime(config, True)
    return model


def run_cell(label, args):
    """One fresh CTR model in this process: `{"schedule", "median_ms", "p90_ms"}` or `None`."""
    import keras
    import numpy as np
    import torch

    from benchmarks.erase_cpu import StepTimer
    from examples.ctr.data import synthetic_ctr

    torch.set_num_threads(args.threads)
    keras.utils.set_random_seed(0)
    model = build(label, args.buckets)
    if model is None:
        return None
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy())
    data = synthetic_ctr(args.batch * (args.warmup + args.steps), buckets=args.buckets)
    timer = StepTimer()
    model.fit({"dense": data["dense"], "sparse": data["sparse"]}, data["label"],
              batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    timed = np.asarray(timer.steps[args.warmup:]) * 1e3
    from keras_erase.torch.cuda_graphs.runner import live_runners

    return {"schedule": label, "median_ms": float(np.median(timed)),
            "p90_ms": float(np.percentile(timed, 90)), "steps": int(timed.size),
            "graphs_captured": sum(r.captures for r in live_runners()),
            "graphs_disabled": any(r.disabled for r in live_runners())}


def run_in_process(repo, label, args):
    from benchmarks.common import run_cell

    return run_cell([os.path.abspath(__file__), "--cell", *map(str, [
        label, "--threads", args.threads, "--batch", args.batch, "--steps", args.steps,
        "--warmup", args.warmup, "--buckets", args.buckets,
    ])], repo, dict(os.environ, KERAS_BACKEND="torch"))


def table(rows, names, labels):
    head = "| schedule | " + " | ".join(f"{n} median ms | {n} p90 ms" for n in names)
    lines = [head + " | median ratio |", "|---|" + "---|" * (2 * len(names) + 1)]
    for label in labels:
        cells, medians = [], []
        for name in names:
            row = next((r for r in rows if r["repo"] == name and r["schedule"] == label), None)
            cells.append("-- | --" if row is None else f"{row['median_ms']:.1f} | {row['p90_ms']:.1f}")
            medians.append(None if row is None else row["median_ms"])
        ratio = (f"{medians[-1] / medians[0]:.2f}" if None not in (medians[0], medians[-1])
                 else "--")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repos", nargs="+", default=[f"this={REPO}"], help="NAME=PATH ...")
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps (graph capture: 3)")
    parser.add_argument("--buckets", type=int, default=1000)
    parser.add_argument("--out", default="/tmp/erase_host_time")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell is not None:
        row = run_cell(args.cell, args)
        print("ROW " + json.dumps(row if row is not None else {"schedule": args.cell}), flush=True)
        return None
    from benchmarks.common import machine_info, parse_repos, run_repos, write_results

    repos = parse_repos(args.repos)
    names = list(repos)
    rows = run_repos(repos, args.schedules, 1, lambda path, label: run_in_process(path, label, args))
    rows = [row for row in rows if "median_ms" in row]
    what = (f"torch.set_num_threads({args.threads}), batch {args.batch}, {args.steps} timed steps "
            f"after {args.warmup}, one process per cell (the checkouts alternating). Ratio: "
            f"{names[-1]} / {names[0]}. Graphs: the CPU stand-in capture's Python replay.")
    text = table(rows, names, args.schedules)
    print(text)
    write_results(args.out, "Host time per CTR step for every schedule combination (torch CPU)", what, None,
                  machine_info(threads=args.threads), text, {"rows": rows, "args": vars(args)})
    return rows


if __name__ == "__main__":
    main()
