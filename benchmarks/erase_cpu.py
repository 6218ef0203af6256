"""ERASE on CPU (torch): examples/s and host time per schedule, one section a run.

Sections (the first argument; none: `epoch`); every cell is a fresh process (`benchmarks.common.run_cell`),
its figures `benchmarks.common.qps` (p50/p90 of per-step examples/s after the warm-up; p90 is the fast end, as
in the ERASE paper):

- `epoch`: the CTR model of `build_ctr_model` (six detached towers of three `Dense(width, relu)` layers), for
  each (batch, width) and mode (`standard`, `blocking`, `threaded`, `auto`), `--reps` processes each train a
  fresh model for one epoch of `--epoch-steps` steps with `fit` (torch's default intra-op threads): p50, p90
  after the first `--warmup` steps and `epoch` (examples/s of the whole epoch); the median over the processes
  with the spread, and `auto / standard` per repetition (`paired_ratios`: the modes rotate within a
  repetition). On a CPU `auto` is the standard step and measures nothing.
- `handoff`: the examples' CTR model (`examples.ctr.model`, towers with `detach_input=False`) per schedule:
  the shared embedding table's backwards per step (a post-accumulate-grad hook, any thread) over
  `--count-steps` steps, then p50/p90 and step ms of a `fit`.
- `host-time`: the same model per schedule label (`standard`, `blocking`, `threaded`, `streams`,
  `inline_streams`, each optionally `+graphs`): the step time of a `fit` (on a CPU the whole step is
  host time). Block streams run on the stand-in `tests/erase/fake_streams.py`, graphs on the stand-in capture
  `RecordingCapture` (its Python replay, not a CUDA Graph's launch).

Usage:

    KERAS_BACKEND=torch python benchmarks/erase_cpu.py          # benchmarks/results/erase_cpu.{md,json}
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py --quick --out /tmp/erase_cpu_quick  # smoke run
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py --modes standard auto --configs 512,256 \\
        --out benchmarks/results/erase_cpu_auto   # the auto check
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py handoff --threads 2
    KERAS_BACKEND=torch python benchmarks/erase_cpu.py host-time --steps 20
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import QPS_NOTE, emit_row, fmt_spread, machine_info, markdown_table  # noqa: E402
from benchmarks.common import paired_ratios, qps, run_cell, spread, write_results  # noqa: E402
from keras_erase import DetachBlock  # noqa: E402
from keras_erase import EraseModel  # noqa: E402

CONFIGS = [(512, 256), (1024, 256)]
MODES = ["standard", "blocking", "threaded", "auto"]


def build_ctr_model(width=256, num_towers=6, depth=3, input_dim=256, top_width=64, loss_weight=0.1, seed=0,
                    **model_kwargs):
    """CTR ranking model: `num_towers` detached dense towers on the same input, a top MLP.

    Each tower is a `DetachBlock` with a `Dense(1)` logistic head and a BCE local loss (weight
    `loss_weight`) inside an `EraseModel` (`model_kwargs` go to it, e.g. `dispatch="threaded"`).
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), name="features")
    towers = []
    for i in range(num_towers):
        mlp = keras.Sequential([keras.layers.Dense(width, activation="relu") for _ in range(depth)], name=f"mlp_{i}")
        towers.append(DetachBlock(mlp, head=keras.layers.Dense(1, name=f"head_{i}"), name=f"tower_{i}",
                                  loss=keras.losses.BinaryCrossentropy(from_logits=True), loss_weight=loss_weight)(inputs))
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


def epoch_cell(mode, batch_size, width, args):
    """One fresh model trained for one epoch; its per-step and epoch throughput."""
    model = build_ctr_model(width, args.towers, args.depth, args.input_dim, dispatch=mode)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    x, y = synthetic_ctr_data(batch_size * args.epoch_steps, args.input_dim)
    timer = StepTimer()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    row = {"batch": batch_size, "width": width, "mode": mode, **qps(timer.steps[args.warmup:], batch_size),
           "epoch": batch_size * len(timer.steps) / timer.epoch_seconds, "steps": len(timer.steps)}
    if mode == "auto":
        selector = model._erase.selector  # None on a CPU: auto is the standard step there
        row.update(auto_choice=model.dispatch_choice, auto_measuring_steps=0 if selector is None else selector.steps)
    return row


def in_process(section, argv):
    """One cell (`--cell ...` in `argv`) of `section` in a fresh process."""
    return run_cell([os.path.abspath(__file__), *([section] if section else []), *map(str, argv)],
                    dict(os.environ, KERAS_BACKEND="torch"))


