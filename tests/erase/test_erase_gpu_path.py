"""The GPU check's CPU-checkable parts: `benchmarks/erase_gpu_plan.py` (argument handling, the middle
batch, the budget's plan), `benchmarks/erase_gpu.py` (a tiny CPU dry run through the graph code
path, as a subprocess), `tools/gpu_trace.py` (block ranges, overlap and step measures on synthetic
CUDA traces), `scripts/gpu_check.sh`, and `EraseModel(cuda_graphs=True)` in every mode with the
CPU stand-in capture."""

import os
import re
import subprocess

import keras
import numpy as np
import pytest

from keras_erase.config import Schedule
from tests.backend_utils import BACKEND, to_numpy
from tests.erase.test_cuda_graphs import stand_in_captures

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the ERASE GPU path is torch's")


def test_gpu_check_script_parses_and_names_existing_files():
    script = os.path.join(REPO, "scripts", "gpu_check.sh")
    subprocess.run(["bash", "-n", script], check=True)
    text = open(script).read()
    for path in re.findall(r"(?:tests|benchmarks)/[\w/]+\.py", text):
        assert os.path.exists(os.path.join(REPO, path)), path


def _dry_run(argv):
    """`benchmarks/erase_gpu.py argv` in a subprocess (it must exit 0); its summary rows."""
    import json
    import sys

    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "erase_gpu.py"), *argv],
                          env=env, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = argv[argv.index("--out") + 1]
    with open(out + ".json") as f:
        return json.load(f)["rows"]


def test_auto_cells_run_untimed_until_auto_has_chosen():
    """`"auto"` measures its first steps (26 on the H200, all inside the timed window there): its cells
    run untimed steps until it has chosen, bounded, so that the timed steps are its choice's."""
    from benchmarks import erase_gpu_plan as plan

    class Measuring:  # chooses after `steps` steps
        def __init__(self, steps):
            self.steps, self.ran = steps, 0

        @property
        def dispatch_choice(self):
            return "threaded" if self.ran >= self.steps else None

        def step(self):
            self.ran += 1

    for steps, want in ((0, 0), (26, 26), (1000, 2 * plan.AUTO_MEASURING_ESTIMATE)):
        model = Measuring(steps)
        assert plan.steps_until_chosen(model, model.step) == want == model.ran
    plain = Measuring(5)  # a `plain` cell's Keras model has no dispatch to wait for
    assert plan.steps_until_chosen(object(), plain.step) == 0 == plain.ran


@torch_only
def test_benchmark_arguments():
    from benchmarks import erase_gpu_plan as plan

    assert plan.parse_mode("threaded+graphs") == ("threaded", True)
    assert plan.parse_mode("standard") == ("standard", False)
    assert plan.parse_mode("auto+graphs") == ("auto", True)
    assert plan.parse_mode("plain+jit") == ("plain+jit", False)
    assert plan.parse_mode("inline_streams+graphs") == ("inline_streams", True)
    for bad in ("standard+graphs", "plain+graphs", "undetached", "fast", "threaded+compile"):
        with pytest.raises(ValueError):
            plan.parse_mode(bad)
    args = plan.build_parser().parse_args([])
    with pytest.raises(SystemExit, match="needs CUDA"):
        plan.resolve(args, cuda=False)
    args = plan.resolve(plan.build_parser().parse_args(["--cpu-dry-run"]), cuda=False)
    assert "streams" not in args.modes and "threaded+graphs" in args.modes
    assert args.out.startswith("/tmp/")
    args = plan.resolve(plan.build_parser().parse_args([]), cuda=True)
    assert {"streams+graphs", "threaded+graphs", "blocking+graphs", "streams"} <= set(args.modes)
    assert set(plan.BASELINES) <= set(args.modes)  # every table has the baselines a user has
    rows = [{"model": "ctr", "batch": 8, "mode": "threaded+graphs", "graphs_captured": 0,
             "graph_replays": 0, "graphs_disabled": False},
            {"model": "ctr", "batch": 8, "mode": "threaded", }]
    assert len(plan.graph_problems(rows)) == 1


