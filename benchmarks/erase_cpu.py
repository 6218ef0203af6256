"""ERASE on CPU (torch): examples/s of a CTR model with six detached dense towers.

For each (batch, width) configuration and each mode, `--reps` fresh processes
each train a fresh model for one epoch of `--epoch-steps` steps with `fit`
(torch's default intra-op threads; `EraseModel(intra_op_threads="auto")`).
Per process:

- `p50`, `p90`: the 50th and 90th percentiles of per-step examples/s
  (`batch / step seconds`, `keras_erase.throughput.throughput_percentiles`)
  over the steps after the first `--warmup`: p90 is the *fast* end (90% of the
  steps are slower), as in the ERASE paper. `auto`'s remaining measuring steps,
  if any, are among them.
- `epoch`: examples/s of the whole epoch, first step included (for `auto`, all
  its measuring steps): what a user's epoch costs.

The table gives the median over the processes and the spread (min-max) of
each figure. `auto / standard` compares each `auto` process with the
`standard` process of the same repetition (a pair; modes run in a rotated order
within a repetition) and reports the median over the pairs. (On a CPU `auto`
is the standard step without measuring; `benchmarks/erase_auto_cpu.py`
compares it with the standard step across checkouts.)

Modes: `standard`, `blocking`, `threaded`, `auto` (`dispatch=` of the same
`EraseModel`).

Usage:

    KERAS_BACKEND=torch python benchmarks/erase_cpu.py          # writes
        benchmarks/results/erase_cpu.{md,json}
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py --quick  # smoke run (/tmp)
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py --modes standard auto \
        --configs 512,256 --out benchmarks/results/erase_cpu_auto   # the auto check
"""

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from benchmarks.common import write_text  # noqa: E402
from keras_erase import DetachBlock  # noqa: E402
from keras_erase import EraseModel  # noqa: E402
from keras_erase.throughput import throughput_percentiles  # noqa: E402

CONFIGS = [(512, 256), (1024, 256)]
MODES = ["standard", "blocking", "threaded", "auto"]


def build_ctr_model(
    width=256,
    num_towers=6,
    depth=3,
    input_dim=256,
    top_width=64,
    loss_weight=0.1,
    seed=0,
    **model_kwargs,
):
    """CTR ranking model: `num_towers` detached dense towers on the same input, a top MLP.

    Each tower is a `DetachBlock` with a `Dense(1)` logistic head and a BCE local
    loss (weight `loss_weight`) inside an `EraseModel` (`model_kwargs` go to it,
    e.g. `dispatch="threaded"`).

    Example:

    ```python
    model = build_ctr_model(width=64, dispatch="auto")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    ```
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), name="features")
    towers = []
    for i in range(num_towers):
        mlp = keras.Sequential(
            [keras.layers.Dense(width, activation="relu") for _ in range(depth)], name=f"mlp_{i}"
        )
        block = DetachBlock(
            mlp,
            head=keras.layers.Dense(1, name=f"head_{i}"),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            loss_weight=loss_weight,
            name=f"tower_{i}",
        )
        towers.append(block(inputs))
    hidden = keras.layers.Concatenate()(towers)
    hidden = keras.layers.Dense(top_width, activation="relu", name="top")(hidden)
    outputs = keras.layers.Dense(1, activation="sigmoid", name="ctr")(hidden)
    return EraseModel(inputs, outputs, name="ctr_erase", **model_kwargs)


def synthetic_ctr_data(n, input_dim, seed=0):
    """Dense features and click labels from a fixed logistic model."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, input_dim)).astype("float32")
    w = rng.normal(size=(input_dim, 1)).astype("float32") / np.sqrt(input_dim)
    y = (rng.random((n, 1)) < 1 / (1 + np.exp(-(x @ w)))).astype("float32")
    return x, y


