"""The plan of `benchmarks/erase_gpu.py`: its modes and arguments, the middle batch, the budget and the
order of the cell groups; what a CPU test can check of it. The cells (models, timing, traces) are the
benchmark's: `run_cells` is given `run_cell(model_name, mode, batch, profile_path)` and `release()`."""

import argparse
import math
import os
import time

import numpy as np

from benchmarks.common import Budget, paired_ratios  # noqa: F401 - Budget: the tests' budget

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = ("ctr", "mlp30", "transformer")  # "ctr-w<width>": the CTR model with towers that wide
# The baselines a user has, in rising effort (`erase_gpu.WHAT` says what each is).
PLAIN_MODES = ("plain", "plain+jit", "plain+reduce_overhead", "plain+graph")
BASELINES = PLAIN_MODES + ("standard",)
SCHEDULE_MODES = ("blocking", "blocking+graphs", "threaded", "threaded+graphs", "streams",
                  "streams+graphs")
GPU_MODES = BASELINES + SCHEDULE_MODES
# CPU dry run: no torch.compile (minutes on a CPU), no streams.
CPU_MODES = ("plain", "plain+graph", "standard", "blocking", "blocking+graphs", "threaded",
             "threaded+graphs")
EXTRA_MODES = ("auto", "auto+graphs")
MIDDLE = "middle"
GPU_BATCHES = (2048, MIDDLE, 65536)
CPU_BATCHES = (16, MIDDLE, 64)
# --plan device: the GPU check's cells; threaded+graphs is the H200's best fixed schedule at both batches.
DEVICE_MODES = ("plain", "plain+graph", "plain+jit", "standard", "auto+graphs", "threaded+graphs")
DEVICE_GROUPS = (("ctr", 2048), ("ctr", 32768))
# Estimated: per batch ~6 s of builds and captures, ~15 s of torch.compile, 5 repeats x 6 modes x 11 steps
# (H200: 7 s at 2048, 12 s at 32768), ~4 s of auto and gc; NE ~5 s: about 73 s, and room for a slow compile.
DEVICE_PLAN_SECONDS = 120
# --plan sweep: where ERASE pays (batch x tower width, the 30-layer MLP, a small transformer).
SWEEP_MODES = BASELINES + ("threaded", "threaded+graphs", "streams", "streams+graphs", "auto+graphs")
SWEEP_GROUPS = tuple(("ctr", b) for b in (2048, 8192, 32768, 65536)) + tuple(
    (f"ctr-w{w}", b) for w in (256, 1024) for b in (2048, 32768)) + (
    ("mlp30", 32768), ("transformer", 64))


class NotFeasible(Exception):
    """A cell that cannot run as asked here (the reason goes to the report, not to the errors)."""


def model_spec(model_name):
    """`"ctr-w256"` -> `("ctr", 256)`; `"ctr"` -> `("ctr", None)` (the `--width`)."""
    base, _, width = model_name.partition("-w")
    if base not in MODELS or (width and not width.isdigit()):
        raise ValueError(f"unknown model {model_name!r}; expected one of {MODELS} or ctr-w<width>")
    return base, int(width) if width else None


def parse_mode(mode):
    """`"threaded+graphs"` -> `("threaded", True)`; validates the name."""
    if mode in PLAIN_MODES:
        return mode, False
    base, _, suffix = mode.partition("+")
    bases = ("plain", "standard", "blocking", "threaded", "streams", "inline_streams", "auto")
    if base not in bases or suffix not in ("", "graphs"):
        raise ValueError(f"unknown mode {mode!r}; expected one of {GPU_MODES + EXTRA_MODES}")
    if suffix and base in ("plain", "standard"):
        raise ValueError(f"{mode!r}: graphs apply to the ERASE schedules and auto "
                         "(the plain model's whole step is plain+graph)")
    return base, suffix == "graphs"


AUTO_MEASURING_ESTIMATE = 30  # steps `"auto"` measures before it chooses, for the budget (26 on the H200)


def steps_until_chosen(model, step, limit=2 * AUTO_MEASURING_ESTIMATE):
    """Runs `step()` while `model.dispatch_choice` is None (`"auto"` measuring), at most `limit` times;
    returns how many ran (0 for any other dispatch, for `"auto"` on CPU and for a plain Keras model)."""
    ran = 0
    while getattr(model, "dispatch_choice", "standard") is None and ran < limit:
        step()
        ran += 1
    return ran


