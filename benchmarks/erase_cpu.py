"""ERASE on CPU (torch): a CTR model with detached towers, examples/s per schedule, one section a run.

Sections (the first argument; none: `epoch`):

- `epoch`: the CTR model of `build_ctr_model` (six detached towers of three `Dense(width, relu)`
  layers), for each (batch, width) and mode (`standard`, `blocking`, `threaded`, `auto`), `--reps`
  fresh processes each train a fresh model for one epoch of `--epoch-steps` steps with `fit`
  (torch's default intra-op threads). `p50`, `p90`: percentiles of per-step examples/s over the
  steps after the first `--warmup` (`keras_erase.throughput`; p90 is the fast end, as in the ERASE
  paper); `epoch`: examples/s of the whole epoch, `auto`'s measuring steps included. The table
  gives the median over the processes and the spread; `auto / standard` pairs each `auto` process
  with the `standard` one of the same repetition (modes rotate within a repetition).
- `auto`: `auto / standard` per checkout (`--repos NAME=PATH ...`): one process per (checkout,
  size, mode, repeat), the checkouts and modes alternating; p90 after `--warmup` and the epoch
  rate, the ratio taken per repeat, median and spread over the repeats; which schedule `auto`
  kept and how many steps it measured.
- `handoff`: the examples' CTR model (`examples.ctr.model`, towers with `detach_input=False`) per
  checkout and mode: the shared embedding table's backwards per step (a post-accumulate-grad
  hook, any thread) over `--count-steps` steps, then p50/p90 of a `fit`; the last checkout over
  the first.
- `host-time`: the examples' CTR model per checkout and schedule label (`standard`, `blocking`,
  `threaded`, `streams`, `inline_streams`, each optionally `+graphs`): median and p90 step
  time of a `fit` (on a CPU the whole step is host time). Block streams run on the stand-in
  `tests/erase/fake_streams.py`, graphs on the stand-in capture `RecordingCapture` (its Python
  replay, not a CUDA Graph's launch); a checkout without a schedule is skipped for it.

Every cell runs in a fresh process with `PYTHONPATH` at its checkout (`benchmarks.common.run_cell`),
so that checkout's `keras_erase` is the one measured.

Usage:

    KERAS_BACKEND=torch python benchmarks/erase_cpu.py          # writes
        benchmarks/results/erase_cpu.{md,json}
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py --quick  # smoke run (/tmp)
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py --modes standard auto \
        --configs 512,256 --out benchmarks/results/erase_cpu_auto   # the auto check
    git worktree add /tmp/erase-before main
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py auto --repos before=/tmp/erase-before after=.
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py handoff --repos before=DIR after=. --threads 2
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py host-time --repos before=DIR after=. --steps 20
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path and "--cell" not in sys.argv:  # a cell imports its checkout (PYTHONPATH)
    sys.path.insert(0, REPO)

import keras  # noqa: E402
import numpy as np  # noqa: E402

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


def in_checkout(repo, section, argv):
    """One cell (`--cell ...` in `argv`) of `section` in a fresh process importing the checkout `repo`."""
    from benchmarks.common import run_cell

    return run_cell([os.path.abspath(__file__), *([section] if section else []), *map(str, argv)],
                    repo, dict(os.environ, KERAS_BACKEND="torch"))


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


def epoch_main(argv):
    import torch

    from benchmarks.common import markdown_table, write_json, write_text

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
                row = dict(in_checkout(REPO, None, [
                    "--cell", f"{mode},{batch},{width}", "--warmup", args.warmup,
                    "--epoch-steps", args.epoch_steps, "--towers", args.towers,
                    "--depth", args.depth, "--input-dim", args.input_dim]), rep=rep)
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

    from benchmarks.common import machine_info

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



AUTO_SIZES = [(256, 64), (512, 256), (1024, 256), (2048, 512)]
AUTO_MODES = ("standard", "auto")


def auto_cell(mode, batch, width, args):
    """One fresh model, one `fit` of `args.steps` steps, in this process: its row."""
    import keras_erase

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


def auto_summarize(rows, names, sizes):
    """Per size and checkout: median and spread over the repeats of auto / standard."""
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
                    if set(pair) == set(AUTO_MODES):
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


def auto_main(argv):
    from benchmarks.common import machine_info, parse_repos, run_repos, write_results

    parser = argparse.ArgumentParser(description="auto / standard on CPU, checkouts side by side")
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
        print("ROW " + json.dumps(auto_cell(mode, int(batch), int(width), args)), flush=True)
        return None
    sizes = AUTO_SIZES if not args.sizes else [tuple(int(v) for v in s.split(",")) for s in args.sizes]
    repos = parse_repos(args.repos)
    names = list(repos)
    started = time.perf_counter()
    cells = [(mode, batch, width) for batch, width in sizes for mode in AUTO_MODES]
    rows = run_repos(repos, cells, args.reps, lambda path, cell: in_checkout(path, "auto", [
        "--cell", ",".join(map(str, cell)), "--steps", args.steps, "--warmup", args.warmup]))
    table = auto_summarize(rows, names, sizes)
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


HANDOFF_MODES = {  # name -> (detached, dispatch)
    "baseline": (False, None),
    "detached": (True, "standard"),
    "erase-blocking": (True, "blocking"),
    "erase-threaded": (True, "threaded"),
    "erase-auto": (True, "auto"),
}


def handoff_cell(mode, args):
    """One fresh CTR model in this process: `{"mode", "backwards_per_step", "p50", "p90"}`."""
    import torch

    from examples.ctr.data import synthetic_ctr
    from examples.ctr.model import build_ctr_model

    import keras_erase

    torch.set_num_threads(args.threads)
    detached, dispatch = HANDOFF_MODES[mode]
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


def handoff_table(rows, names, modes):
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


def handoff_main(argv):
    from benchmarks.common import machine_info, parse_repos, run_repos, write_results

    parser = argparse.ArgumentParser(description="the gradient hand-off, checkouts side by side")
    parser.add_argument("--repos", nargs="+", default=[f"this={REPO}"], help="NAME=PATH ...")
    parser.add_argument("--modes", nargs="+", default=list(HANDOFF_MODES), choices=list(HANDOFF_MODES))
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
        print("ROW " + json.dumps(handoff_cell(args.cell, args)), flush=True)
        return None
    repos = parse_repos(args.repos)
    names = list(repos)
    rows = run_repos(repos, args.modes, args.reps, lambda path, mode: in_checkout(path, "handoff", [
        "--cell", mode, "--threads", args.threads, "--batch", args.batch, "--steps", args.steps,
        "--warmup", args.warmup, "--count-steps", args.count_steps, "--buckets", args.buckets]))
    table, summary = handoff_table(rows, names, args.modes)
    what = (f"torch.set_num_threads({args.threads}), batch {args.batch}, {args.steps} steps "
            f"({args.warmup} warm-up), {args.reps} processes per cell (the checkouts alternating). "
            f"backwards/step: the shared embedding table's backwards per step; p50/p90: per-step "
            f"examples/s after the warm-up (p90 = the fast end). Ratios: {names[-1]} / {names[0]}.")
    print(table)
    write_results(args.out, "The gradient hand-off on the CTR example (torch CPU)", what, None,
                  machine_info(threads=args.threads), table, {"rows": rows, "summary": summary, "args": vars(args)})
    return rows


HOST_SCHEDULES = [
    "standard", "blocking", "threaded", "streams", "inline_streams",
    "blocking+graphs", "threaded+graphs", "streams+graphs", "inline_streams+graphs",
]
HOST_PRESETS = ("standard", "blocking", "threaded", "streams")


def host_time_model(label, buckets):
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
    if name in HOST_PRESETS:
        return build_ctr_model(buckets=buckets, dispatch=name, cuda_graphs=graphs)
    from keras_erase.config import EraseConfig
    from keras_erase.runtime import EraseRuntime

    launcher, placement = "inline", "block_streams"  # "inline_streams", as "early" in every checkout
    model = build_ctr_model(buckets=buckets, dispatch="standard")
    config = EraseConfig(dispatch="early", launcher=launcher, placement=placement,
                         cuda_graphs=graphs)
    model.__dict__["_erase"] = EraseRuntime(config, True)
    return model


def host_time_cell(label, args):
    """One fresh CTR model in this process: `{"schedule", "median_ms", "p90_ms"}` or `None`."""
    import torch

    from examples.ctr.data import synthetic_ctr

    torch.set_num_threads(args.threads)
    keras.utils.set_random_seed(0)
    model = host_time_model(label, args.buckets)
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


def host_time_table(rows, names, labels):
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


def host_time_main(argv):
    from benchmarks.common import machine_info, parse_repos, run_repos, write_results

    parser = argparse.ArgumentParser(description="host time per CTR step per schedule, checkouts side by side")
    parser.add_argument("--repos", nargs="+", default=[f"this={REPO}"], help="NAME=PATH ...")
    parser.add_argument("--schedules", nargs="+", default=HOST_SCHEDULES, choices=HOST_SCHEDULES)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps (graph capture: 3)")
    parser.add_argument("--buckets", type=int, default=1000)
    parser.add_argument("--out", default="/tmp/erase_host_time")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell is not None:
        row = host_time_cell(args.cell, args)
        print("ROW " + json.dumps(row if row is not None else {"schedule": args.cell}), flush=True)
        return None
    repos = parse_repos(args.repos)
    names = list(repos)
    rows = run_repos(repos, args.schedules, 1, lambda path, label: in_checkout(path, "host-time", [
        "--cell", label, "--threads", args.threads, "--batch", args.batch, "--steps", args.steps,
        "--warmup", args.warmup, "--buckets", args.buckets]))
    rows = [row for row in rows if "median_ms" in row]
    what = (f"torch.set_num_threads({args.threads}), batch {args.batch}, {args.steps} timed steps "
            f"after {args.warmup}, one process per cell (the checkouts alternating). Ratio: "
            f"{names[-1]} / {names[0]}. Graphs: the CPU stand-in capture's Python replay.")
    text = host_time_table(rows, names, args.schedules)
    print(text)
    write_results(args.out, "Host time per CTR step for every schedule combination (torch CPU)", what, None,
                  machine_info(threads=args.threads), text, {"rows": rows, "args": vars(args)})
    return rows


SECTIONS = {"auto": auto_main, "handoff": handoff_main, "host-time": host_time_main}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SECTIONS:
        return SECTIONS[argv[0]](argv[1:])
    return epoch_main(argv)


if __name__ == "__main__":
    main()
