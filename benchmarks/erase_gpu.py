"""ERASE on a CUDA GPU (torch): every early-backward mode with and without CUDA Graphs, a
profiler trace of one step and its overlap timeline.

Models (`--models`):

- `ctr`: the CTR example (`examples/ctr/model.py`): a shared embedding table, six
  detached towers (DLRM/DCN/FM/wide interactions, `detach_input=False` so the local
  losses train the table), a top MLP; synthetic Criteo-shaped data
  (`examples/ctr/data.py`).
- `mlp30`: the sanity check of ERASE's overlap: a 30-layer MLP cut into 6 detached
  blocks of 5 Dense layers (a chain, each block with a logistic head and BCE), so
  each block's backward can overlap the forward of the blocks after it.

Modes (`--modes`): `undetached` (the same network without DetachBlocks, standard
step), `standard`, `blocking`, `threaded`, `streams`, each of the last three also as
`<mode>+graphs` (`cuda_graphs=True`), and `auto` (also `auto+graphs`). Every cell builds a fresh model,
runs `--warmup` untimed steps (more than the graph warm-up and capture steps), then
`--steps` timed steps; the clock is read after `torch.cuda.synchronize()`.

Reported per cell (`benchmarks.common.QPS_NOTE`): p50/p90 = percentiles of per-step
examples/s (p90 = the fast end, as the paper's "+9.51% p90 QPS"), step-time p50/p90
in ms, p90 over `standard`, and for graph modes the number of captured block graphs
and replays (a graph mode that captured nothing is flagged: `--strict` makes it an
error, as `scripts/gpu_check.sh` does).

Trace: one training step of the first model (the CTR model by default) in
`--trace-mode` (default `streams` on CUDA) under `torch.profiler` as a chrome trace
(`<out>_trace.json`) and a PNG (`<out>_timeline.png`) of the `"<block>/forward"` and
`"<block>/backward"` ranges per stream or thread. The pairs (block backward, later
block forward) that overlap on different streams are listed; with `--strict` on CUDA
none is an error (the hand-off keeps each block's backward on its own stream).

The CTR rows also give `upstream_backwards_per_step` (the shared embedding table's
backwards per step: 1 with the gradient hand-off) and `auto` rows how many of its
measuring steps fell inside the timed window (`auto_timed_measuring_steps`).

Usage:

    KERAS_BACKEND=torch python benchmarks/erase_gpu.py               # CUDA machine
    KERAS_BACKEND=torch python benchmarks/erase_gpu.py --quick       # short run
    KERAS_BACKEND=torch python benchmarks/erase_gpu.py --cpu-dry-run # no GPU: CPU modes,
        graphs through the CPU stand-in capture, tiny sizes, results in /tmp
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import QPS_NOTE  # noqa: E402
from benchmarks.common import machine_info  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from benchmarks.common import throughput_stats  # noqa: E402
from benchmarks.common import time_steps  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from benchmarks.common import write_text  # noqa: E402

MODELS = ("ctr", "mlp30")
GPU_MODES = (
    "undetached", "standard", "blocking", "blocking+graphs", "threaded", "threaded+graphs",
    "streams", "streams+graphs", "auto", "auto+graphs",
)
CPU_MODES = ("undetached", "standard", "blocking", "blocking+graphs", "threaded", "threaded+graphs")
GPU_BATCHES = (2048, 8192)
MLP_BLOCKS, MLP_LAYERS_PER_BLOCK = 6, 5


def parse_mode(mode):
    """`"threaded+graphs"` -> `("threaded", True)`; validates the name."""
    base, _, suffix = mode.partition("+")
    bases = ("undetached", "standard", "blocking", "threaded", "streams", "auto")
    if base not in bases or suffix not in ("", "graphs"):
        raise ValueError(f"unknown mode {mode!r}; expected one of {GPU_MODES}")
    if suffix and base in ("undetached", "standard"):
        raise ValueError(f"{mode!r}: graphs apply to blocking, threaded, streams and auto")
    return base, suffix == "graphs"


def build_mlp30(width, input_dim, detached=True, **model_kwargs):
    """The 30-layer MLP sanity check: 6 chained detached blocks of 5 Dense layers."""
    from keras_erase import DetachBlock, EraseModel

    inputs = keras.Input((input_dim,))
    h = inputs
    for b in range(MLP_BLOCKS):
        stack = keras.Sequential(
            [keras.layers.Dense(width, "relu") for _ in range(MLP_LAYERS_PER_BLOCK)],
            name=f"mlp_{b}",
        )
        if detached:
            stack = DetachBlock(stack, head=keras.layers.Dense(1), name=f"block_{b}",
                                loss=keras.losses.BinaryCrossentropy(from_logits=True))
        h = stack(h)
    outputs = keras.layers.Dense(1, "sigmoid", name="out")(h)
    if not detached:
        return keras.Model(inputs, outputs, name="mlp30_baseline")
    return EraseModel(inputs, outputs, name="mlp30_erase", **model_kwargs)


def make_model(model_name, mode, args):
    base, graphs = parse_mode(mode)
    detached = base != "undetached"
    kwargs = {} if not detached else {
        "dispatch": base, "cuda_graphs": graphs, "num_streams": args.num_streams
    }
    keras.utils.set_random_seed(0)
    if model_name == "ctr":
        from examples.ctr.model import build_ctr_model

        return build_ctr_model(detached, buckets=args.buckets, width=args.width, depth=3, **kwargs)
    return build_mlp30(args.width, args.input_dim, detached, **kwargs)


def make_batch(model_name, batch, args):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model_name == "ctr":
        from examples.ctr.data import synthetic_ctr

        data = synthetic_ctr(batch, buckets=args.buckets, seed=1)
        x = {"dense": data["dense"].astype("float32"), "sparse": data["sparse"].astype("int32")}
        y = data["label"].astype("float32").reshape(-1, 1)
    else:
        rng = np.random.default_rng(1)
        x = rng.normal(size=(batch, args.input_dim)).astype("float32")
        y = (rng.random((batch, 1)) < 0.3).astype("float32")
    to = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    return keras.tree.map_structure(to, x), to(y)


def prepared(model_name, mode, batch, args):
    model = make_model(model_name, mode, args)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    x, y = make_batch(model_name, batch, args)
    return model, x, y


def graph_counters(runners):
    captures = sum(r.captures for r in runners)
    return {
        "graphs_captured": captures,
        "graph_replays": sum(r.replays for r in runners),
        "graphs_disabled": any(r.disabled for r in runners),
    }


def upstream_counter(model_name, model):
    """`(accumulations list, hook handle)`: the CTR embedding table's backwards (any thread)."""
    if model_name != "ctr":
        return [], None
    counts = []
    table = model.get_layer("embeddings").embeddings.value
    return counts, table.register_post_accumulate_grad_hook(lambda p: counts.append(1))


