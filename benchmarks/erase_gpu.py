"""ERASE on a CUDA GPU (torch): the CPU benchmark's cells plus `"streams"` and CUDA Graphs,
a torch profiler chrome trace of one step and a PNG timeline of it.

Modes: `undetached` (plain model, standard step), `standard`, `blocking`, `threaded`,
`streams`, `streams+graphs` (`cuda_graphs=True`) and `auto`, per (batch, width)
configuration; p50/p90 examples/s from per-step times after warm-up (the clock is
read after `torch.cuda.synchronize()`). The paper's best gain is +9.51% p90 QPS;
the table reports every mode's p90 over `standard`.

The trace: one training step of `--trace-mode` (default `streams`, one stream per
tower) under `torch.profiler` (CPU + CUDA) is written as a chrome trace
(`<out>_trace.json`, open in chrome://tracing or Perfetto). The PNG
(`<out>_timeline.png`) draws, per stream (GPU) or thread (CPU), the
`"<block>/forward"` and `"<block>/backward"` ranges the dispatchers annotate with
`torch.profiler.record_function`, like the paper's trace figure.

Usage:

    KERAS_BACKEND=torch python benchmarks/erase_gpu.py             # on a CUDA machine
    KERAS_BACKEND=torch python benchmarks/erase_gpu.py --quick     # short run
    KERAS_BACKEND=torch python benchmarks/erase_gpu.py --cpu-dry-run  # CPU modes only,
        checks the script, the trace and the plot without a GPU (results in /tmp)
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

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from benchmarks.common import throughput_stats  # noqa: E402
from benchmarks.common import time_steps  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from benchmarks.common import write_text  # noqa: E402
from benchmarks.erase_cpu import build_ctr_model  # noqa: E402
from benchmarks.erase_cpu import synthetic_ctr_batch  # noqa: E402

GPU_CONFIGS = [(2048, 512), (8192, 1024), (16384, 1024)]
GPU_MODES = ["undetached", "standard", "blocking", "threaded", "streams", "streams+graphs", "auto"]
CPU_MODES = ["undetached", "standard", "blocking", "threaded", "auto"]


def make_model(mode, width, args):
    common = dict(width=width, num_towers=args.towers, depth=args.depth, input_dim=args.input_dim)
    if mode == "undetached":
        return build_ctr_model(detached=False, **common)
    if mode == "streams+graphs":
        return build_ctr_model(
            dispatch="streams", cuda_graphs=True, num_streams=args.num_streams, **common
        )
    return build_ctr_model(dispatch=mode, num_streams=args.num_streams, **common)


def prepared(mode, batch, width, args):
    model = make_model(mode, width, args)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    x, y = synthetic_ctr_batch(batch, args.input_dim)
    x, y = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)
    return model, x, y


def run_cell(mode, batch, width, args, sync):
    model, x, y = prepared(mode, batch, width, args)
    seconds = time_steps(lambda: model.train_on_batch(x, y), args.warmup, args.steps, sync=sync)
    row = {"batch": batch, "width": width, "mode": mode, **throughput_stats(seconds, batch)}
    if mode == "auto":
        row["auto_choice"] = model.dispatch_choice
    return row


def profile_one_step(mode, batch, width, args, cuda, trace_path):
    """Chrome trace of one training step (after warm-up) of `mode`."""
    import torch

    model, x, y = prepared(mode, batch, width, args)
    for _ in range(max(3, args.warmup // 3)):
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
        y = rows.index(label)
        color = cmap(blocks.index(block) % 10)
        ax.barh(
            y,
            dur / 1e3,
            left=(start - t0) / 1e3,
            height=0.35 if phase == "forward" else 0.7,
            color=color,
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


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu-dry-run", action="store_true", help="no GPU: CPU modes, /tmp output")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--towers", type=int, default=6)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--input-dim", type=int, default=512)
    parser.add_argument("--num-streams", type=int, default=6)
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument("--trace-mode", default=None)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "erase_gpu"))
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_dry_run:
        raise SystemExit("erase_gpu.py needs CUDA (use --cpu-dry-run to check it on CPU)")
    configs = GPU_CONFIGS
    modes = args.modes or (GPU_MODES if cuda else CPU_MODES)
    trace_mode = args.trace_mode or ("streams" if cuda else "threaded")
    if args.quick or args.cpu_dry_run:
        configs = [(2048, 512)] if cuda else [(256, 64)]
        args.warmup, args.steps = 13, (20 if cuda else 5)
        if not cuda:
            args.input_dim = 64
    if args.cpu_dry_run and args.out == parser.get_default("out"):
        args.out = "/tmp/erase_gpu_dry_run"
    sync = torch.cuda.synchronize if cuda else None
    rows = []
    for batch, width in configs:
        for mode in modes:
            row = run_cell(mode, batch, width, args, sync)
            rows.append(row)
            print(f"batch={batch} width={width} {mode:<15} p50={row['p50']:,.0f}/s "
                  f"p90={row['p90']:,.0f}/s", flush=True)
        standard = [r for r in rows if (r["batch"], r["width"], r["mode"]) == (batch, width, "standard")]
        for r in rows:
            if standard and (r["batch"], r["width"]) == (batch, width):
                r["p90_vs_standard"] = r["p90"] / standard[0]["p90"]
    batch, width = configs[0]
    trace_path = profile_one_step(trace_mode, batch, width, args, cuda, args.out + "_trace.json")
    png_path = plot_timeline(
        trace_path, args.out + "_timeline.png",
        f"one ERASE step, dispatch={trace_mode!r}, batch={batch}, width={width}",
    )
    info = machine_info(
        torch=torch.__version__,
        keras=keras.__version__,
        device=torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
        towers=args.towers,
        depth=args.depth,
        input_dim=args.input_dim,
        num_streams=args.num_streams,
        warmup=args.warmup,
        steps=args.steps,
    )
    columns = ["batch", "width", "mode", "p50", "p90", "p90_vs_standard", "step_ms_p50", "step_ms_p90"]
    report = "\n".join(
        [
            "# ERASE on GPU: CTR model, six detached towers (torch)",
            "",
            "p50/p90 = examples/s at the median / 90th-percentile step time; paper's best: +9.51% p90.",
            "",
            "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
            "",
            markdown_table(rows, columns),
            "",
            f"Trace of one `{trace_mode}` step: `{os.path.basename(trace_path)}`, "
            f"timeline `{os.path.basename(png_path)}`.",
        ]
    )
    print(report)
    write_text(args.out + ".md", report)
    write_json(args.out + ".json", {"machine": info, "rows": rows, "trace": trace_path})
    print(f"wrote {args.out}.md, .json, {trace_path}, {png_path}")


if __name__ == "__main__":
    main()
