"""Reading a torch profiler trace (chrome trace JSON) of training steps: who ran what, where, when.

Pure functions over the trace's events, no torch needed:

- `block_ranges` / `device_block_ranges`: each `DetachBlock`'s forward and
  backward per stream (CUDA: the device time of their kernels) or per thread
  (CPU: the `"<block>/forward|backward"` ranges), and `overlaps` of a block's
  backward with a later block's forward;
- `step_metrics`: for the step annotated `STEP` (the benchmark wraps each
  profiled step in `torch.profiler.record_function(STEP)`): its wall time,
  the GPU-busy fraction (the union of its kernels over the step), the
  overlapped kernel-time fraction (the time kernels of two or more streams
  run at once, over the GPU-busy time), and the host time per thread role
  (`main`: the step's thread; `worker`: a thread that ran block backwards;
  `autograd`: any other thread that launched GPU work, autograd's device
  thread; `other`);
- `plot_timeline`: a PNG of the block ranges.

Kernels are attributed to the thread that launched them through the launch
event with the same correlation id, from the CUDA runtime (`cuda_runtime`) or
the driver API (`cuda_driver`: Triton kernels, some library kernels).

Example:

```python
events = load_events("benchmarks/results/erase_gpu_trace_2048.json")  # erase_gpu.py writes it (not committed)
print(step_metrics(events)["gpu_busy_fraction"], overlaps(block_ranges(events)))
```
"""

import json

__all__ = [
    "DEVICE_CATEGORIES", "LAUNCH_CATEGORIES", "STEP", "block_ranges", "device_block_ranges",
    "load_events", "overlaps", "plot_timeline", "step_metrics", "union_length",
]

STEP = "erase_gpu/step"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# Host calls that only wait for the device: not host work.
_WAITS = ("Synchronize", "cudaStreamWaitEvent", "cuStreamWaitEvent")


def load_events(trace_path):
    """The `traceEvents` of a chrome trace file."""
    with open(trace_path) as f:
        events = json.load(f)
    return events.get("traceEvents", events) if isinstance(events, dict) else events


def _complete(events, categories):
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories]


def _block_phase(name):
    block, _, phase = name.rpartition("/")
    return (block, phase) if block and phase in ("forward", "backward") else None


def block_ranges(events):
    """`(row label, block, phase, start_us, dur_us)` of each block's forward and backward.

    On CUDA, device ranges, one row per stream (`device_block_ranges`); without
    kernels (CPU) the `user_annotation` ranges of the `"<block>/forward|backward"`
    record_function scopes, one row per thread.
    """
    device = device_block_ranges(events)
    if device:
        return device
    ranges = []
    for e in events:
        found = _block_phase(e.get("name", "")) if e.get("ph") == "X" else None
        if found and e.get("cat") in ("user_annotation", "cpu_op", None):
            ranges.append((f"thread {e.get('tid')}", *found, float(e["ts"]), float(e.get("dur", 0.0))))
    return ranges


def _launches(events):
    """`{correlation: (thread, ts)}` of every kernel launch (runtime or driver API)."""
    return {
        (e.get("args") or {})["correlation"]: (e.get("tid"), float(e["ts"]))
        for e in _complete(events, LAUNCH_CATEGORIES) if "correlation" in (e.get("args") or {})
    }


def _kernels(events):
    """`(correlation, stream, start, end)` of every device event that has a correlation id."""
    found = []
    for e in _complete(events, DEVICE_CATEGORIES):
        args = e.get("args") or {}
        if "correlation" in args:
            start = float(e["ts"])
            found.append((args["correlation"], args.get("stream", e.get("tid")), start,
                          start + float(e.get("dur", 0.0))))
    return found


