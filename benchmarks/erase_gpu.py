"""ERASE on a CUDA GPU (torch): the schedules, with and without CUDA Graphs, against a user's baselines
(`WHAT`), profiler traces of their overlap; docs/erase.md ("Where ERASE pays", "GPU check") says what each
part measures. The plan (modes, `--plan`, the budget's order) is `erase_gpu_plan.py`'s. `--strict` fails on
what must hold on any GPU; `--cpu-dry-run`: CPU modes, the stand-in capture, tiny sizes (checks the code).

    KERAS_BACKEND=torch python benchmarks/erase_gpu.py --plan device --strict --budget 120  # the GPU check
"""

import math
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import QPS_NOTE, Budget, cuda_sync, machine_info, markdown_table, qps  # noqa: E402
from benchmarks.common import release_memory, write_results  # noqa: E402
from benchmarks.erase_gpu_plan import MIDDLE, NotFeasible, model_spec, auto_window  # noqa: E402
from benchmarks.erase_gpu_plan import steps_until_chosen, summarize, build_parser, choose_middle  # noqa: E402
from benchmarks.erase_gpu_plan import PLAIN_MODES, graph_problems, parse_mode, resolve, run_cells  # noqa: E402
from examples.ctr.data import synthetic_ctr  # noqa: E402
from examples.ctr.model import NormalizedEntropy, build_ctr_model  # noqa: E402
from keras_erase import DetachBlock, EraseModel  # noqa: E402
from keras_erase.torch.cuda_graphs import capture as graph_capture  # noqa: E402
from keras_erase.torch.cuda_graphs import runner as graph_runner  # noqa: E402
from tools import gpu_trace  # noqa: E402

MLP_BLOCKS, MLP_LAYERS_PER_BLOCK = 6, 5
DEVICE_BOUND = 0.9  # GPU-busy fraction of a trace above which the overlap is asserted (--strict)
EXACTNESS_TOLERANCE = 1e-4  # max |weight - standard step's| / (1 + |weight|), float32, TF32 off


def chain(name, inputs, h, stacks, blocks, head, loss, output, detached, detach_first=True, **model_kwargs):
    """`h` through `stacks`, the first `blocks` of them `DetachBlock`s (with `head()` and `loss()`; block 0 keeps
    its input gradient unless `detach_first`), then `output`: an `EraseModel`, or the plain baseline."""
    for b, stack in enumerate(stacks):
        if detached and b < blocks:
            stack = DetachBlock(stack, head=head(), name=f"block_{b}", loss=loss(), detach_input=b > 0 or detach_first)
        h = stack(h)
    if not detached:
        return keras.Model(inputs, output(h), name=f"{name}_baseline")
    return EraseModel(inputs, output(h), name=f"{name}_erase", **model_kwargs)


def build_mlp30(width, input_dim, detached=True, **model_kwargs):
    """The 30-layer MLP sanity check: 6 chained detached blocks of 5 Dense layers."""
    inputs = keras.Input((input_dim,))
    stacks = [keras.Sequential([keras.layers.Dense(width, "relu") for _ in range(MLP_LAYERS_PER_BLOCK)],
                               name=f"mlp_{b}") for b in range(MLP_BLOCKS)]
    return chain("mlp30", inputs, inputs, stacks, MLP_BLOCKS, lambda: keras.layers.Dense(1),
                 lambda: keras.losses.BinaryCrossentropy(from_logits=True),
                 keras.layers.Dense(1, "sigmoid", name="out"), detached, **model_kwargs)


class TransformerLayer(keras.layers.Layer):
    """A pre-norm causal transformer layer: self-attention and a 4x MLP, each with a residual."""

    def __init__(self, dim, heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads)
        self.norms = [keras.layers.LayerNormalization() for _ in range(2)]
        self.mlp = [keras.layers.Dense(4 * dim, "gelu"), keras.layers.Dense(dim)]

    def call(self, x):
        h = self.norms[0](x)
        x = x + self.attention(h, h, use_causal_mask=True)
        return x + self.mlp[1](self.mlp[0](self.norms[1](x)))