@torch_only
@pytest.mark.slow
def test_benchmark_cpu_dry_run_goes_through_graphs(tmp_path):
    out = str(tmp_path / "erase_gpu")
    rows = _dry_run([
        "--cpu-dry-run", "--strict", "--models", "ctr", "mlp30", "--batches", "8",
        "--modes", "standard", "threaded+graphs", "auto", "plain", "--steps", "2", "--warmup", "4",
        "--out", out,
    ])
    graphed = [r for r in rows if r["mode"] == "threaded+graphs"]
    assert len(graphed) == 2
    for row in rows:  # one profiled step per cell: host time on the threads that ran it
        assert row["host_main_ms"] > 0 and row["gpu_busy_fraction"] is None  # no GPU here
        if row["mode"] != "auto":  # (auto's profiled step may be one of its trials)
            assert (row["host_worker_ms"] > 0) == (row["mode"] not in ("standard", "plain"))
    for row in graphed:  # the CTR towers (detach_input=False) and the MLP chain both capture
        assert row["graphs_captured"] == 6, row  # six blocks in both models
        assert row["graph_replays"] > 0 and not row["graphs_disabled"]
        assert row["p90"] >= row["p50"] > 0
    for row in rows:  # the hand-off: the CTR table's backward runs once per step
        assert row.get("upstream_backwards_per_step") == (1.0 if row["model"] == "ctr" else None)
    for row in (r for r in rows if r["mode"] == "auto"):  # on CPU: the standard step, unmeasured
        assert row["auto_choice"] == "standard", row
        assert row["auto_measuring_steps"] == row["auto_timed_measuring_steps"] == 0, row
    for suffix in (".md", ".json", "_trace_8.json", "_timeline_8.png"):
        assert os.path.getsize(out + suffix) > 0
    report = open(out + ".md").read()
    assert "fast end" in report and "auto_timed_measuring_steps" in report
    assert all(r["repeats"] == 2 for r in rows) and "Every planned cell ran" in report


@torch_only
@pytest.mark.slow
def test_benchmark_budget_stops_cleanly_and_still_writes_everything(tmp_path):
    out = str(tmp_path / "erase_gpu")
    rows = _dry_run(["--cpu-dry-run", "--strict", "--models", "mlp30", "--batches", "8",
                     "--modes", "standard", "blocking", "--steps", "2", "--warmup", "1",
                     "--budget", "0.001", "--out", out])
    assert rows == []  # the trace used the budget up: no group started
    for suffix in (".md", ".json", "_trace_8.json", "_timeline_8.png"):
        assert os.path.getsize(out + suffix) > 0
    report = open(out + ".md").read()
    assert "not run: mlp30 batch=8 (standard, blocking): needs ~" in report
    assert "(no cell ran)" in report


def test_the_device_plan_is_the_gpu_checks_cells_and_the_sweep_covers_batch_width_and_models():
    from benchmarks import erase_gpu_plan as plan

    args = plan.resolve(plan.build_parser().parse_args(["--plan", "device"]), cuda=True)
    groups = plan.priority_groups(args)
    assert [(m, b) for m, b, _ in groups] == [("ctr", 2048), ("ctr", 32768)] and not args.traces
    for _, _, modes in groups:  # the plain model, its whole-step graph, jit, detached, auto, best fixed
        assert modes == ["plain", "plain+graph", "plain+jit", "standard", "auto+graphs", "threaded+graphs"]
    assert args.repeats >= 5 and plan.DEVICE_PLAN_SECONDS <= 120
    sweep = plan.priority_groups(plan.resolve(plan.build_parser().parse_args(["--plan", "sweep"]),
                                              cuda=True))
    pairs = {(m, b) for m, b, _ in sweep}
    assert {("ctr", b) for b in (2048, 8192, 32768, 65536)} <= pairs
    assert {"ctr-w256", "ctr-w1024", "mlp30", "transformer"} <= {m for m, _ in pairs}
    assert all(set(plan.BASELINES) <= set(modes) and "auto+graphs" in modes for _, _, modes in sweep)
    assert plan.model_spec("ctr-w256") == ("ctr", 256)