def auto_window(selector, warmup, steps):
    """`(measuring steps, how many of them were timed)` of an `"auto"` cell.

    The selector measures its first steps; those after the `warmup` untimed
    steps are inside the timed window (all of them while it has not decided).
    """
    if selector is None:
        return 0, 0
    measuring = selector.steps if selector.done else warmup + steps
    return measuring, max(0, min(steps, measuring - warmup))


def run_cell(model_name, mode, batch, args, sync):
    from keras_erase.torch.cuda_graphs import runner as graph_runner

    before = set(map(id, graph_runner.live_runners()))
    model, x, y = prepared(model_name, mode, batch, args)
    counts, hook = upstream_counter(model_name, model)
    seconds = time_steps(lambda: model.train_on_batch(x, y), args.warmup, args.steps, sync=sync)
    row = {"model": model_name, "batch": batch, "mode": mode, **throughput_stats(seconds, batch)}
    if hook is not None:  # the hand-off: one backward of the shared table per step
        hook.remove()
        row["upstream_backwards_per_step"] = len(counts) / (args.warmup + args.steps)
    if parse_mode(mode)[0] == "auto":
        row["auto_choice"] = model.dispatch_choice
        measuring, timed = auto_window(model._erase.selector, args.warmup, args.steps)
        row["auto_measuring_steps"], row["auto_timed_measuring_steps"] = measuring, timed
    if parse_mode(mode)[1]:
        runners = [r for r in graph_runner.live_runners() if id(r) not in before]
        row.update(graph_counters(runners))
    return row


def graph_problems(rows):
    """Graph cells that did not really run on graphs (the GPU check must not pass silently)."""
    return [
        f"{r['model']} batch={r['batch']} {r['mode']}: captured={r.get('graphs_captured')} "
        f"replays={r.get('graph_replays')} disabled={r.get('graphs_disabled')}"
        for r in rows
        if parse_mode(r["mode"])[1]
        and (not r.get("graphs_captured") or not r.get("graph_replays") or r.get("graphs_disabled"))
    ]