class StepTimer(keras.callbacks.Callback):
    """Seconds of every training step (batch begin to batch end) and of the whole epoch."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_start = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(time.perf_counter() - self.start)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds = time.perf_counter() - self.epoch_start


def run_cell(mode, batch_size, width, args):
    """One fresh model trained for one epoch; its per-step and epoch throughput."""
    model = build_ctr_model(width, args.towers, args.depth, args.input_dim, dispatch=mode)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    x, y = synthetic_ctr_data(batch_size * args.epoch_steps, args.input_dim)
    timer = StepTimer()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    stats = throughput_percentiles(timer.steps[args.warmup:], batch_size)
    row = {
        "batch": batch_size,
        "width": width,
        "mode": mode,
        "p50": stats["p50"],
        "p90": stats["p90"],
        "epoch": batch_size * len(timer.steps) / timer.epoch_seconds,
        "steps": len(timer.steps),
    }
    if mode == "auto":
        selector = model._erase.selector  # None on a CPU: auto is the standard step there
        row["auto_choice"] = model.dispatch_choice
        row["auto_measuring_steps"] = 0 if selector is None else selector.steps
        row["auto_timings_s"] = model.auto_timings
    return row


def run_cell_in_process(mode, batch_size, width, args):
    """`run_cell` in a fresh Python process; returns its row."""
    command = [
        sys.executable, os.path.abspath(__file__), "--cell", f"{mode},{batch_size},{width}",
        "--warmup", str(args.warmup), "--epoch-steps", str(args.epoch_steps),
        "--towers", str(args.towers), "--depth", str(args.depth),
        "--input-dim", str(args.input_dim),
    ]
    env = dict(os.environ, KERAS_BACKEND="torch")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"cell {mode} ({batch_size}, {width}) failed:\n{done.stderr[-3000:]}")
    return json.loads(rows[-1])


def _spread(values):
    return f"{np.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def summarize(rows, configs, modes):
    """Per configuration and mode: median and spread over the processes; auto/standard pairs."""
    table, pairs = [], []
    for batch, width in configs:
        cell = [r for r in rows if (r["batch"], r["width"]) == (batch, width)]
        for mode in modes:
            mine = [r for r in cell if r["mode"] == mode]
            if not mine:
                continue
            entry = {"batch": batch, "width": width, "mode": mode, "processes": len(mine)}
            for key in ("p50", "p90", "epoch"):
                entry[key] = _spread([r[key] for r in mine])
            if mode == "auto":
                choices = [r.get("auto_choice") for r in mine]
                entry["mode"] = "auto -> " + ", ".join(sorted(set(map(str, choices))))
            table.append(entry)
        standard = {r["rep"]: r for r in cell if r["mode"] == "standard"}
        auto = {r["rep"]: r for r in cell if r["mode"] == "auto"}
        reps = sorted(set(standard) & set(auto))
        if reps:
            ratio = {
                key: [auto[i][key] / standard[i][key] for i in reps] for key in ("p50", "p90", "epoch")
            }
            pairs.append(
                {
                    "batch": batch,
                    "width": width,
                    "pairs": len(reps),
                    **{
                        f"auto/standard {key}": f"{np.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                        for key, v in ratio.items()
                    },
                    "median_epoch_ratio": float(np.median(ratio["epoch"])),
                }
            )
    return table, pairs


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run, results in /tmp")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of p50/p90")
    parser.add_argument("--epoch-steps", type=int, default=100, help="steps of the epoch")
    parser.add_argument("--reps", type=int, default=3, help="processes per cell")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # mode,batch,width
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--configs", nargs="+", default=None, help="batch,width pairs")
    parser.add_argument("--towers", type=int, default=6)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--input-dim", type=int, default=256)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "erase_cpu"))
    args = parser.parse_args(argv)
    configs = CONFIGS
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    if args.quick:
        configs = [(128, 64)]
        args.epoch_steps, args.warmup, args.reps, args.input_dim = 30, 5, 1, 64
        if args.out == parser.get_default("out"):
            args.out = "/tmp/erase_cpu_quick"
    if args.cell:  # one cell, in this (child) process
        mode, batch, width = args.cell.split(",")
        row = run_cell(mode, int(batch), int(width), args)
        print("ROW " + json.dumps(row, default=str), flush=True)
        return
    rows = []
    started = time.perf_counter()
    for rep in range(args.reps):
        for batch, width in configs:
            shift = rep % len(args.modes)  # rotate the order: no mode always runs first
            for mode in args.modes[shift:] + args.modes[:shift]:
                row = dict(run_cell_in_process(mode, batch, width, args), rep=rep)
                rows.append(row)
                print(
                    f"rep={rep} batch={batch} width={width} {mode:<9} p50={row['p50']:,.0f}/s "
                    f"p90={row['p90']:,.0f}/s epoch={row['epoch']:,.0f}/s"
                    + (f" auto->{row['auto_choice']} after {row['auto_measuring_steps']} steps"
                       if mode == "auto" else ""),
                    flush=True,
                )
    table, pairs = summarize(rows, configs, args.modes)
    info = _info(args, torch.get_num_threads())
    info["wall_s"] = round(time.perf_counter() - started)
    text = [
        "# ERASE on CPU: CTR model, six detached towers (torch)",
        "",
        f"Each figure: the median over {args.reps} processes (one fresh model each), "
        "with the spread (min-max) in parentheses, examples/s. `p50`/`p90`: percentiles "
        "of per-step examples/s (batch / step seconds) over the steps after the first "
        f"{args.warmup} of a {args.epoch_steps}-step epoch; p90 is the fast end (90% of "
        "the steps are slower), as in the ERASE paper. `epoch`: examples/s of the whole "
        "epoch, first steps and auto's measuring steps included. The machine had other "
        "(niced) load.",
        "",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
        "",
        markdown_table(table, ["batch", "width", "mode", "processes", "p50", "p90", "epoch"]),
        "",
        "## auto / standard, process pairs (median and spread over the pairs)",
        "",
        markdown_table(
            pairs,
            ["batch", "width", "pairs", "auto/standard p50", "auto/standard p90",
             "auto/standard epoch"],
        ),
    ]
    report = "\n".join(text)
    print(report)
    write_text(args.out + ".md", report)
    write_json(args.out + ".json", {"machine": info, "rows": rows, "table": table, "pairs": pairs})
    print(f"wrote {args.out}.md and {args.out}.json")


def _info(args, default_threads):
    import torch

    return machine_info(
        torch=torch.__version__,
        keras=keras.__version__,
        torch_default_threads=default_threads,
        towers=args.towers,
        depth=args.depth,
        input_dim=args.input_dim,
        epoch_steps=args.epoch_steps,
        warmup=args.warmup,
        reps=args.reps,
    )


if __name__ == "__main__":
    main()