def auto_window(selector, warmup, steps):
    """`(measuring steps, how many of them were timed)` of an `"auto"` cell (its measuring steps after the
    `warmup` untimed steps; all of them while it has not decided)."""
    if selector is None:
        return 0, 0
    measuring = selector.steps if selector.done else warmup + steps
    return measuring, max(0, min(steps, measuring - warmup))


def graph_problems(rows):
    """Graph cells that did not really run on graphs (the GPU check must not pass silently)."""
    return [
        f"{r['model']} batch={r['batch']} {r['mode']}: captured={r.get('graphs_captured')} "
        f"replays={r.get('graph_replays')} disabled={r.get('graphs_disabled')} "
        f"refused={r.get('graphs_refused')}"
        for r in rows
        if parse_mode(r["mode"])[1]
        and (parse_mode(r["mode"])[0] != "auto" or str(r.get("auto_choice")).endswith("+graphs"))
        and (not r.get("graphs_captured") or not r.get("graph_replays") or r.get("graphs_disabled")
             or r.get("graphs_refused"))
    ]


def summarize(rows):
    """One row per (model, batch, mode): medians of the repeats' p50/p90 and their spread, and each
    mode's paired per-repeat ratios against the group's best baseline (`paired_ratios`)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["batch"], r["mode"]), []).append(r)
    summary = []
    for (model_name, batch, mode), repeats in groups.items():
        row = dict(repeats[0])  # the first repeat holds the profiled step's measures
        row.pop("repeat", None)
        row["repeats"] = len(repeats)
        for key in ("p50", "p90", "step_ms_p50", "step_ms_p90", "host_ms_p50", "max_memory_mib"):
            values = [r[key] for r in repeats if r.get(key) is not None]
            if not values:
                continue
            row[key] = float(np.median(values))
            if key in ("p50", "p90"):
                row[key + "_spread"] = (max(values) - min(values)) / row[key] if row[key] else 0.0
        row["host_share"] = row["host_ms_p50"] / row["step_ms_p50"] if row["step_ms_p50"] else 0.0
        summary.append(row)
    for row in summary:
        same = {r["mode"]: r for r in summary if (r["model"], r["batch"]) == (row["model"], row["batch"])}
        baselines = [m for m in BASELINES if m in same]
        if "standard" in same:
            row["p90_vs_standard"] = row["p90"] / same["standard"]["p90"]
        if not baselines:
            continue
        best = max(baselines, key=lambda m: same[m]["p90"])
        row["best_baseline"] = best
        repeats = groups[(row["model"], row["batch"], row["mode"])] + groups[(row["model"], row["batch"], best)]
        for key in ("p50", "p90"):
            ratios = paired_ratios(repeats, row["mode"], ("mode", best), key, pair_by="repeat")
            if ratios:
                row[f"{key}_vs_best"] = ratios["median"]
                row[f"{key}_vs_best_range"] = f"{ratios['min']:.3f}..{ratios['max']:.3f}"
        if "plain" in same:
            ratios = paired_ratios(groups[(row["model"], row["batch"], row["mode"])]
                                   + groups[(row["model"], row["batch"], "plain")],
                                   row["mode"], ("mode", "plain"), "p90", pair_by="repeat")
            row["p90_vs_plain"] = ratios["median"] if ratios else None
    return summary


def choose_middle(low, high):
    """The power of two from twice `low`'s batch to half `high`'s where GPU time per step (linear in the
    batch through `(batch, host_ms, gpu_ms)` `low` and `high`) comes closest to host time; without GPU
    work (a dry run), their geometric middle."""
    (b0, h0, g0), (b1, h1, g1) = low, high

    def at(b, v0, v1):
        return v0 + (v1 - v0) * (b - b0) / (b1 - b0)

    candidates = [2 ** k for k in range(int(math.log2(2 * b0)), int(math.log2(b1)) + 1)
                  if 2 * b0 <= 2 ** k <= b1 // 2] or [int(round(math.sqrt(b0 * b1)))]
    scored = [(abs(math.log(at(b, g0, g1) / at(b, h0, h1))), b) for b in candidates
              if at(b, g0, g1) > 0 and at(b, h0, h1) > 0]
    if scored:
        return min(scored)[1]
    middle = 2 ** round(math.log2(math.sqrt(b0 * b1)))
    return min(max(middle, candidates[0]), candidates[-1])


def priority_groups(args):
    """`(model, batch, modes)` groups, most informative first (see the module docstring)."""
    if args.plan in ("device", "sweep"):
        groups, modes = (DEVICE_GROUPS, DEVICE_MODES) if args.plan == "device" else (SWEEP_GROUPS, SWEEP_MODES)
        if args.cpu_dry_run:  # the code path at tiny sizes: one batch, the CPU's modes
            modes = [m for m in modes if m in CPU_MODES or m == "auto+graphs"]
            return [(m, min(args.batches), list(modes)) for m in dict.fromkeys(g[0] for g in groups)]
        return [(m, b, list(args.modes if args.modes_given else modes)) for m, b in groups]
    batches = sorted(args.batches)
    low, high = batches[0], batches[-1]
    middle = getattr(args, "middle", None) or batches[len(batches) // 2]
    if args.modes_given or len(batches) != 3:
        order = [(m, b) for m in args.models for b in ([middle] + [x for x in batches if x != middle])]
    else:
        order = [("ctr", middle), ("ctr", high), ("mlp30", middle), ("ctr", low),
                 ("mlp30", high), ("mlp30", low)]
    if args.cpu_dry_run:  # every kind of cell once, at one batch: the code path, not a measure
        order = [(m, b) for m, b in order if b == middle]
    groups = [(m, b, list(args.modes)) for m, b in order if m in args.models]
    if not args.modes_given and args.extra_modes and args.models:
        groups.append((args.models[0], middle, list(args.extra_modes)))
    return groups


def cell_estimate(model_name, batch, args, costs, traces):
    """Expected seconds of one cell: the slowest cell of its group so far, else from the trace."""
    if costs.get((model_name, batch)):
        return max(costs[(model_name, batch)])
    trace = traces.get(batch, {})
    if "step_s" in trace:
        return 1.25 * (trace["build_s"] + (args.warmup + args.steps) * trace["step_s"]
                       + trace.get("profile_s", 0.0) / args.repeats)
    return max((max(c) for c in costs.values() if c), default=0.0)


def run_cells(args, budget, traces, run_cell, release):
    """Every group whose cells and repeats fit, in priority order; `(rows, skipped, errors)`."""
    rows, skipped, errors, costs = [], [], [], {}
    for model_name, batch, modes in priority_groups(args):
        each = cell_estimate(model_name, batch, args, costs, traces)
        needed = each * len(modes) * args.repeats
        # `auto`'s cells also run its measuring steps untimed (26 on the H200) before their warm-up.
        needed += (AUTO_MEASURING_ESTIMATE * traces.get(batch, {}).get("step_s", 0.0) * args.repeats
                   * sum(parse_mode(m)[0] == "auto" for m in modes))
        label = f"{model_name} batch={batch} ({', '.join(modes)})"
        if not budget.fits(needed):
            skipped.append(f"{label}: needs ~{needed:.0f} s, {max(budget.left(), 0):.0f} s left")
            continue
        for repeat in range(args.repeats):
            for mode in modes:
                cell = f"{model_name} batch={batch} {mode} repeat {repeat + 1}"
                if not budget.fits(cell_estimate(model_name, batch, args, costs, traces)):
                    skipped.append(f"{cell}: the budget ran out")
                    continue
                start = time.monotonic()
                profile = f"{args.out}_cell.json" if repeat == 0 else None
                try:
                    row = run_cell(model_name, mode, batch, profile)
                except NotFeasible as why:
                    skipped.append(f"{cell}: not feasible: {why}")
                    continue
                except Exception as error:  # noqa: BLE001 - reported, the run goes on
                    errors.append(f"{cell}: {type(error).__name__}: {error}")
                    print("CELL FAILED:", errors[-1], flush=True)
                    continue
                finally:
                    release()
                seconds = time.monotonic() - start
                costs.setdefault((model_name, batch), []).append(seconds)
                row["repeat"] = repeat
                rows.append(row)
                print(f"{cell:<44} p50={row['p50']:,.0f}/s p90={row['p90']:,.0f}/s "
                      f"host {row['host_ms_p50']:.2f} ms ({seconds:.1f} s)", flush=True)
    return rows, skipped, errors


def _model(text):
    model_spec(text)
    return text


def _batch(text):
    return MIDDLE if text == MIDDLE else int(text)


def build_parser():
    parser = argparse.ArgumentParser(description="ERASE on a CUDA GPU (torch), with and without CUDA Graphs")
    parser.add_argument("--quick", action="store_true", help="one batch size, fewer steps")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU: CPU modes, graphs via the CPU stand-in capture, /tmp output")
    parser.add_argument("--strict", action="store_true", help="exit 1 on what must hold on any GPU")
    parser.add_argument("--plan", choices=("full", "device", "sweep"), default="full",
                        help=f"full: 3 batches; device: the GPU check's cells (~{DEVICE_PLAN_SECONDS} s); "
                             "sweep: batch x width, mlp30, transformer")
    parser.add_argument("--models", nargs="+", default=["ctr", "mlp30"], type=_model)
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument("--batches", nargs="+", type=_batch, default=None,
                        help=f"batch sizes, or {MIDDLE!r} (chosen from the end traces)")
    for flag, default, what in (
            ("--warmup", 6, "untimed steps of a built cell"), ("--steps", 20, "timed steps a repeat"),
            ("--width", 512, "tower / layer width"), ("--input-dim", 512, "mlp30 input width"),
            ("--buckets", 1000, "ctr hashed ids per feature"), ("--num-streams", 6, "block streams"),
            ("--ne-steps", 60, "training steps before the NE of the plain and the detached CTR model"),
            ("--repeats", 5, "alternating repeats of every cell (median and spread reported)")):
        parser.add_argument(flag, type=int, default=default, help=what)
    parser.add_argument("--trace-mode", default=None)
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start no group of cells that would end past SECONDS (results are always written)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "erase_gpu"))
    return parser


def resolve(args, cuda):
    """Fills the defaults that depend on CUDA / the dry run; validates modes."""
    if not cuda and not args.cpu_dry_run:
        raise SystemExit("erase_gpu.py needs CUDA (use --cpu-dry-run to check it on CPU)")
    args.modes_given = args.modes is not None
    args.modes = list(args.modes or (GPU_MODES if cuda else CPU_MODES))
    args.extra_modes = [m for m in EXTRA_MODES if cuda or m != "auto+graphs"]
    for mode in args.modes + args.extra_modes:
        parse_mode(mode)
    for mode in args.modes:
        if parse_mode(mode)[0] == "streams" and not cuda:
            raise SystemExit(f"{mode!r} needs CUDA")
    # The trace is of the first model's "streams" step on CUDA: a block's backward on its
    # stream overlapping a later block's forward is what ERASE's overlap looks like.
    args.trace_mode = args.trace_mode or ("streams" if cuda else "threaded")
    parse_mode(args.trace_mode)
    if args.batches is None:
        args.batches = list(GPU_BATCHES if cuda else CPU_BATCHES)
        if args.quick:
            args.batches = [args.batches[0]]
    args.traces = args.plan != "device"  # the device plan's seconds go to its cells
    if args.plan != "full":
        groups = DEVICE_GROUPS if args.plan == "device" else SWEEP_GROUPS
        args.models = list(dict.fromkeys(m for m, _ in groups))
        ctr = sorted({b for m, b in groups if model_spec(m)[0] == "ctr"})  # traced (the CTR model)
        args.batches = [CPU_BATCHES[0]] if args.cpu_dry_run else ctr
        if args.plan == "device" and not args.cpu_dry_run:
            args.warmup, args.steps = min(args.warmup, 4), min(args.steps, 10)
    if all(b == MIDDLE for b in args.batches):
        raise SystemExit(f"--batches: {MIDDLE!r} needs two batch sizes around it")
    if args.cpu_dry_run:
        args.warmup, args.steps = min(args.warmup, 4), min(args.steps, 3)
        args.width, args.input_dim, args.buckets = min(args.width, 16), min(args.input_dim, 16), 20
        args.repeats = min(args.repeats, 2)  # alternation and spread checked, not measured
        if args.out == build_parser().get_default("out"):
            args.out = "/tmp/erase_gpu_dry_run"
    elif args.quick:
        args.warmup, args.steps = min(args.warmup, 4), min(args.steps, 10)
    return args
