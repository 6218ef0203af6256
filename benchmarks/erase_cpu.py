"""ERASE on CPU (torch): the CTR example per schedule, one fresh process a cell (docs/benchmarks.md, "ERASE
on CPU"). Sections (the first argument): `epoch` (default), `handoff`, `host-time`.

    KERAS_BACKEND=torch python benchmarks/erase_cpu.py [handoff|host-time] [--schedules ...] [--reps N]
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import QPS_NOTE, RESULTS, emit_row, fmt_spread, machine_info, markdown_table  # noqa: E402
from benchmarks.common import paired_ratios, qps, run_cell, spread, step_clock, write_results  # noqa: E402
from examples.ctr.data import synthetic_ctr  # noqa: E402
from examples.ctr.model import build_ctr_model  # noqa: E402
from keras_erase.torch.cuda_graphs import capture  # noqa: E402
from keras_erase.torch.cuda_graphs.runner import live_runners  # noqa: E402
from keras_erase.torch.schedules import placements  # noqa: E402
from tests.erase.fake_streams import CheckedStreams  # noqa: E402


CTR_SCHEDULES = ("undetached", "standard", "blocking", "threaded", "auto", "streams", "inline_streams")
SECTIONS = {  # section -> (its schedules, defaults; threads 0: torch's default)
    "epoch": (["standard", "blocking", "threaded", "auto"],
              dict(threads=0, batches=[512, 1024], steps=90, warmup=10, count_steps=0, reps=3, out="erase_cpu")),
    "handoff": (["undetached", "standard", "blocking", "threaded", "auto"],
                dict(threads=2, batches=[512], steps=40, warmup=10, count_steps=3, reps=2, out="erase_handoff")),
    "host-time": ([*(base + graphs for graphs in ("", "+graphs") for base in
                     ("standard", "blocking", "threaded", "streams", "inline_streams")
                     if not (graphs and base == "standard"))],
                  dict(threads=1, batches=[512], steps=20, warmup=6, count_steps=0, reps=1, out="erase_host_time")),
}


def ctr_model(label, buckets):
    """The examples' CTR model trained with schedule `label` (`+graphs`: the stand-in capture)."""
    name, graphs = label.removesuffix("+graphs"), label.endswith("+graphs")
    if graphs:
        capture.set_default_capture(capture.RecordingCapture)
    if "streams" in name:
        placements.set_default_streams(CheckedStreams)
    if name == "undetached":
        return build_ctr_model(detached=False, buckets=buckets)
    return build_ctr_model(buckets=buckets, cuda_graphs=graphs, dispatch=name)