def test_paired_ratios_are_taken_per_repeat_against_the_best_baseline():
    from benchmarks import erase_gpu_plan as plan

    def rows(mode, p90s):
        return [{"model": "ctr", "batch": 8, "mode": mode, "repeat": i, "p50": v, "p90": v,
                 "step_ms_p50": 1.0, "step_ms_p90": 1.0, "host_ms_p50": 1.0} for i, v in enumerate(p90s)]

    summary = plan.summarize(rows("plain", [100, 120, 110]) + rows("plain+jit", [130, 90, 140])
                                  + rows("standard", [90, 100, 95]) + rows("auto", [143, 99, 126]))
    auto = next(r for r in summary if r["mode"] == "auto")
    assert auto["best_baseline"] == "plain+jit"  # the highest median p90 (130 > 110 > 95)
    assert auto["p90_vs_best"] == pytest.approx(1.1)  # per repeat: 1.1, 1.1, 0.9
    assert auto["p90_vs_best_range"] == "0.900..1.100"
    assert auto["p90_vs_plain"] == pytest.approx(np.median([1.43, 99 / 120, 126 / 110]))


@torch_only
@pytest.mark.slow
def test_benchmark_device_plan_dry_run_reports_the_baselines_ne_and_the_headline(tmp_path):
    out = str(tmp_path / "erase_gpu")
    rows = _dry_run(["--cpu-dry-run", "--strict", "--plan", "device", "--out", out])
    modes = {r["mode"] for r in rows}
    assert {"plain", "standard", "auto+graphs", "threaded+graphs"} <= modes
    for row in rows:  # every cell against the best baseline, paired per repeat
        assert row["best_baseline"] in ("plain", "standard") and row["p90_vs_best_range"].count("..") == 1
    report = open(out + ".md").read()
    assert "Headline: `auto`" in report and "| ctr | plain | 16 |" in report  # NE of plain and detached
    # Keras's standard step does not capture whole on the stand-in: reported, not an error
    assert "plain+graph repeat 1: not feasible: Keras's standard step does not capture" in report


@torch_only
def test_benchmark_finds_block_overlaps_in_a_trace_and_auto_steps_in_the_window():
    from keras_erase.torch.auto import ScheduleSelector
    from benchmarks import erase_gpu_plan as plan
    from tools import gpu_trace

    ranges = [  # (row, block, phase, start, duration)
        ("stream 1", "a", "forward", 0.0, 10.0),
        ("stream 1", "a", "backward", 10.0, 30.0),
        ("stream 2", "b", "forward", 15.0, 10.0),  # during a's backward, another stream
        ("stream 2", "b", "backward", 25.0, 30.0),
        ("stream 2", "c", "forward", 60.0, 5.0),  # after every backward ended
    ]
    assert gpu_trace.overlaps(ranges) == [("a", "b")]
    assert gpu_trace.overlaps([r for r in ranges if r[1] != "b"]) == []
    selector = ScheduleSelector([("standard", 1), ("threaded", 1)], timed_rounds=1,
                                warmup_rounds=1)
    assert plan.auto_window(None, 10, 20) == (0, 0)
    assert plan.auto_window(selector, 10, 20) == (30, 20)  # undecided: all timed
    while not selector.done:
        schedule = selector.next_schedule()
        selector.record(schedule, 0.1 if schedule[0] == "standard" else 0.2)
    assert plan.auto_window(selector, 1, 20) == (selector.steps, selector.steps - 1)
    assert plan.auto_window(selector, 10, 20) == (selector.steps, 0)