def summarize(rows, configs, modes):
    """Per configuration and mode: median and spread over the processes; auto / standard per repetition."""
    table = []
    for batch, width in configs:
        cell = [r for r in rows if (r["batch"], r["width"]) == (batch, width)]
        for mode in modes:
            mine = [r for r in cell if r["mode"] == mode]
            if mine:
                entry = {"batch": batch, "width": width, "mode": mode, "processes": len(mine)}
                entry.update({key: fmt_spread(spread([r[key] for r in mine])) for key in ("p50", "p90", "epoch")})
                if mode == "auto":
                    entry["mode"] = "auto -> " + ", ".join(sorted({str(r.get("auto_choice")) for r in mine}))
                    for key in ("p50", "p90", "epoch"):
                        ratio = paired_ratios(cell, "auto", ("mode", "standard"), key)
                        entry[f"auto / standard {key}"] = fmt_spread(ratio) if ratio else "-"
                table.append(entry)
    return table


def epoch_main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
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
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs else CONFIGS
    if args.quick:
        configs = [(128, 64)]
        args.epoch_steps, args.warmup, args.reps, args.input_dim = 30, 5, 1, 64
    if args.cell:  # one cell, in this (child) process
        mode, batch, width = args.cell.split(",")
        return emit_row(epoch_cell(mode, int(batch), int(width), args))
    rows, started = [], time.perf_counter()
    for rep in range(args.reps):
        for batch, width in configs:
            shift = rep % len(args.modes)  # rotate the order: no mode always runs first
            for mode in args.modes[shift:] + args.modes[:shift]:
                rows.append(dict(in_process(None, [
                    "--cell", f"{mode},{batch},{width}", "--warmup", args.warmup, "--epoch-steps", args.epoch_steps,
                    "--towers", args.towers, "--depth", args.depth, "--input-dim", args.input_dim]), rep=rep))
                print(rep, batch, width, mode, {k: round(rows[-1][k]) for k in ("p50", "p90", "epoch")}, flush=True)
    table = summarize(rows, configs, args.modes)
    import torch

    info = machine_info(torch=torch.__version__, keras=keras.__version__, threads=f"torch default ({torch.get_num_threads()})",
                        towers=args.towers, depth=args.depth, input_dim=args.input_dim, wall_s=round(time.perf_counter() - started))
    what = (f"Each figure: the median over {args.reps} processes (one fresh model each), with the spread (min-max), "
            f"examples/s; p50/p90 over the steps after the first {args.warmup} of a {args.epoch_steps}-step epoch "
            f"({QPS_NOTE}) `epoch`: examples/s of the whole epoch, first steps included. auto / standard: the "
            "ratio of the two processes of each repetition, median (min-max).")
    columns = ["batch", "width", "mode", "processes", "p50", "p90", "epoch"]
    columns += [f"auto / standard {k}" for k in ("p50", "p90", "epoch") if any(f"auto / standard {k}" in t for t in table)]
    write_results(args.out, "ERASE on CPU: CTR model, six detached towers (torch)", what, None, info,
                  markdown_table(table, columns), {"rows": rows, "table": table})


CTR_SCHEDULES = {  # label -> EraseModel keywords (None: the undetached model)
    "undetached": None, "standard": {"dispatch": "standard"}, "blocking": {"dispatch": "blocking"},
    "threaded": {"dispatch": "threaded"}, "auto": {"dispatch": "auto"}, "streams": {"dispatch": "streams"},
    "inline_streams": {"dispatch": "inline_streams"},
}
SECTIONS = {  # section -> (its schedules, defaults)
    "handoff": (["undetached", "standard", "blocking", "threaded", "auto"],
                dict(threads=2, steps=40, warmup=10, count_steps=3, reps=2, out="erase_handoff")),
    "host-time": ([*(base + graphs for graphs in ("", "+graphs") for base in
                     ("standard", "blocking", "threaded", "streams", "inline_streams")
                     if not (graphs and base == "standard"))],
                  dict(threads=1, steps=20, warmup=6, count_steps=0, reps=1, out="erase_host_time")),
}