def device_block_ranges(events):
    """Each block phase's device range per stream, from the kernels and who launched them.

    The profiler's GPU user annotations hold only the kernels launched by the
    annotating thread (pytorch#144778), and a backward's kernels are launched by
    autograd's device thread: a `"<block>/backward"` annotation holds one kernel
    or none. So kernels are attributed through their launch (the `cuda_runtime`
    or `cuda_driver` event with the same correlation id): a kernel launched by
    the thread of a block's CPU range, inside it, is that range's; a kernel
    launched by another thread (autograd's) inside a block's backward range is
    that backward's (when several backward ranges hold the launch, the one whose
    block's forward ran on the kernel's stream, as autograd runs a backward op
    on its forward op's stream; none if still ambiguous). A range's device
    extent on a stream is its kernels' first start to last end.

    Returns `(f"stream {id}", block, phase, start_us, dur_us)` tuples, sorted.
    """
    scopes = []
    for e in _complete(events, ("user_annotation",)):
        found = _block_phase(e.get("name", ""))
        if found:
            start = float(e["ts"])
            scopes.append((e.get("tid"), *found, start, start + float(e.get("dur", 0.0))))
    launches = _launches(events)
    annotating = {scope[0] for scope in scopes}
    owned = {}  # (block, phase, stream) -> [start, end]

    def add(key, start, end):
        extent = owned.setdefault(key, [start, end])
        extent[0], extent[1] = min(extent[0], start), max(extent[1], end)

    def holding(thread, ts, phase=None):
        return [sc for sc in scopes if sc[3] <= ts <= sc[4]
                and (sc[0] == thread if phase is None else sc[2] == phase)]

    pending = []
    for correlation, stream, start, end in _kernels(events):
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


def union_length(intervals, at_least=1):
    """Length of the time covered by at least `at_least` of `(start, end)` intervals at once."""
    edges = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s])
    covered, depth, since = 0.0, 0, None
    for t, step in edges:
        if depth >= at_least and since is not None:
            covered += t - since
        depth += step
        since = t
    return covered


def _clip(intervals, start, end):
    return [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]


def step_metrics(events):
    """Measures of the profiled step(s) annotated `STEP` (the last one if several).

    Returns a dict: `step_ms` (the step's wall time on the host), `gpu_busy_ms`
    and `gpu_busy_fraction` (kernels of any stream over the step; `None`
    without kernels),
    `overlapped_fraction` (time kernels of >= 2 streams ran at once over the
    GPU-busy time; `None` without kernels), `kernels`, `streams`, and
    `host_ms` per thread role (`main`, `worker`, `autograd`, `other`): the
    union of each thread's host operations and launches, waits left out.
    """
    steps = [e for e in _complete(events, ("user_annotation",)) if e.get("name") == STEP]
    if not steps:
        raise ValueError(f"no {STEP!r} range in the trace")
    step = max(steps, key=lambda e: float(e["ts"]))
    start, end, main = float(step["ts"]), float(step["ts"]) + float(step["dur"]), step.get("tid")
    kernels = [(stream, s, e) for _, stream, s, e in _kernels(events) if e > start and s < end]
    spans = _clip([(s, e) for _, s, e in kernels], start, end)
    per_stream = {}
    for stream, s, e in kernels:
        per_stream.setdefault(stream, []).append((s, e))
    busy = union_length(spans)
    # two or more streams at once: each stream's own union, then covered twice or more
    stream_unions = []
    for intervals in per_stream.values():
        stream_unions.extend(_merged(_clip(intervals, start, end)))
    concurrent = union_length(stream_unions, at_least=2)
    backward_threads = {e.get("tid") for e in _complete(events, ("user_annotation",))
                        if (_block_phase(e.get("name", "")) or ("", ""))[1] == "backward"}
    launching = {e.get("tid") for e in _complete(events, LAUNCH_CATEGORIES)}
    host = {"main": 0.0, "worker": 0.0, "autograd": 0.0, "other": 0.0}
    work = {}
    for e in _complete(events, ("cpu_op",) + LAUNCH_CATEGORIES):
        if any(w in e.get("name", "") for w in _WAITS):
            continue
        s = float(e["ts"])
        work.setdefault(e.get("tid"), []).append((s, s + float(e.get("dur", 0.0))))
    for tid, intervals in work.items():
        if tid == main:
            role = "main"
        elif tid in backward_threads:
            role = "worker"
        elif tid in launching:
            role = "autograd"
        else:
            role = "other"
        host[role] += union_length(_clip(intervals, start, end)) / 1e3
    step_us = end - start
    return {
        "step_ms": step_us / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_busy_fraction": busy / step_us if kernels and step_us else None,
        "overlapped_fraction": concurrent / busy if busy else None,
        "kernels": len(kernels),
        "streams": len(per_stream),
        "host_ms": host,
    }


def _merged(intervals):
    """`intervals` with overlapping ones merged (one stream's busy periods)."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def plot_timeline(events, png_path, title):
    """PNG timeline: one row per stream/thread, forward and backward ranges per block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranges = block_ranges(events)
    if not ranges:
        raise RuntimeError("no '<block>/forward|backward' ranges in the trace")
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