def _synthetic_cuda_trace():
    """A profiler trace of two blocks as CUDA shows it: block a's backward kernels come from
    autograd's device thread (tid 99), not the annotating main thread (tid 1); the GPU lags."""
    events, correlation = [], [0]

    def scope(name, start, end, tid=1):
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "tid": tid,
                       "ts": start, "dur": end - start})

    def kernel(launch_ts, tid, stream, start, end, api="cuda_runtime"):
        correlation[0] += 1
        name = "cudaLaunchKernel" if api == "cuda_runtime" else "cuLaunchKernel"
        events.append({"ph": "X", "cat": api, "name": name, "tid": tid,
                       "ts": launch_ts, "dur": 1, "args": {"correlation": correlation[0]}})
        events.append({"ph": "X", "cat": "kernel", "name": "gemm", "tid": stream, "ts": start,
                       "dur": end - start, "args": {"correlation": correlation[0], "stream": stream}})

    scope("a/forward", 0, 10)
    kernel(2, 1, 7, 5, 12)
    scope("a/backward", 10, 40)  # inline launch: the main thread waits in autograd.backward
    kernel(11, 1, 7, 14, 15)  # the one kernel the GPU annotation would hold
    for i in range(4):
        kernel(12 + 6 * i, 99, 7, 16 + 12 * i, 27 + 12 * i)  # autograd's device thread
    kernel(37, 99, 7, 63, 70, api="cuda_driver")  # a Triton kernel: launched through the driver
    scope("b/forward", 40, 50)
    kernel(41, 1, 8, 45, 55)  # on b's stream while a's backward still runs on the GPU
    kernel(60, 1, 0, 90, 91)  # main-loss work outside every block: not a block's
    # what the profiler's GPU annotation keeps of a's backward: its own thread's kernel
    events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "a/backward", "tid": 7,
                   "ts": 14, "dur": 1})
    return events


@torch_only
def test_overlap_is_found_from_kernels_whose_backward_launches_come_from_another_thread(tmp_path):
    import json

    from tools import gpu_trace

    events = _synthetic_cuda_trace()
    ranges = gpu_trace.device_block_ranges(events)
    assert ranges == [
        ("stream 7", "a", "backward", 14.0, 56.0),  # 14 .. 70: every backward kernel, the
        ("stream 7", "a", "forward", 5.0, 7.0),     # driver-launched one included
        ("stream 8", "b", "forward", 45.0, 10.0),
    ]
    assert gpu_trace.overlaps(ranges) == [("a", "b")]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert gpu_trace.overlaps(gpu_trace.block_ranges(gpu_trace.load_events(str(path)))) == [("a", "b")]
    # the GPU user annotation alone holds one kernel: no overlap would ever be found
    annotated = [("stream 7", "a", "backward", 14.0, 1.0), ("stream 8", "b", "forward", 45.0, 10.0)]
    assert gpu_trace.overlaps(annotated) == []


def test_step_measures_from_a_synthetic_cuda_trace():
    from tools import gpu_trace

    events = _synthetic_cuda_trace()
    events.append({"ph": "X", "cat": "user_annotation", "name": gpu_trace.STEP, "tid": 1,
                   "ts": 0, "dur": 100})
    for tid, start, end in ((1, 0, 9), (1, 40, 49), (3, 11, 30), (99, 12, 40)):  # host work
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": tid, "ts": start,
                       "dur": end - start})
    events.append({"ph": "X", "cat": "user_annotation", "name": "a/backward", "tid": 3, "ts": 11,
                   "dur": 19})  # the worker's scope of a's backward
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "tid": 1,
                   "ts": 60, "dur": 40})  # a wait, not host work
    metrics = gpu_trace.step_metrics(events)
    # kernels: stream 7 at 5-12, 14-15, 16-63 (four, 1 us gaps), 63-70; stream 8 at 45-55;
    # stream 0 at 90-91
    assert metrics["step_ms"] == pytest.approx(0.1)
    busy = 7 + 1 + 4 * 11 + 1 + 7 + 1  # stream 8's 45-55 also covers stream 7's 51-52 gap
    assert metrics["gpu_busy_ms"] == pytest.approx(busy / 1e3)
    assert metrics["gpu_busy_fraction"] == pytest.approx(busy / 100)
    assert metrics["overlapped_fraction"] == pytest.approx((55 - 45 - 1) / busy)  # 51-52 gap
    assert metrics["streams"] == 3 and metrics["kernels"] == 9
    host = metrics["host_ms"]  # the launches count as host work of their thread
    assert host["main"] == pytest.approx(0.018 + 0.002)
    assert host["worker"] == pytest.approx(0.019)
    assert host["autograd"] == pytest.approx(0.028)