def ctr_cell(label, args):
    """One fresh CTR model in this process: the table's backwards per step, then a timed `fit`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    keras.utils.set_random_seed(0)
    model = ctr_model(label, args.buckets)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy())
    counted, timed = args.batch * args.count_steps, args.batch * (args.warmup + args.steps)
    data = synthetic_ctr(counted + timed, buckets=args.buckets)
    x, y = {"dense": data["dense"], "sparse": data["sparse"]}, data["label"]
    row = {"schedule": label, "batch": args.batch}
    if args.count_steps:
        backwards = []
        hook = model.get_layer("embeddings").embeddings.value.register_post_accumulate_grad_hook(
            lambda p: backwards.append(1))
        model.fit({k: v[:counted] for k, v in x.items()}, y[:counted], batch_size=args.batch, verbose=0, shuffle=False)
        hook.remove()
        row["backwards_per_step"] = len(backwards) / args.count_steps
    timer = step_clock()
    model.fit({k: v[counted:] for k, v in x.items()}, y[counted:], batch_size=args.batch, verbose=0, shuffle=False,
              callbacks=[timer])
    steps = [end[1] - start[1] for start, end in zip(timer.starts, timer.ends)]
    return dict(row, **qps(steps[args.warmup:], args.batch),
                epoch=args.batch * len(steps) / (timer.epoch[1][1] - timer.epoch[0][1]),
                dispatch_choice=getattr(model, "dispatch_choice", None),
                graphs_captured=sum(r.captures for r in live_runners()),
                graphs_disabled=any(r.disabled for r in live_runners()))


def ctr_main(section, argv):
    schedules, defaults = SECTIONS[section]
    parser = argparse.ArgumentParser(description=f"{section}: the examples' CTR model per schedule (torch CPU)")
    parser.add_argument("--schedules", nargs="+", default=schedules,
                        choices=[s + g for s in CTR_SCHEDULES for g in ("", "+graphs")])
    parser.add_argument("--threads", type=int, default=defaults["threads"], help="torch.set_num_threads (0: default)")
    parser.add_argument("--batches", type=int, nargs="+", default=defaults["batches"])
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)  # a cell's
    parser.add_argument("--steps", type=int, default=defaults["steps"], help="timed fit steps")
    parser.add_argument("--warmup", type=int, default=defaults["warmup"], help="untimed steps (graph capture: 3)")
    parser.add_argument("--count-steps", type=int, default=defaults["count_steps"], help="steps of the backward count")
    parser.add_argument("--buckets", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=defaults["reps"], help="processes per schedule, alternating")
    parser.add_argument("--out", default=os.path.join(RESULTS, defaults["out"]))
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell is not None:
        return emit_row(ctr_cell(args.cell, args))
    rows = []
    for rep in range(args.reps):
        for batch in args.batches:
            shift = rep % len(args.schedules)  # the order rotates: no schedule always runs first
            for label in args.schedules[shift:] + args.schedules[:shift]:
                cell = ["--cell", label, "--batch", batch, *(a for key in ("threads", "steps", "warmup", "count_steps",
                        "buckets") for a in (f"--{key.replace('_', '-')}", getattr(args, key)))]
                rows.append(dict(run_cell([os.path.abspath(__file__), section, *map(str, cell)],
                                          dict(os.environ, KERAS_BACKEND="torch")), rep=rep))
                print(rep, {k: v for k, v in rows[-1].items() if not isinstance(v, float)}, flush=True)
    table = []
    for batch in args.batches:
        for label in args.schedules:
            mine = [r for r in rows if (r["schedule"], r["batch"]) == (label, batch)]
            entry = {"batch": batch, "schedule": label, **{key: fmt_spread(spread([r[key] for r in mine])) for key in (
                "backwards_per_step", "p50", "p90", "epoch", "step_ms_p50", "step_ms_p90") if key in mine[0]}}
            if label != "standard" and "standard" in args.schedules and args.reps > 1:
                ratio = paired_ratios([r for r in rows if r["batch"] == batch], label, ("schedule", "standard"), "p90")
                entry["p90 / standard"] = fmt_spread(ratio) if ratio else "-"
            table.append(dict(entry, graphs_captured=max(r["graphs_captured"] for r in mine)))
    what = (f"torch threads {args.threads or 'default'}, {args.steps} timed steps after {args.warmup}, "
            f"{args.reps} process(es) per batch and schedule, the schedules alternating; median (min-max) over the "
            f"processes. backwards_per_step: the shared embedding table's backwards per step over {args.count_steps} "
            f"steps. {QPS_NOTE} epoch: examples/s of the whole fit. p90 / standard: per repetition. Graphs: the CPU "
            "stand-in capture's Python replay; streams: the CPU stand-in streams.")
    columns = list(dict.fromkeys(k for entry in table for k in entry))
    write_results(args.out, f"ERASE {section} on the CTR example (torch CPU)", what, None,
                  machine_info(threads=args.threads or "torch default"), markdown_table(table, columns),
                  {"rows": rows, "table": table})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SECTIONS:
        return ctr_main(argv[0], argv[1:])
    return ctr_main("epoch", argv)


if __name__ == "__main__":
    main()