def build_transformer(width, detached=True, **model_kwargs):
    """A small next-token transformer cut at two points (the paper's NanoChat trace): two detached blocks of
    `TRANSFORMER_LAYERS` layers (the first hands its input gradient to the embedding), then the top ones."""
    ids = keras.Input((TRANSFORMER_SEQ,), dtype="int32")
    stacks = [keras.Sequential([TransformerLayer(width, 4) for _ in range(TRANSFORMER_LAYERS)], name=f"layers_{b}")
              for b in range(3)]
    return chain("transformer", ids, keras.layers.Embedding(TRANSFORMER_VOCAB, width)(ids), stacks, 2,
                 lambda: keras.layers.Dense(TRANSFORMER_VOCAB),
                 lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 keras.layers.Dense(TRANSFORMER_VOCAB, name="out"), detached, detach_first=False, **model_kwargs)


TRANSFORMER_VOCAB, TRANSFORMER_SEQ, TRANSFORMER_LAYERS = 1024, 64, 2


def make_model(model_name, mode, args):
    base, graphs = parse_mode(mode)
    detached = base not in PLAIN_MODES
    kwargs = dict(dispatch=base, cuda_graphs=graphs, num_streams=args.num_streams) if detached else {}
    keras.utils.set_random_seed(0)
    kind, width = model_spec(model_name)
    width = args.width if width is None or args.cpu_dry_run else width  # the dry run: tiny
    if kind == "ctr":
        return build_ctr_model(detached, buckets=args.buckets, width=width, depth=3, **kwargs)
    if kind == "transformer":
        return build_transformer(min(width, 256), detached, **kwargs)
    return build_mlp30(width, args.input_dim, detached, **kwargs)


def make_batch(model_name, batch, args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = model_spec(model_name)[0]
    if kind == "transformer":
        tokens = np.random.default_rng(1).integers(0, TRANSFORMER_VOCAB, (batch, TRANSFORMER_SEQ + 1))
        x, y = tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    elif kind == "ctr":
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
    """A compiled model of `mode` (the plain baselines: compiled or graphed as the mode says) and a batch."""
    model = make_model(model_name, mode, args)
    loss = ("binary_crossentropy" if model_spec(model_name)[0] != "transformer"
            else keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=mode == "plain+jit")
    x, y = make_batch(model_name, batch, args)
    if mode == "plain+reduce_overhead":  # torch.compile's CUDA Graphs on Keras's train step
        compiled = torch.compile(lambda data: model.train_step(data[0]), mode="reduce-overhead")
        model.make_train_function()

        def train_function(data):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(data)

        model.train_function = train_function
    elif mode == "plain+graph":
        model.train_function = whole_step_graph(model, x, y)
    return model, x, y


def whole_step_graph(model, x, y, warmup=3):
    """Keras's standard step (forward, loss, backward, update) captured as one CUDA Graph (the stand-in capture
    on CPU): a `train_function` replaying it; `NotFeasible` with the capture's error where it does not capture."""
    variables = model.trainable_weights
    params = [v.value for v in variables]
    optimizer = model.optimizer

    def step():
        for p in params:
            p.grad = None
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred, training=True)
        optimizer.scale_loss(loss).backward()
        with torch.no_grad():
            optimizer.apply([p.grad for p in params], variables)
        return loss.detach()

    for _ in range(warmup):  # the optimizer's slots and every lazy state exist before the capture
        step()
    try:
        graph = graph_capture.default_capture()(step)
    except Exception as error:  # noqa: BLE001 - the reason is the result
        raise NotFeasible(f"Keras's standard step does not capture as one graph here: "
                          f"{type(error).__name__}: {str(error)[:300]}") from error

    def train_function(data):
        graph.replay()
        return {"loss": graph.outputs}

    return train_function


def graph_pool_mib(runners):
    """MiB the caching allocator holds in the runners' graph memory pools (CUDA), else `None`."""
    pools = {tuple(pool) for r in runners for pool in r.pools() if isinstance(pool, tuple)}
    if not pools or not torch.cuda.is_available():
        return None
    total = sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                if tuple(segment.get("segment_pool_id", ())) in pools)
    return total / 2**20


def timed_steps(step, warmup, steps, sync=lambda: None):
    """Runs `warmup` untimed steps, then returns `(step seconds, host seconds)` of `steps` steps (a step's time
    read after `sync()`, the device finished; its host time until `step()` returned)."""
    for _ in range(warmup):
        step()
    seconds, host = [], []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds, host


def profile_step(model, x, y, cuda, trace_path):
    """Runs one training step under `torch.profiler` (annotated `gpu_trace.STEP`); writes the trace."""
    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU, kinds.CUDA] if cuda else [kinds.CPU]
    cuda_sync(cuda)
    try:  # record the backward worker thread too (started before the profiler)
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        kwargs = {"experimental_config": config}
    except (AttributeError, TypeError):
        kwargs = {}
    with torch.profiler.profile(activities=activities, **kwargs) as prof:
        with torch.profiler.record_function(gpu_trace.STEP):
            model.train_on_batch(x, y)
            cuda_sync(cuda)
    prof.export_chrome_trace(trace_path)
    return trace_path