def ctr_model(label, buckets):
    """The examples' CTR model trained with schedule `label` (`+graphs`: the stand-in capture)."""
    from examples.ctr.model import build_ctr_model as build
    from keras_erase.torch.cuda_graphs import capture
    from keras_erase.torch.schedules import placements
    from tests.erase.fake_streams import CheckedStreams

    name, graphs = label.removesuffix("+graphs"), label.endswith("+graphs")
    if graphs:
        capture.set_default_capture(capture.RecordingCapture)
    if "streams" in name:
        placements.set_default_streams(CheckedStreams)
    keywords = CTR_SCHEDULES[name]
    if keywords is None:
        return build(detached=False, buckets=buckets)
    return build(buckets=buckets, cuda_graphs=graphs, **keywords)


def ctr_cell(label, args):
    """One fresh CTR model in this process: the table's backwards per step, then a timed `fit`."""
    import torch

    from examples.ctr.data import synthetic_ctr
    from keras_erase.torch.cuda_graphs.runner import live_runners

    torch.set_num_threads(args.threads)
    keras.utils.set_random_seed(0)
    model = ctr_model(label, args.buckets)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy())
    counted, timed = args.batch * args.count_steps, args.batch * (args.warmup + args.steps)
    data = synthetic_ctr(counted + timed, buckets=args.buckets)
    x, y = {"dense": data["dense"], "sparse": data["sparse"]}, data["label"]
    row = {"schedule": label}
    if args.count_steps:
        backwards = []
        hook = model.get_layer("embeddings").embeddings.value.register_post_accumulate_grad_hook(
            lambda p: backwards.append(1))
        model.fit({k: v[:counted] for k, v in x.items()}, y[:counted], batch_size=args.batch, verbose=0, shuffle=False)
        hook.remove()
        row["backwards_per_step"] = len(backwards) / args.count_steps
    timer = StepTimer()
    model.fit({k: v[counted:] for k, v in x.items()}, y[counted:], batch_size=args.batch, verbose=0, shuffle=False,
              callbacks=[timer])
    return dict(row, **qps(timer.steps[args.warmup:], args.batch), dispatch_choice=getattr(model, "dispatch_choice", None),
                graphs_captured=sum(r.captures for r in live_runners()),
                graphs_disabled=any(r.disabled for r in live_runners()))


def ctr_main(section, argv):
    schedules, defaults = SECTIONS[section]
    parser = argparse.ArgumentParser(description=f"{section}: the examples' CTR model per schedule (torch CPU)")
    parser.add_argument("--schedules", nargs="+", default=schedules,
                        choices=[s + g for s in CTR_SCHEDULES for g in ("", "+graphs")])
    parser.add_argument("--threads", type=int, default=defaults["threads"], help="torch.set_num_threads")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=defaults["steps"], help="timed fit steps")
    parser.add_argument("--warmup", type=int, default=defaults["warmup"], help="untimed steps (graph capture: 3)")
    parser.add_argument("--count-steps", type=int, default=defaults["count_steps"], help="steps of the backward count")
    parser.add_argument("--buckets", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=defaults["reps"], help="processes per schedule, alternating")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", defaults["out"]))
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell is not None:
        return emit_row(ctr_cell(args.cell, args))
    rows = []
    for rep in range(args.reps):
        for label in args.schedules:
            rows.append(dict(in_process(section, ["--cell", label, *(a for key in (
                "threads", "batch", "steps", "warmup", "count_steps", "buckets")
                for a in (f"--{key.replace('_', '-')}", getattr(args, key)))]), rep=rep))
            print(rep, {k: v for k, v in rows[-1].items() if not isinstance(v, float)}, flush=True)
    table = []
    for label in args.schedules:
        mine = [r for r in rows if r["schedule"] == label]
        entry = {"schedule": label, **{key: fmt_spread(spread([r[key] for r in mine])) for key in (
            "backwards_per_step", "p50", "p90", "step_ms_p50", "step_ms_p90") if key in mine[0]}}
        table.append(dict(entry, graphs_captured=max(r["graphs_captured"] for r in mine)))
    what = (f"torch.set_num_threads({args.threads}), batch {args.batch}, {args.steps} timed steps after {args.warmup}, "
            f"{args.reps} process(es) per schedule, the schedules alternating; median (min-max) over the processes. "
            f"backwards_per_step: the shared embedding table's backwards per step over {args.count_steps} steps. "
            f"{QPS_NOTE} Graphs: the CPU stand-in capture's Python replay; streams: the CPU stand-in streams.")
    write_results(args.out, f"ERASE {section} on the CTR example (torch CPU)", what, None,
                  machine_info(threads=args.threads), markdown_table(table, list(table[0])), {"rows": rows, "table": table})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SECTIONS:
        return ctr_main(argv[0], argv[1:])
    return epoch_main(argv)


if __name__ == "__main__":
    main()