def test_the_middle_batch_is_where_gpu_time_meets_host_time():
    from benchmarks.erase_gpu_plan import choose_middle

    # host 30 ms at both ends; GPU 3 ms at 2048, 60 ms at 65536: equal near 33 000
    assert choose_middle((2048, 30.0, 3.0), (65536, 30.0, 60.0)) == 32768
    assert choose_middle((2048, 30.0, 1.0), (65536, 40.0, 20.0)) == 32768  # host-bound: closest
    assert choose_middle((2048, 30.0, 0.0), (65536, 30.0, 0.0)) == 16384  # no GPU: the middle
    assert choose_middle((16, 5.0, 0.0), (64, 9.0, 0.0)) == 32


def test_the_budget_runs_whole_groups_most_informative_first(monkeypatch):
    """Every cell of a group that starts gets its repeats; a group that does not fit is skipped."""
    from benchmarks import erase_gpu_plan as plan

    clock = [0.0]
    monkeypatch.setattr(plan.time, "monotonic", lambda: clock[0])
    cost = {2048: 2.0, 16384: 3.0, 65536: 5.0}

    def fake_cell(model_name, mode, batch, profile_path=None):
        clock[0] += cost[batch] * (0.5 if model_name == "mlp30" else 1.0)
        return {"model": model_name, "batch": batch, "mode": mode, "profiled": bool(profile_path),
                "p50": 1.0, "p90": 1.0, "host_ms_p50": 1.0}

    args = plan.resolve(plan.build_parser().parse_args(["--repeats", "3"]), cuda=True)
    args.batches, args.middle = [2048, 16384, 65536], 16384
    args.modes = ["standard"] + list(plan.SCHEDULE_MODES)  # 7 a group (the default order)
    traces = {b: {"build_s": 0.0, "step_s": cost[b] / (args.warmup + args.steps)} for b in cost}
    budget = plan.Budget(230.0)
    rows, skipped, errors = plan.run_cells(args, budget, traces, fake_cell, lambda: None)
    done = {}
    for r in rows:
        done.setdefault((r["model"], r["batch"]), []).append(r["mode"])
    # ctr at the middle batch (21 cells, 63 s) and at 65536 (105 s) leave 62 s: mlp30 at the
    # middle (estimated from the ctr trace: 79 s) does not fit, ctr at 2048 (52 s est.) does
    assert list(done) == [("ctr", 16384), ("ctr", 65536), ("ctr", 2048)]
    assert all(len(modes) == 3 * len(args.modes) for modes in done.values())  # every repeat
    assert sum(r["profiled"] for r in rows) == len(done) * len(args.modes)  # first repeat only
    assert skipped[0].startswith("mlp30 batch=16384") and "needs ~79 s, 62 s left" in skipped[0]
    assert len(skipped) == 4 and not errors  # mlp30 at 65536 and 2048, the extra modes


# -- EraseModel(cuda_graphs=True) in every mode, CPU stand-in capture ---------------------------


def _mlp_model(mode, graphs, detach_input=True, **kwargs):
    from keras_erase import DetachBlock, EraseModel

    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    upstream = keras.layers.Dense(6, name="upstream")(inputs)
    h = upstream
    for b in range(3):
        h = DetachBlock(
            keras.Sequential([keras.layers.Dense(8, "relu"), keras.layers.Dense(6)]),
            head=keras.layers.Dense(1),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            detach_input=detach_input,
            name=f"block_{b}",
        )(h)
    outputs = keras.layers.Dense(1, "sigmoid")(h)
    model = EraseModel(inputs, outputs, dispatch=mode, cuda_graphs=graphs, **kwargs)
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    return model


