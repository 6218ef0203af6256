"""The plan of `benchmarks/erase_gpu.py`: its modes and arguments, the middle batch, the budget and
the order of the cell groups (the benchmark's docstring says why); what a CPU test can check of it.

The cells themselves (models, timing, traces) are the benchmark's: `run_cells` is given
`run_cell(model_name, mode, batch, profile_path)` and `release()` (between cells).
"""

import argparse
import math
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = ("ctr", "mlp30")
GPU_MODES = ("standard", "blocking", "blocking+graphs", "threaded", "threaded+graphs", "streams",
             "streams+graphs")
CPU_MODES = ("standard", "blocking", "blocking+graphs", "threaded", "threaded+graphs")
EXTRA_MODES = ("undetached", "auto", "auto+graphs")
MIDDLE = "middle"
GPU_BATCHES = (2048, MIDDLE, 65536)
CPU_BATCHES = (16, MIDDLE, 64)


def parse_mode(mode):
    """`"threaded+graphs"` -> `("threaded", True)`; validates the name."""
    base, _, suffix = mode.partition("+")
    bases = ("undetached", "standard", "blocking", "threaded", "streams", "auto")
    if base not in bases or suffix not in ("", "graphs"):
        raise ValueError(f"unknown mode {mode!r}; expected one of {GPU_MODES + EXTRA_MODES}")
    if suffix and base in ("undetached", "standard"):
        raise ValueError(f"{mode!r}: graphs apply to blocking, threaded, streams and auto")
    return base, suffix == "graphs"


AUTO_MEASURING_ESTIMATE = 30  # steps `"auto"` measures before it chooses, for the budget (26 on the H200)


def steps_until_chosen(model, step, limit=2 * AUTO_MEASURING_ESTIMATE):
    """Runs `step()` while `model.dispatch_choice` is None (`"auto"` measuring), at most `limit` times;
    returns how many ran (0 for any other dispatch, for `"auto"` on CPU, which never measures, and for a
    model that is not an `EraseModel`: the `undetached` cells)."""
    ran = 0
    while getattr(model, "dispatch_choice", "standard") is None and ran < limit:
        step()
        ran += 1
    return ran


def auto_window(selector, warmup, steps):
    """`(measuring steps, how many of them were timed)` of an `"auto"` cell.

    The selector measures its first steps; those after the `warmup` untimed
    steps are inside the timed window (all of them while it has not decided).
    """
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
        and (not r.get("graphs_captured") or not r.get("graph_replays") or r.get("graphs_disabled")
             or r.get("graphs_refused"))
    ]


def choose_middle(low, high):
    """The power of two between two traced batches where GPU time per step comes closest to host time.

    `low` and `high` are `(batch, host_ms, gpu_ms)`; both times are taken as linear
    in the batch through the two points, and the candidates are the powers of two
    from twice the low batch to half the high one. Without GPU work (a dry run):
    their geometric middle.
    """
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


class Budget:
    """Wall-clock budget of a run: whether work expected to take `seconds` still fits."""

    def __init__(self, seconds):
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self):
        return time.monotonic() - self.start

    def left(self):
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def fits(self, seconds):
        return seconds <= self.left()


def priority_groups(args):
    """`(model, batch, modes)` groups, most informative first (see the module docstring)."""
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
                except Exception as error:  # noqa: BLE001 - reported, the run goes on
                    errors.append(f"{cell}: {type(error).__name__}: {error}")
                    print("CELL FAILED:", errors[-1], flush=True)
                    release()
                    continue
                release()
                seconds = time.monotonic() - start
                costs.setdefault((model_name, batch), []).append(seconds)
                row["repeat"] = repeat
                rows.append(row)
                print(f"{cell:<44} p50={row['p50']:,.0f}/s p90={row['p90']:,.0f}/s "
                      f"host {row['host_ms_p50']:.2f} ms ({seconds:.1f} s)", flush=True)
    return rows, skipped, errors


def _batch(text):
    return MIDDLE if text == MIDDLE else int(text)


def build_parser():
    parser = argparse.ArgumentParser(description="ERASE on a CUDA GPU (torch): the early-backward schedules with and without CUDA Graphs")
    parser.add_argument("--quick", action="store_true", help="one batch size, fewer steps")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU: CPU modes, graphs via the CPU stand-in capture, /tmp output")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on what must hold on any GPU (see benchmarks/erase_gpu.py)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument("--batches", nargs="+", type=_batch, default=None,
                        help=f"batch sizes, or {MIDDLE!r} (chosen from the end traces)")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--input-dim", type=int, default=512, help="mlp30 input width")
    parser.add_argument("--buckets", type=int, default=1000, help="ctr hashed ids per feature")
    parser.add_argument("--num-streams", type=int, default=6)
    parser.add_argument("--trace-mode", default=None)
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating repeats of every cell (median and spread reported)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start no group of cells that would end past SECONDS "
                             "(results are always written)")
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