# The models of the group being measured, built once: every repeat times the same live models, so
# the repeats are paired (and a compile or capture is paid once). {"group": (model, batch), mode: cell}
_LIVE = {}


def live_cell(model_name, mode, batch, args, cuda):
    """The built cell of `mode` in the current group (a new group releases the previous one's): a fresh model,
    `auto`'s untimed steps until it has chosen, `--warmup` steps; a failed build fails every repeat."""
    if _LIVE.get("group") != (model_name, batch):
        _LIVE.clear()
        release_memory(cuda)
        _LIVE["group"] = (model_name, batch)
    if mode not in _LIVE:
        before = set(map(id, graph_runner.live_runners()))
        try:
            model, x, y = prepared(model_name, mode, batch, args)
            step = lambda: model.train_on_batch(x, y)  # noqa: E731
            # `auto`'s choice is what is timed: untimed steps until it has chosen (none elsewhere).
            measuring = steps_until_chosen(model, step)
            timed_steps(step, args.warmup, 0)
        except Exception as error:  # noqa: BLE001 - kept: every repeat reports it
            if mode in PLAIN_MODES[1:] and not isinstance(error, NotFeasible):  # a baseline torch
                # cannot compile or capture here is a finding about the baseline, not an ERASE error
                error = NotFeasible(f"{mode}: {type(error).__name__}: {str(error)[:300]}")
            _LIVE[mode] = error
            raise error
        runners = [r for r in graph_runner.live_runners() if id(r) not in before]
        _LIVE[mode] = {"model": model, "x": x, "y": y, "step": step, "runners": runners,
                       "warmup": measuring + args.warmup}
        cuda_sync(cuda)
    cell = _LIVE[mode]
    if isinstance(cell, Exception):
        raise cell
    return cell