@torch_only
@pytest.mark.parametrize("mode", ["blocking", "threaded"])
@pytest.mark.parametrize("detach_input", [True, False])
def test_erase_model_with_cuda_graphs_trains_like_eager(mode, detach_input):
    """End to end: `fit` with graphs in each CPU mode gives the eager weights and logs."""
    from keras_erase.torch.cuda_graphs import runner as graph_runner

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6)).astype("float32")
    y = (rng.random((48, 1)) < 0.4).astype("float32")
    eager = _mlp_model(mode, False, detach_input)
    eager_history = eager.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    with stand_in_captures() as captures:
        graphed = _mlp_model(mode, True, detach_input)
        history = graphed.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    runners = [r for r in graph_runner.live_runners() if r._capture in captures]
    assert len(runners) == 1
    runner = runners[0]
    assert not runner.disabled, runner.disabled_reason
    assert runner.captures == 3  # one graph pair per block
    assert runner.replays == runner.backward_replays == 3 * (12 - 2)  # 12 steps, 2 eager warm-up
    for a, b in zip(graphed.get_weights(), eager.get_weights()):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-5, atol=1e-6)
    for key in eager_history:
        np.testing.assert_allclose(history[key], eager_history[key], rtol=1e-5, err_msg=key)


@torch_only
def test_targets_move_to_the_device_once_per_step_not_per_block(monkeypatch):
    """The torch step moves y/sample_weight once; every block gets that same tensor."""
    from keras_erase.torch import train_step
    from keras_erase.torch.schedules.base import ScheduleRun

    calls, seen = [], []
    real_to_device = train_step.to_device

    def spy(structure, device):
        moved = real_to_device(structure, device)
        calls.append(moved)
        return moved

    real_run_block = ScheduleRun.run_block

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        seen.append(y_true)
        return real_run_block(self, block, inputs, y_true, sample_weight, scale_loss)

    monkeypatch.setattr(train_step, "to_device", spy)
    monkeypatch.setattr(ScheduleRun, "run_block", run_block)
    model = _mlp_model("blocking", False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = (rng.random((16, 1)) < 0.4).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(calls) == 2 and len(seen) == 6  # 2 steps, 3 blocks
    for step in range(2):
        assert all(t is calls[step][0] for t in seen[3 * step : 3 * step + 3])


@torch_only
def test_auto_with_graphs_never_times_warm_up_or_capture_steps(auto_measures, monkeypatch):
    """`dispatch="auto"` + graphs: the graph warm-up and capture steps are untimed."""
    from keras_erase.torch import auto as auto_schedule
    from keras_erase.torch.cuda_graphs import capture as graph_capture
    from keras_erase.torch.cuda_graphs import runner as graph_runner

    monkeypatch.setattr(auto_schedule, "auto_candidates",  # few enough to time in 14 steps
                        lambda graphs=False: ["standard", "threaded", "threaded+graphs"])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * 14, 6)).astype("float32")
    y = (rng.random((8 * 14, 1)) < 0.4).astype("float32")
    previous = graph_capture.set_default_capture(graph_capture.RecordingCapture)
    try:
        model = _mlp_model("auto", True, auto_steps=2)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    finally:
        graph_capture.set_default_capture(previous)
    selector = model._erase.selector
    graphed = [c for c in selector.candidates if c.endswith("+graphs")]
    assert graphed, selector.candidates
    for candidate in graphed:
        # one auto warm-up round + the graph warm-up steps + the capture step
        assert selector.warmup[candidate] == graph_runner.untimed_steps(graph_runner.DEFAULT_WARMUP)
        assert len(selector.times[candidate]) == selector.seen[candidate] - selector.warmup[candidate]
    runner = model._erase.schedule_runs[Schedule.from_name(graphed[0])].graphs
    assert runner.captures == 3 and not runner.disabled