def profile_one_step(model_name, mode, batch, args, cuda, trace_path):
    """Chrome trace of one training step (after warm-up) of `mode`."""
    import torch

    model, x, y = prepared(model_name, mode, batch, args)
    for _ in range(max(4, args.warmup // 3)):
        model.train_on_batch(x, y)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    try:  # record the backward worker thread too (started before the profiler)
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        kwargs = {"experimental_config": config}
    except (AttributeError, TypeError):
        kwargs = {}
    with torch.profiler.profile(activities=activities, **kwargs) as prof:
        model.train_on_batch(x, y)
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    return trace_path


def block_ranges(trace_path):
    """`(row label, block, phase, start_us, dur_us)` of the annotated block ranges.

    GPU annotations (`gpu_user_annotation`, one row per stream) are preferred;
    without them (CPU) the CPU `user_annotation` ranges are used, one row per thread.
    """
    with open(trace_path) as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    ranges = {"gpu": [], "cpu": []}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or "/" not in name:
            continue
        block, _, phase = name.rpartition("/")
        if phase not in ("forward", "backward"):
            continue
        kind = "gpu" if e.get("cat") == "gpu_user_annotation" else "cpu"
        if kind == "cpu" and e.get("cat") not in ("user_annotation", "cpu_op", None):
            continue
        label = f"stream {e.get('tid')}" if kind == "gpu" else f"thread {e.get('tid')}"
        ranges[kind].append((label, block, phase, float(e["ts"]), float(e.get("dur", 0.0))))
    return ranges["gpu"] or ranges["cpu"]


def overlaps(ranges):
    """`(backward block, forward block)` pairs where a block's backward overlaps a later forward.

    `ranges` as from `block_ranges`; the two ranges must be on different rows
    (streams or threads) and of different blocks: the ERASE overlap.
    """
    forwards = [r for r in ranges if r[2] == "forward"]
    found = []
    for label, block, phase, start, dur in ranges:
        if phase != "backward":
            continue
        for f_label, f_block, _, f_start, f_dur in forwards:
            if (f_label != label and f_block != block and f_start >= start
                    and f_start < start + dur and (block, f_block) not in found):
                found.append((block, f_block))
    return found


def plot_timeline(trace_path, png_path, title):
    """PNG timeline: one row per stream/thread, forward and backward ranges per block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranges = block_ranges(trace_path)
    if not ranges:
        raise RuntimeError(f"no '<block>/forward|backward' ranges in {trace_path}")
    t0 = min(r[3] for r in ranges)
    rows = sorted({r[0] for r in ranges})
    blocks = sorted({r[1] for r in ranges})
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(rows)))
    for label, block, phase, start, dur in ranges:
        ax.barh(
            rows.index(label),
            dur / 1e3,
            left=(start - t0) / 1e3,
            height=0.35 if phase == "forward" else 0.7,
            color=cmap(blocks.index(block) % 10),
            alpha=1.0 if phase == "forward" else 0.45,
            edgecolor="black",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.set_xlabel("ms since the first block range")
    ax.set_title(title + "  (thin solid: forward, thick light: backward; color: block)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i % 10)) for i in range(len(blocks))]
    ax.legend(handles, blocks, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.3 / len(rows)),
              fontsize=7, ncol=min(8, len(blocks)), frameon=False)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one batch size, fewer steps")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU: CPU modes, graphs via the CPU stand-in capture, /tmp output")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if a graph mode did not capture and replay graphs")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--input-dim", type=int, default=512, help="mlp30 input width")
    parser.add_argument("--buckets", type=int, default=1000, help="ctr hashed ids per feature")
    parser.add_argument("--num-streams", type=int, default=6)
    parser.add_argument("--trace-mode", default=None)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "erase_gpu"))
    return parser


def resolve(args, cuda):
    """Fills the defaults that depend on CUDA / the dry run; validates modes."""
    if not cuda and not args.cpu_dry_run:
        raise SystemExit("erase_gpu.py needs CUDA (use --cpu-dry-run to check it on CPU)")
    args.modes = list(args.modes or (GPU_MODES if cuda else CPU_MODES))
    for mode in args.modes:
        base, _ = parse_mode(mode)
        if base == "streams" and not cuda:
            raise SystemExit(f"{mode!r} needs CUDA")
    # On CUDA the trace is of the CTR model's "streams" step (a block's backward on its
    # stream must overlap the next block's forward: asserted with --strict).
    args.trace_mode = args.trace_mode or ("streams" if cuda else "threaded")
    parse_mode(args.trace_mode)
    if args.batches is None:
        args.batches = [GPU_BATCHES[0]] if (args.quick or not cuda) else list(GPU_BATCHES)
        if not cuda:
            args.batches = [32]
    if args.cpu_dry_run:
        args.warmup, args.steps = min(args.warmup, 4), min(args.steps, 3)
        args.width, args.input_dim, args.buckets = min(args.width, 16), min(args.input_dim, 16), 20
        if args.out == build_parser().get_default("out"):
            args.out = "/tmp/erase_gpu_dry_run"
    elif args.quick:
        args.warmup, args.steps = min(args.warmup, 10), min(args.steps, 20)
    return args


def main(argv=None):
    import torch

    from keras_erase.torch.cuda_graphs import capture as graph_capture

    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    args = resolve(args, cuda)
    previous = None
    if not cuda:  # graph modes run through the CPU stand-in capture (checks the code path)
        previous = graph_capture.set_default_capture(graph_capture.RecordingCapture)
    try:
        rows = run_all(args, cuda)
    finally:
        if not cuda:
            graph_capture.set_default_capture(previous)
    problems = graph_problems(rows)
    for line in problems:
        print("GRAPHS NOT USED:", line, flush=True)
    if args.strict and problems:
        raise SystemExit(1)
    return rows


def run_all(args, cuda):
    import torch

    sync = torch.cuda.synchronize if cuda else None
    rows = []
    for model_name in args.models:
        for batch in args.batches:
            cell_rows = []
            for mode in args.modes:
                row = run_cell(model_name, mode, batch, args, sync)
                cell_rows.append(row)
                print(f"{model_name} batch={batch} {mode:<16} p50={row['p50']:,.0f}/s "
                      f"p90={row['p90']:,.0f}/s", flush=True)
            standard = [r for r in cell_rows if r["mode"] == "standard"]
            for r in cell_rows:
                if standard:
                    r["p90_vs_standard"] = r["p90"] / standard[0]["p90"]
            rows.extend(cell_rows)
    model_name, batch = args.models[0], args.batches[0]
    trace_path = profile_one_step(model_name, args.trace_mode, batch, args, cuda,
                                  args.out + "_trace.json")
    png_path = plot_timeline(
        trace_path, args.out + "_timeline.png",
        f"one ERASE step, {model_name}, {args.trace_mode}, batch={batch}",
    )
    overlap = overlaps(block_ranges(trace_path))
    info = machine_info(
        torch=torch.__version__,
        keras=keras.__version__,
        device=torch.cuda.get_device_name(0) if cuda else "cpu (dry run: not a measurement)",
        width=args.width,
        num_streams=args.num_streams,
        warmup=args.warmup,
        steps=args.steps,
    )
    columns = ["model", "batch", "mode", "p50", "p90", "p90_vs_standard", "step_ms_p50",
               "step_ms_p90", "upstream_backwards_per_step", "graphs_captured",
               "graph_replays", "auto_choice", "auto_timed_measuring_steps"]
    auto_rows = [r for r in rows if r.get("auto_timed_measuring_steps")]
    auto_note = (
        "auto_timed_measuring_steps: how many of `auto`'s measuring steps (trial schedules, "
        "graph warm-up and capture) fell inside the timed window: "
        + ("none (every measuring step was in the untimed warm-up)." if not auto_rows else
           "; ".join(f"{r['model']} batch={r['batch']} {r['mode']}: "
                     f"{r['auto_timed_measuring_steps']} of {args.steps} timed steps "
                     f"(measuring steps: {r['auto_measuring_steps']}; use --warmup "
                     f">= {r['auto_measuring_steps']} to leave them out)" for r in auto_rows))
    )
    report = "\n".join(
        [
            "# ERASE on GPU: every early-backward mode, with and without CUDA Graphs (torch)",
            "",
            QPS_NOTE + " Single process: no per-rank figures are combined. The paper's best "
            "non-blocking row is +9.51% p90 QPS (worker thread + CUDA Graphs: +7.38%).",
            "",
            "graphs_captured / graph_replays: block graphs captured and forward replays in the "
            "timed cell (a graph mode with 0 did not use graphs). upstream_backwards_per_step "
            "(ctr): backwards of the shared embedding table per step (the gradient hand-off "
            "makes it 1 in every schedule).",
            "",
            auto_note,
            "",
            "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
            "",
            markdown_table(rows, columns),
            "",
            f"Trace of one `{args.trace_mode}` step ({model_name}, batch {batch}): "
            f"`{os.path.basename(trace_path)}`, timeline `{os.path.basename(png_path)}`. "
            "A block's backward overlapping a later block's forward on another "
            f"{'stream' if cuda else 'thread'}: "
            + (", ".join(f"{b} backward / {f} forward" for b, f in overlap) or "none"),
        ]
    )
    print(report)
    write_text(args.out + ".md", report)
    write_json(args.out + ".json", {"machine": info, "rows": rows, "trace": trace_path,
                                    "trace_overlaps": overlap})
    print(f"wrote {args.out}.md, .json, {trace_path}, {png_path}")
    if cuda and args.strict and not overlap:  # the GPU must show the overlap, from the trace
        raise SystemExit(
            f"no block backward overlaps a later block's forward in the {args.trace_mode} "
            f"trace of {model_name} ({trace_path})"
        )
    return rows


if __name__ == "__main__":
    main()