def run_cell(model_name, mode, batch, profile_path=None, *, args, cuda):
    """One repeat of a cell: timed steps of its live model; returns its row (and trace measures)."""
    cell = live_cell(model_name, mode, batch, args, cuda)
    model, step = cell["model"], cell["step"]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    counts, hook = [], None
    if model_name == "ctr":  # the CTR embedding table's backwards (any thread)
        hook = model.get_layer("embeddings").embeddings.value.register_post_accumulate_grad_hook(
            lambda p: counts.append(1))
    seconds, host = timed_steps(step, 1, args.steps, lambda: cuda_sync(cuda))
    row = {"model": model_name, "batch": batch, "mode": mode,
           **qps(seconds, batch), "host_ms_p50": 1e3 * float(np.median(host))}
    if hook is not None:  # the hand-off: one backward of the shared table per step
        hook.remove()
        row["upstream_backwards_per_step"] = len(counts) / (1 + args.steps)
    if parse_mode(mode)[0] == "auto":
        row["auto_choice"] = model.dispatch_choice
        measuring, timed = auto_window(model._erase.selector, cell["warmup"], args.steps)
        row["auto_measuring_steps"], row["auto_timed_measuring_steps"] = measuring, timed
    if cuda:
        row["max_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
    runners = cell["runners"]
    if parse_mode(mode)[1]:
        row.update(graphs_captured=sum(r.captures for r in runners), graph_replays=sum(r.replays for r in runners),
                   graphs_disabled=any(r.disabled for r in runners), graph_pool_mib=graph_pool_mib(runners),
                   graphs_refused=sorted(name for r in runners for name in r.refused))
    if profile_path is not None:  # after the timed steps: the profiler never slows them
        profile_step(model, cell["x"], cell["y"], cuda, profile_path)
        metrics = gpu_trace.step_metrics(gpu_trace.load_events(profile_path))
        row.update({k: metrics[k] for k in ("gpu_busy_fraction", "overlapped_fraction")},
                   traced_step_ms=metrics["step_ms"], **{f"host_{k}_ms": v for k, v in metrics["host_ms"].items()})
        os.remove(profile_path)
    return row


def run_trace(args, cuda, batch):
    """The profiled `--trace-mode` step of the first model at `batch`: its file, PNG, measures, costs."""
    model_name = args.models[0]
    trace_path = f"{args.out}_trace_{batch}.json"
    png_path = f"{args.out}_timeline_{batch}.png"
    result = {"batch": batch, "mode": args.trace_mode, "trace": os.path.basename(trace_path),
              "timeline": os.path.basename(png_path)}
    start = time.monotonic()
    try:
        model, x, y = prepared(model_name, args.trace_mode, batch, args)
        model.train_on_batch(x, y)
        cuda_sync(cuda)
        result["build_s"] = time.monotonic() - start
        steps = max(3, args.warmup // 3)
        step_start = time.monotonic()
        for _ in range(steps):
            model.train_on_batch(x, y)
        cuda_sync(cuda)
        result["step_s"] = (time.monotonic() - step_start) / steps
        profile_start = time.monotonic()
        profile_step(model, x, y, cuda, trace_path)
        events = gpu_trace.load_events(trace_path)
        result["metrics"] = gpu_trace.step_metrics(events)
        result["overlaps"] = gpu_trace.overlaps(gpu_trace.block_ranges(events))
        gpu_trace.plot_timeline(events, png_path, f"one ERASE step, {model_name}, "
                                                  f"{args.trace_mode}, batch={batch}")
        result["profile_s"] = time.monotonic() - profile_start
        del model
    except Exception as error:  # noqa: BLE001 - reported; the cells still run
        result["error"] = f"trace at batch {batch}: {type(error).__name__}: {error}"
        print("TRACE FAILED:", result["error"], flush=True)
    release_memory(cuda)
    result["seconds"] = time.monotonic() - start
    return result


def run_traces(args, cuda):
    """Traces the end batches, resolves `middle` from them, traces it; returns the traces."""
    fixed = [b for b in args.batches if b != MIDDLE]
    traces = {b: run_trace(args, cuda, b) for b in fixed}
    if MIDDLE in args.batches:
        ends = [traces[b] for b in (min(fixed), max(fixed)) if "metrics" in traces[b]]
        if len(ends) == 2 and ends[0]["batch"] != ends[1]["batch"]:
            points = [(t["batch"], t["metrics"]["host_ms"]["main"], t["metrics"]["gpu_busy_ms"])
                      for t in ends]
            middle = choose_middle(*points)
        else:
            middle = int(round(math.sqrt(min(fixed) * max(fixed))))
        args.batches = sorted(set(fixed) | {middle})
        args.middle = middle
        traces[middle] = run_trace(args, cuda, middle)
    return traces


def ne_check(args, cuda):
    """Held-out NE of the plain and the detached CTR model (seed 0, the smallest batch) after `--ne-steps` Adam
    steps on fresh synthetic batches; every schedule has the detached model's gradients, so its NE."""
    batch = min(b for b in args.batches if b != MIDDLE)
    steps = args.ne_steps
    data = synthetic_ctr(batch * steps + max(4 * batch, 4096), buckets=args.buckets, seed=2)
    features = {"dense": data["dense"].astype("float32"), "sparse": data["sparse"].astype("int32")}
    split = batch * steps
    rows = []
    for mode in ("plain", "standard"):
        model = make_model("ctr", mode, args)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy",
                      metrics=[NormalizedEntropy()])
        model.fit({k: v[:split] for k, v in features.items()}, data["label"][:split], batch_size=batch,
                  epochs=1, shuffle=False, verbose=0)
        scores = model.evaluate({k: v[split:] for k, v in features.items()}, data["label"][split:],
                                batch_size=batch, return_dict=True, verbose=0)
        rows.append({"model": "ctr", "mode": mode, "batch": batch, "steps": steps, "ne": float(scores["ne"])})
        del model
        release_memory(cuda)
    rows[1]["ne_gap_vs_plain"] = rows[1]["ne"] / rows[0]["ne"] - 1.0
    print("NE after", steps, "steps:", ", ".join(f"{r['mode']} {r['ne']:.4f}" for r in rows), flush=True)
    return rows


def exactness_check(args, cuda):
    """One row per early mode: its weights after enough SGD steps to capture and replay graphs, from the same
    weights and batch, against the standard step's, on the first model; TF32 off (a difference is ERASE's)."""
    model_name, batch = args.models[0], min(args.batches)
    steps = graph_runner.untimed_steps(graph_runner.DEFAULT_WARMUP) + 2
    modes = ["standard"] + [m for m in args.modes if parse_mode(m)[0] not in
                            PLAIN_MODES + ("standard", "auto")]
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
            del model
            release_memory(cuda)
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


def overlap_problems(traces, cuda):
    """Device-bound `streams` traces without any block backward overlapping a later forward."""
    return [
        f"trace at batch {t['batch']}: the GPU was busy {t['metrics']['gpu_busy_fraction']:.0%} "
        f"of the {t['mode']} step but no block backward overlaps a later block's forward"
        for t in traces.values()
        if cuda and "metrics" in t and parse_mode(t["mode"])[0] == "streams"
        and (t["metrics"]["gpu_busy_fraction"] or 0.0) >= DEVICE_BOUND and not t["overlaps"]
    ]


def run_all(args, cuda):
    """Traces and exactness (not in the device plan), NE, the cell groups within `--budget`; writes the results."""
    run = Budget(args.budget, release=lambda: release_memory(cuda))
    errors, traces, rows, exact, ne = run.report["errors"], {}, [], [], []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        if args.traces:
            traces = run.section("traces", None, lambda: run_traces(args, cuda)) or {}
            errors.extend(t["error"] for t in traces.values() if "error" in t)
            exact = run.section("exactness check", None, lambda: exactness_check(args, cuda)) or []
        if any(model_spec(m)[0] == "ctr" for m in args.models):
            ne = run.section("NE check", None, lambda: ne_check(args, cuda)) or []
        errors.extend(f"{r['model']} batch={r['batch']} {r['mode']}: weights differ from the "
                      f"standard step's by {r['max_rel_diff_vs_standard']:.2e} (relative) after "
                      f"{r['steps']} steps" for r in exact if not r["exact"])
        rows, skipped, cell_errors = run_cells(
            args, run, traces, lambda *cell: run_cell(*cell, args=args, cuda=cuda), run.release)
        run.report["skipped"] += skipped
        errors.extend(cell_errors)
    finally:
        _LIVE.clear()
        summary = summarize(rows)
        errors.extend(overlap_problems(traces, cuda))
        write_report(args, cuda, summary, rows, run.report["skipped"], errors, traces, run.elapsed(), exact, ne)
    if errors:
        print("ERRORS:", *errors, sep="\n  ", flush=True)
    if args.strict and errors:
        raise SystemExit(1)
    return summary


TRACE_COLUMNS = ["batch", "mode", "trace", "step_ms", "gpu_busy_fraction", "overlapped_fraction", "kernels",
                 "streams", "host_main_ms", "host_worker_ms", "host_autograd_ms", "overlaps", "error"]
HEADLINE_COLUMNS = ["model", "batch", "mode", "auto_choice", "best_baseline", "p90_vs_best", "p90_vs_best_range",
                    "p50_vs_best", "p50_vs_best_range", "p90_vs_plain", "p90_vs_standard", "graph_pool_mib"]
CELL_COLUMNS = ["model", "batch", "mode", "p50", "p50_spread", "p90", "p90_spread", "best_baseline", "p90_vs_best",
                "p90_vs_best_range", "p50_vs_best", "p50_vs_best_range", "p90_vs_plain", "p90_vs_standard",
                "step_ms_p50", "step_ms_p90", "host_ms_p50", "host_share", "gpu_busy_fraction",
                "overlapped_fraction", "host_main_ms", "host_worker_ms", "host_autograd_ms", "max_memory_mib",
                "graph_pool_mib", "repeats", "upstream_backwards_per_step", "graphs_captured", "graph_replays",
                "auto_choice", "auto_timed_measuring_steps"]
WHAT = QPS_NOTE + (
    " Single process: no per-rank figures are combined. The paper's best non-blocking row is +9.51% p90 QPS (worker "
    "thread + CUDA Graphs: +7.38%). Baselines, in rising effort: plain (the undetached model, Keras's standard "
    "step), plain+jit (`jit_compile=True`: torch.compile), plain+reduce_overhead (torch.compile(mode='reduce-"
    "overhead') on the train step), plain+graph (the whole standard step as one CUDA Graph), standard (the detached "
    "model's standard step). *_vs_best: the median over the repeats of each repeat's ratio to the best baseline's "
    "(the highest median p90) in the same repeat (the repeats alternate the modes on the same live models: "
    "paired), *_vs_best_range the smallest..largest of those ratios; p90_vs_plain likewise against the plain model. "
    "step_ms: the step's wall time; gpu_busy_fraction: the union of its kernels over it; overlapped_fraction: the "
    "time kernels of two or more streams ran at once over the GPU-busy time; host_*_ms: each thread role's host "
    "work in a step (main thread, backward worker, autograd's device thread); overlaps: block backward > later "
    "block forward on another stream; p50/p90: the median over the repeats, *_spread (max - min) / median; "
    "host_share = host_ms_p50 / step_ms_p50 (near 1: host-bound); max_memory_mib: `torch.cuda."
    "max_memory_allocated`; graph_pool_mib: what the graphs' memory pools hold; graphs_captured / graph_replays "
    "(a graph mode with 0 did not use graphs); upstream_backwards_per_step (ctr): backwards of the shared table per "
    "step (1 with the hand-off); auto_timed_measuring_steps: `auto`'s measuring steps inside the timed window.")


def _trace_row(trace):
    m = trace.get("metrics", {})
    return {**{k: trace.get(k) for k in ("batch", "mode", "trace")}, **{k: m.get(k) for k in TRACE_COLUMNS[3:8]},
            **{f"host_{k}_ms": v for k, v in m.get("host_ms", {}).items()},
            "overlaps": ", ".join(f"{b}>{f}" for b, f in trace.get("overlaps", [])) or "none",
            "error": trace.get("error", "")}


def _part(caption, rows, columns, empty="(not run)"):
    """A report part: its caption, then its table (`empty` without rows)."""
    return f"{caption}\n\n" + (markdown_table(list(rows), columns) if rows else empty)


def write_report(args, cuda, summary, rows, skipped, errors, traces, seconds, exact=(), ne=()):
    info = machine_info(
        torch=torch.__version__, keras=keras.__version__,
        device=torch.cuda.get_device_name(0) if cuda else "cpu (dry run: not a measurement)",
        width=args.width, num_streams=args.num_streams, warmup=args.warmup, steps=args.steps,
        repeats=args.repeats, budget_s=args.budget, wall_s=round(seconds, 1), plan=args.plan)
    middle = getattr(args, "middle", None)
    auto_timed = "; ".join(f"{r['model']} batch={r['batch']} {r['mode']}: {r['auto_timed_measuring_steps']} of "
                           f"{args.steps} (use --warmup >= {r['auto_measuring_steps']} to leave them out)"
                           for r in summary if r.get("auto_timed_measuring_steps"))
    parts = [
        _part("Traces: one profiled step per batch of the first model in the trace mode (`tools/gpu_trace.py`)."
              + (f" Middle batch {middle}: where the GPU time per step meets the main thread's host time."
                 if middle else ""), [_trace_row(t) for t in traces.values()], TRACE_COLUMNS, "(no trace)"),
        _part("Exactness (TF32 off): every early mode's weights after a few SGD steps from the same weights and "
              "batch, against the standard step's; max |w - w_standard| / (1 + |w_standard|), tolerance "
              f"{EXACTNESS_TOLERANCE:g}.", exact, ["model", "batch", "mode", "steps", "max_rel_diff_vs_standard", "exact"]),
        _part(f"NE (normalized entropy, held out, lower is better) of the plain and the detached CTR model after "
              f"{args.ne_steps} Adam steps on fresh batches; every ERASE schedule has the detached model's NE.",
              ne, ["model", "mode", "batch", "steps", "ne", "ne_gap_vs_plain"]),
        _part("Headline: `auto` (the one a user sets) against the best baseline a user has, paired per repeat.",
              [r for r in summary if parse_mode(r["mode"])[0] == "auto"], HEADLINE_COLUMNS, "(no auto cell ran)"),
        _part(f"Cells: one model per cell, built once ({args.warmup} untimed steps after `auto` chose), then "
              f"{args.repeats} repeats of 1 untimed and {args.steps} timed steps, the modes of a group alternating "
              f"on their live models. auto_timed_measuring_steps: {auto_timed or 'none in a timed window.'}"
              + (" Budget: {} s; not run: {}".format(args.budget, "; ".join(skipped)) if skipped
                 else " Every planned cell ran with its repeats."), summary, CELL_COLUMNS, "(no cell ran)"),
    ] + (["Errors:\n" + "\n".join(f"- {e}" for e in errors)] if errors else [])
    write_results(args.out, "ERASE on GPU: the early-backward schedules, with and without CUDA Graphs (torch)",
                  WHAT, None, info, "\n\n".join(parts),
                  {"rows": summary, "repeats": rows, "traces": list(traces.values()), "exactness": list(exact),
                   "ne": list(ne), "skipped": skipped, "errors": errors, "middle_batch": middle})


def main(argv=None):
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


if __name__ == "__main__":
    main()
