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
`--steps` timed steps; the clock is read after `torch.cuda.synchronize()`, the host
time per step (`host_ms_p50`) when `train_on_batch` returned. Every cell runs
`--repeats` times (default 3), the modes alternating within a (model, batch); the
table gives the medians over the repeats and their spread ((max - min) / median).

Exactness (first, after the trace): every early mode's weights after a few SGD steps
(graph modes: warm-up, capture and replays) from the same weights and batch, against
the standard step's, with TF32 off; above `EXACTNESS_TOLERANCE` is an error.

`--budget SECONDS`: the run never starts a cell that would end past the budget
(its expected time: the same cell's last repeat, else the longest cell of its
model and batch so far); the trace and its timeline come first, and the markdown
and JSON are always written (the cells not run and any cell's error listed),
also when a cell fails.

Reported per cell (`benchmarks.common.QPS_NOTE`): p50/p90 = percentiles of per-step
examples/s (p90 = the fast end, as the paper's "+9.51% p90 QPS"), step-time p50/p90
in ms, p90 over `standard`, and for graph modes the number of captured block graphs
and replays (a graph mode that captured nothing is flagged: `--strict` makes it an
error, as `scripts/gpu_check.sh` does).

Trace: one training step of the first model (the CTR model by default) in
`--trace-mode` (default `streams` on CUDA) under `torch.profiler` as a chrome trace
(`<out>_trace.json`) and a PNG (`<out>_timeline.png`) of each block's forward and
backward per stream (CUDA: the device time of their kernels, `device_block_ranges`;
a backward's kernels are launched by autograd's device thread, so they are found
through their launches, not through the GPU user annotations, which only hold the
annotating thread's kernels) or per thread (CPU: the `"<block>/forward|backward"`
ranges). The pairs (block backward, later block forward) that overlap on different
streams are listed; with `--strict` on CUDA none is an error.

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
import time

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
from benchmarks.common import write_json  # noqa: E402
from benchmarks.common import write_text  # noqa: E402

MODELS = ("ctr", "mlp30")
GPU_MODES = (
    "undetached", "standard", "blocking", "blocking+graphs", "threaded", "threaded+graphs",
    "streams", "streams+graphs", "auto", "auto+graphs",
)
CPU_MODES = ("undetached", "standard", "blocking", "blocking+graphs", "threaded", "threaded+graphs")
# 2048: host-bound on an H200 (about 1-5 ms of GPU work per CTR step against tens of ms of host
# time); 65536: enough GPU work per step to saturate it. `host_share` (host time / step time)
# says which one a cell was: near 1 host-bound, well below 1 the device was the bottleneck.
GPU_BATCHES = (2048, 65536)
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


def timed_steps(step, warmup, steps, sync=None):
    """Runs `warmup` untimed steps, then returns `(step seconds, host seconds)` of `steps` steps.

    A step's time is read after `sync()` (the device finished); its host time
    is until `step()` returned (what the host spent launching it).
    """
    for _ in range(warmup):
        step()
    seconds, host = [], []
    for _ in range(steps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        if sync is not None:
            sync()
        seconds.append(time.perf_counter() - start)
    return seconds, host


def run_cell(model_name, mode, batch, args, sync):
    from keras_erase.torch.cuda_graphs import runner as graph_runner

    before = set(map(id, graph_runner.live_runners()))
    model, x, y = prepared(model_name, mode, batch, args)
    counts, hook = upstream_counter(model_name, model)
    seconds, host = timed_steps(lambda: model.train_on_batch(x, y), args.warmup, args.steps, sync)
    row = {"model": model_name, "batch": batch, "mode": mode, **throughput_stats(seconds, batch),
           "host_ms_p50": 1e3 * float(np.median(host))}
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


def _trace_events(trace_path):
    with open(trace_path) as f:
        events = json.load(f)
    return events.get("traceEvents", events) if isinstance(events, dict) else events


def _block_phase(name):
    block, _, phase = name.rpartition("/")
    return (block, phase) if block and phase in ("forward", "backward") else None


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def block_ranges(trace_path):
    """`(row label, block, phase, start_us, dur_us)` of each block's forward and backward.

    On CUDA, device ranges, one row per stream, from the kernels themselves
    (`device_block_ranges`); without kernels (CPU) the `user_annotation` ranges
    of the `"<block>/forward|backward"` record_function scopes, one row per thread.
    """
    events = _trace_events(trace_path)
    device = device_block_ranges(events)
    if device:
        return device
    ranges = []
    for e in events:
        found = _block_phase(e.get("name", "")) if e.get("ph") == "X" else None
        if found and e.get("cat") in ("user_annotation", "cpu_op", None):
            ranges.append((f"thread {e.get('tid')}", *found, float(e["ts"]), float(e.get("dur", 0.0))))
    return ranges


def device_block_ranges(events):
    """Each block phase's device range per stream, from the kernels and who launched them.

    The profiler's GPU user annotations hold only the kernels launched by the
    annotating thread (pytorch#144778), and a backward's kernels are launched by
    autograd's device thread: a `"<block>/backward"` annotation holds one kernel
    or none. So kernels are attributed through their launch (the
    `cuda_runtime` event with the same correlation id): a kernel launched by the
    thread of a block's CPU range, inside it, is that range's; a kernel launched
    by another thread (autograd's) inside a block's backward range is that
    backward's (when several backward ranges hold the launch, the one whose
    block's forward ran on the kernel's stream, as autograd runs a backward op
    on its forward op's stream; none if still ambiguous). A range's device
    extent on a stream is its kernels' first start to last end.

    Returns `(f"stream {id}", block, phase, start_us, dur_us)` tuples, sorted.
    """
    scopes, launches, kernels = [], {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat"), e.get("args") or {}
        if cat == "user_annotation":
            found = _block_phase(e.get("name", ""))
            if found:
                start = float(e["ts"])
                scopes.append((e.get("tid"), *found, start, start + float(e.get("dur", 0.0))))
        elif cat == "cuda_runtime" and "correlation" in args:
            launches[args["correlation"]] = (e.get("tid"), float(e["ts"]))
        elif cat in DEVICE_CATEGORIES and "correlation" in args:
            stream = args.get("stream", e.get("tid"))
            start = float(e["ts"])
            kernels.append((args["correlation"], stream, start, start + float(e.get("dur", 0.0))))
    annotating = {scope[0] for scope in scopes}
    owned = {}  # (block, phase, stream) -> [start, end]

    def add(key, start, end):
        extent = owned.setdefault(key, [start, end])
        extent[0], extent[1] = min(extent[0], start), max(extent[1], end)

    def holding(thread, ts, phase=None):
        return [sc for sc in scopes if sc[3] <= ts <= sc[4]
                and (sc[0] == thread if phase is None else sc[2] == phase)]

    pending = []
    for correlation, stream, start, end in kernels:
        launch = launches.get(correlation)
        if launch is None:
            continue
        thread, ts = launch
        own = holding(thread, ts)
        if own:  # innermost scope of the launching thread
            scope = max(own, key=lambda sc: sc[3])
            add((scope[1], scope[2], stream), start, end)
        elif thread not in annotating:  # autograd's device thread
            pending.append((stream, start, end, holding(None, ts, "backward")))
    forward_streams = {}
    for block, phase, stream in owned:
        if phase == "forward":
            forward_streams.setdefault(block, set()).add(stream)
    for stream, start, end, candidates in pending:
        # a backward runs on its forward's stream (autograd's stream semantics)
        candidates = [sc for sc in candidates if stream in forward_streams.get(sc[1], {stream})]
        if len(candidates) == 1:
            add((candidates[0][1], "backward", stream), start, end)
    return sorted(
        (f"stream {stream}", block, phase, start, end - start)
        for (block, phase, stream), (start, end) in owned.items()
    )


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
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating repeats of every cell (median and spread reported)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="stop starting cells when the next one would end past SECONDS "
                             "(the trace comes first; results are always written)")
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
        args.repeats = min(args.repeats, 2)  # alternation and spread checked, not measured
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


EXACTNESS_TOLERANCE = 1e-4  # max |weight - standard step's| / (1 + |weight|), float32, TF32 off


def exactness_check(args, cuda):
    """Every early mode's weights after a few SGD steps vs the standard step's, on the first model.

    The same initial weights and batch (the benchmark's first batch size) for every mode; enough
    steps for the graph modes to warm up, capture and replay. TF32 is off meanwhile (cuBLAS and
    cuDNN), so that a difference is ERASE's, not TF32's rounding. Returns one row per mode.
    """
    import torch

    from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
    from keras_erase.torch.cuda_graphs.runner import untimed_steps

    model_name, batch = args.models[0], args.batches[0]
    steps = untimed_steps(DEFAULT_WARMUP) + 2
    modes = ["standard"] + [m for m in args.modes if parse_mode(m)[0] not in
                            ("undetached", "standard", "auto")]
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        finals = {}
        for mode in modes:
            model = make_model(model_name, mode, args)
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy")
            x, y = make_batch(model_name, batch, args)
            for _ in range(steps):
                model.train_on_batch(x, y)
            finals[mode] = [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    reference = finals.pop("standard")
    rows = []
    for mode, weights in finals.items():
        worst = max(float(np.max(np.abs(w - r) / (1.0 + np.abs(r)))) for w, r in
                    zip(weights, reference))
        rows.append({"model": model_name, "batch": batch, "mode": mode, "steps": steps,
                     "max_rel_diff_vs_standard": worst, "exact": worst <= EXACTNESS_TOLERANCE})
        print(f"exactness {model_name} batch={batch} {mode:<16} {steps} steps: "
              f"max relative difference {worst:.2e}", flush=True)
    return rows


class Budget:
    """Wall-clock budget of a run: whether a cell expected to take `seconds` still fits."""

    def __init__(self, seconds):
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self):
        return time.monotonic() - self.start

    def fits(self, seconds):
        return self.seconds is None or self.elapsed() + seconds <= self.seconds


def summarize(rows):
    """One row per (model, batch, mode): medians of the repeats' p50/p90 and their spread."""
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["batch"], r["mode"]), []).append(r)
    summary = []
    for (model_name, batch, mode), repeats in groups.items():
        row = dict(repeats[-1])
        row.pop("repeat", None)
        row["repeats"] = len(repeats)
        for key in ("p50", "p90", "step_ms_p50", "step_ms_p90", "host_ms_p50"):
            values = [r[key] for r in repeats]
            row[key] = float(np.median(values))
            if key in ("p50", "p90"):
                row[key + "_spread"] = (max(values) - min(values)) / row[key] if row[key] else 0.0
        row["host_share"] = row["host_ms_p50"] / row["step_ms_p50"] if row["step_ms_p50"] else 0.0
        summary.append(row)
    for row in summary:
        standard = [r for r in summary if r["mode"] == "standard" and r["model"] == row["model"]
                    and r["batch"] == row["batch"]]
        if standard:
            row["p90_vs_standard"] = row["p90"] / standard[0]["p90"]
    return summary


def run_trace(args, cuda):
    """The profiled step, its timeline PNG and overlaps: `(trace, png, overlaps, error)`."""
    model_name, batch = args.models[0], args.batches[0]
    trace_path, png_path = args.out + "_trace.json", args.out + "_timeline.png"
    try:
        profile_one_step(model_name, args.trace_mode, batch, args, cuda, trace_path)
        plot_timeline(trace_path, png_path,
                      f"one ERASE step, {model_name}, {args.trace_mode}, batch={batch}")
        return trace_path, png_path, overlaps(block_ranges(trace_path)), None
    except Exception as error:  # noqa: BLE001 - reported; the cells still run
        return trace_path, png_path, [], f"{type(error).__name__}: {error}"


def run_cells(args, sync, budget):
    """Every cell `args.repeats` times, modes alternating; returns `(rows, skipped, errors)`."""
    rows, skipped, errors, cost = [], [], [], {}
    for model_name in args.models:
        for batch in args.batches:
            for repeat in range(args.repeats):
                for mode in args.modes:
                    cell = (model_name, batch, mode)
                    expected = cost.get(cell, max((c for k, c in cost.items()
                                                   if k[:2] == cell[:2]), default=0.0))
                    label = f"{model_name} batch={batch} {mode} repeat {repeat + 1}"
                    if not budget.fits(expected):
                        skipped.append(label)
                        continue
                    start = time.monotonic()
                    try:
                        row = run_cell(model_name, mode, batch, args, sync)
                    except Exception as error:  # noqa: BLE001 - reported, the run goes on
                        errors.append(f"{label}: {type(error).__name__}: {error}")
                        print("CELL FAILED:", errors[-1], flush=True)
                        continue
                    cost[cell] = time.monotonic() - start
                    row["repeat"] = repeat
                    rows.append(row)
                    print(f"{label:<40} p50={row['p50']:,.0f}/s p90={row['p90']:,.0f}/s "
                          f"host {row['host_ms_p50']:.2f} ms ({cost[cell]:.1f} s)", flush=True)
    return rows, skipped, errors


def run_all(args, cuda):
    """Trace first, then the cells within `--budget`; always writes the markdown and JSON."""
    import torch

    budget = Budget(args.budget)
    sync = torch.cuda.synchronize if cuda else None
    trace_path, png_path, overlap, trace_error = run_trace(args, cuda)
    rows, skipped, errors, exact = [], [], [], []
    try:
        try:
            exact = exactness_check(args, cuda)
        except Exception as error:  # noqa: BLE001 - reported; the cells still run
            errors.append(f"exactness check: {type(error).__name__}: {error}")
        errors.extend(f"{r['model']} batch={r['batch']} {r['mode']}: weights differ from the "
                      f"standard step's by {r['max_rel_diff_vs_standard']:.2e} (relative) after "
                      f"{r['steps']} steps" for r in exact if not r["exact"])
        rows, skipped, cell_errors = run_cells(args, sync, budget)
        errors.extend(cell_errors)
    finally:
        summary = summarize(rows)
        if trace_error:
            errors.insert(0, f"trace: {trace_error}")
        write_report(args, cuda, summary, rows, skipped, errors, trace_path, png_path, overlap,
                     budget.elapsed(), exact)
    if errors:
        print("ERRORS:", *errors, sep="\n  ", flush=True)
    if cuda and args.strict and not overlap:  # the GPU must show the overlap, from the kernels
        raise SystemExit(
            f"no block backward overlaps a later block's forward in the {args.trace_mode} "
            f"trace ({trace_path})"
        )
    if args.strict and errors:
        raise SystemExit(1)
    return summary


def write_report(args, cuda, summary, rows, skipped, errors, trace_path, png_path, overlap,
                 seconds, exact=()):
    import torch

    model_name, batch = args.models[0], args.batches[0]
    info = machine_info(
        torch=torch.__version__,
        keras=keras.__version__,
        device=torch.cuda.get_device_name(0) if cuda else "cpu (dry run: not a measurement)",
        width=args.width,
        num_streams=args.num_streams,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        budget_s=args.budget,
        wall_s=round(seconds, 1),
    )
    columns = ["model", "batch", "mode", "p50", "p50_spread", "p90", "p90_spread",
               "p90_vs_standard", "step_ms_p50", "step_ms_p90", "host_ms_p50", "host_share", "repeats",
               "upstream_backwards_per_step", "graphs_captured", "graph_replays", "auto_choice",
               "auto_timed_measuring_steps"]
    auto_rows = [r for r in summary if r.get("auto_timed_measuring_steps")]
    auto_note = (
        "auto_timed_measuring_steps: how many of `auto`'s measuring steps (trial schedules, "
        "graph warm-up and capture) fell inside the timed window: "
        + ("none (every measuring step was in the untimed warm-up)." if not auto_rows else
           "; ".join(f"{r['model']} batch={r['batch']} {r['mode']}: "
                     f"{r['auto_timed_measuring_steps']} of {args.steps} timed steps "
                     f"(measuring steps: {r['auto_measuring_steps']}; use --warmup "
                     f">= {r['auto_measuring_steps']} to leave them out)" for r in auto_rows))
    )
    stopped = (f"Budget: {args.budget:.0f} s; {len(skipped)} cells not run: "
               + ", ".join(skipped)) if skipped else "Every cell ran."
    report = "\n".join(
        [
            "# ERASE on GPU: every early-backward mode, with and without CUDA Graphs (torch)",
            "",
            QPS_NOTE + " Single process: no per-rank figures are combined. The paper's best "
            "non-blocking row is +9.51% p90 QPS (worker thread + CUDA Graphs: +7.38%).",
            "",
            f"Each cell: a fresh model, {args.warmup} untimed steps, {args.steps} timed steps; "
            f"{args.repeats} repeats, the modes alternating; p50/p90: the median over the "
            "repeats, *_spread: (max - min) / median. host_ms_p50: the host's time per step "
            "(until `train_on_batch` returned, before the device finished); host_share = "
            "host_ms_p50 / step_ms_p50 (near 1: host-bound; well below 1: the GPU is saturated). "
            "graphs_captured / graph_replays: block graphs captured and forward replays in the "
            "timed cell (a graph mode with 0 did not use graphs). upstream_backwards_per_step "
            "(ctr): backwards of the shared embedding table per step (the gradient hand-off "
            "makes it 1 in every schedule).",
            "",
            auto_note,
            "",
            stopped,
            "",
            "Exactness (TF32 off): every early mode's weights after a few SGD steps from the same "
            "weights and batch, against the standard step's; max |w - w_standard| / (1 + "
            f"|w_standard|), tolerance {EXACTNESS_TOLERANCE:g}.",
            "",
            markdown_table(list(exact), ["model", "batch", "mode", "steps",
                                         "max_rel_diff_vs_standard", "exact"])
            if exact else "(not run)",
            "",
            "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
            "",
            markdown_table(summary, columns) if summary else "(no cell ran)",
            "",
            f"Trace of one `{args.trace_mode}` step ({model_name}, batch {batch}): "
            f"`{os.path.basename(trace_path)}`, timeline `{os.path.basename(png_path)}`. "
            "A block's backward overlapping a later block's forward on another "
            f"{'stream (device time of their kernels)' if cuda else 'thread'}: "
            + (", ".join(f"{b} backward / {f} forward" for b, f in overlap) or "none"),
        ]
        + (["", "Errors:", *[f"- {e}" for e in errors]] if errors else [])
    )
    print(report)
    write_text(args.out + ".md", report)
    write_json(args.out + ".json", {"machine": info, "rows": summary, "repeats": rows,
                                    "exactness": list(exact),
                                    "skipped": skipped, "errors": errors, "trace": trace_path,
                                    "trace_overlaps": overlap})
    print(f"wrote {args.out}.md, .json, {trace_path}, {png_path}")


if __name__ == "__main__":
    main()
