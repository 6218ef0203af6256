"""The benchmarks' harness: every script times, summarises and writes its table through these (docs/benchmarks.md).

Timing: `alternate` (each cell once per round, round 0 a warm-up), `spread`, `paired_ratios` / `paired` (a
ratio per repeat, never of medians), `qps`, `step_clock`; memory: `peak_extra_mb`; processes: `run_cell` /
`emit_row`, `run_capped`; devices: `cuda_sync`, `release_memory`, `Budget`; writing: `write_results`.
Results describe today's code: history lives in git and the CHANGELOG, never in a result's name.
"""

import gc
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
if REPO not in sys.path:
    sys.path.insert(0, REPO)

QPS_NOTE = (
    "p50/p90 = 50th/90th percentile of per-step examples/s after warm-up (p90 is the fast "
    "end, as in the ERASE paper); step_ms_p50/p90 = step-time percentiles (p90 = slow end)."
)


def spread(samples):
    """`{"median", "min", "max", "n"}` of `samples` (seconds, bytes, ratios ...)."""
    samples = [float(x) for x in samples]
    return {"median": float(np.median(samples)), "min": min(samples), "max": max(samples), "n": len(samples)}


def fmt_spread(stats, scale=1.0, digits=3):
    """`median (min-max)` of a `spread` dict, each value times `scale`."""
    m, lo, hi = (f"{v:,.0f}" if abs(v) >= 10**digits else f"{v:.{digits}g}"
                 for v in (stats[k] * scale for k in ("median", "min", "max")))
    return f"{m} ({lo}-{hi})"


def paired_ratios(rows, key, over, value, pair_by="rep"):
    """`spread` of `row[value] / other[value]` per repeat, `other` the row of the same `pair_by` with `over`
    (`(field, name)`, e.g. `("mode", "standard")`); rows without a partner are left out (None: none has one)."""
    field, name = over
    base = {r[pair_by]: r for r in rows if r.get(field) == name}
    ratios = [r[value] / base[r[pair_by]][value] for r in rows
              if r.get(field) == key and r[pair_by] in base and base[r[pair_by]][value]]
    return spread(ratios) if ratios else None


def qps(step_seconds, batch):
    """p50 / p90 examples/s and p50 / p90 step ms of the timed steps (`keras_erase.throughput`)."""
    from keras_erase.throughput import throughput_percentiles

    out = {k: float(v) for k, v in throughput_percentiles(step_seconds, batch).items()}
    ms = np.asarray(step_seconds, np.float64) * 1e3
    return dict(out, step_ms_p50=float(np.percentile(ms, 50)), step_ms_p90=float(np.percentile(ms, 90)))


def rss_bytes(key="VmRSS"):
    """The process's `VmRSS` / `VmHWM` (peak) ... from `/proc/self/status`, in bytes (0 if absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_extra_mb(call, base=None):
    """`(call's result, MB)`: the peak RSS during `call()` (the peak reset first) above `base` bytes
    (default: the RSS before the call; e.g. the RSS once a cell's inputs exist, before its warm-up)."""
    base = rss_bytes("VmRSS") if base is None else base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = call()
    return result, (rss_bytes("VmHWM") - base) / 2**20


def alternate(cells, repeats, block=lambda result: result, warmups=1, clock=None):
    """Times `cells` (name -> zero-argument callable) alternating, one call of each per round, the first
    `warmups` rounds untimed (round 0's seconds: `first_s`): name -> `{"wall": spread, "cpu": spread (the
    process's, all threads), "times_s", "cpu_s", "first_s"}`. `block(result)` waits for an asynchronous
    result; `clock()` starts a timer and returns its stop (default: wall seconds; `cuda_clock`)."""
    out = {name: {"times_s": [], "cpu_s": []} for name in cells}
    for round_ in range(repeats + warmups):
        for name, call in cells.items():
            gc.collect()
            cpu, stop = time.process_time(), (clock or _wall_clock)()
            block(call())
            wall, cpu = stop(), time.process_time() - cpu
            if round_ == 0:
                out[name]["first_s"] = wall
            if round_ >= warmups:
                out[name]["times_s"].append(wall)
                out[name]["cpu_s"].append(cpu)
    for entry in out.values():
        entry["wall"], entry["cpu"] = spread(entry["times_s"]), spread(entry["cpu_s"])
    return out


def _wall_clock():
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def cuda_clock():
    """An `alternate` clock of CUDA events on the current stream: device seconds from start to stop."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()

    def stop():
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return stop


def cuda_sync(cuda=True):
    """`torch.cuda.synchronize()` where `cuda` (the device finished: a clock may be read), else nothing."""
    if cuda:
        import torch

        torch.cuda.synchronize()


def release_memory(cuda):
    """Between cells: the cyclic collector (a model's worker thread, graphs), then the CUDA cache where `cuda`."""
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


class Budget:
    """Wall-clock budget of a run (`None`: unlimited): whether work expected to take `seconds` still fits, and
    named sections within it: `report["sections"][name]` holds each one's rows; one whose estimate does not
    fit what is left is listed in `report["skipped"]`, one that raises in `report["errors"]`."""

    def __init__(self, seconds, release=lambda: None):
        self.start, self.seconds = time.monotonic(), seconds
        self.report = {"sections": {}, "skipped": [], "errors": []}
        self.release = release  # between sections (`release_memory`)

    def elapsed(self):
        return time.monotonic() - self.start

    def left(self):
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def fits(self, seconds):
        return seconds <= self.left()

    def section(self, name, estimate_s, fn):
        """Runs `fn()` if `estimate_s` fits (None: always); returns its rows (None when skipped or failed)."""
        if estimate_s is not None and not self.fits(estimate_s):
            self.report["skipped"].append(f"{name}: needs ~{estimate_s:.0f} s, {max(self.left(), 0):.0f} s left")
            return None
        start = time.perf_counter()
        try:
            self.report["sections"][name] = fn()
        except Exception as error:  # noqa: BLE001 - listed; the next section runs
            self.report["errors"].append(f"{name}: {type(error).__name__}: {str(error)[:300]}")
        print(f"{name} took {time.perf_counter() - start:.1f} s", flush=True)
        self.release()
        return self.report["sections"].get(name)


def step_clock():
    """A Keras callback recording `(CPU s, wall s)` at each training step's begin (`.starts`) and end (`.ends`:
    its logs are read as numbers, so the step has finished) and at the epoch's begin and end (`.epoch`)."""
    import keras

    def mark(marks):
        return lambda *_, **__: marks.append((time.process_time(), time.perf_counter()))

    starts, ends, epoch = [], [], []
    return keras.callbacks.LambdaCallback(
        on_epoch_begin=mark(epoch), on_epoch_end=mark(epoch), on_train_batch_begin=mark(starts),
        on_train_batch_end=mark(ends), starts=starts, ends=ends, epoch=epoch)


def paired(timed, name, base):
    """`spread` of the per-round ratios `name / base` of an `alternate` result (same rounds, so paired)."""
    return spread([a / b for a, b in zip(timed[name]["times_s"], timed[base]["times_s"])])


def _fmt(value):
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def markdown_table(rows, columns, headers=None):
    """A GitHub markdown table of `rows` (dicts) restricted to `columns`."""
    lines = ["| " + " | ".join(headers or columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def commit():
    """This checkout's short commit, with `+dirty` when it has uncommitted changes ("" without git)."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    sha = git("rev-parse", "--short", "HEAD")
    return sha + ("+dirty" if sha and git("status", "--porcelain", "--untracked-files=no") else "")


def machine_info(**extra):
    """The machine line's fields: platform, Python, CPUs, load average, the checkout's commit, the time."""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "loadavg": [round(v, 2) for v in os.getloadavg()], "commit": commit(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}


def machine_line(info):
    """`machine_info` (with e.g. `threads=`) as one markdown line."""
    return "Machine: " + "; ".join(
        f"{k} {', '.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in info.items()) + "."


def set_threads(backend, threads):
    """Sets the backend's thread counts in this process (None: its defaults); returns torch's count."""
    if backend == "torch":
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        return torch.get_num_threads()
    if backend == "tensorflow" and threads is not None:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    return threads


def thread_env(env, threads):
    """`env` with XLA's CPU client pinned to `threads` (it reads the flags once; None: its default)."""
    env = dict(env)
    if threads:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + f" --xla_cpu_multi_thread_eigen={'false' if threads == 1 else 'true'}"
                            f" intra_op_parallelism_threads={threads}").strip()
    return env


def run_cell(argv, env=None):
    """Runs `python argv...` in a fresh process importing this checkout; returns its last `ROW <json>`."""
    env = dict(os.environ if env is None else env, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, *argv], env=env, cwd=REPO, capture_output=True, text=True)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(rows[-1])


def emit_row(row):
    """Prints a cell's result as the `ROW <json>` line `run_cell` reads."""
    print("ROW " + json.dumps(row, default=str), flush=True)


MEMORY_WORDS = ("out of memory", "memory allocating", "resource_exhausted", "cannot allocate",
                "can't allocate", "bad_alloc", "memoryerror", "failed to allocate")


def run_capped(command, cap_gib, timeout, env=None):
    """Runs `command` from the repository under an address-space cap: `{"status", "wall_seconds"[, "error"]}`,
    `status` "ok", "out of memory (cap N GiB)" (a memory error line, or killed), "timed out" or "failed (exit N)"."""
    cap = int(cap_gib * 2**30)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    except subprocess.TimeoutExpired:
        return {"status": f"timed out (> {timeout} s)", "wall_seconds": time.perf_counter() - start}
    row = {"status": "ok", "wall_seconds": time.perf_counter() - start}
    if done.returncode == 0:
        return row
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        hits = [line.lower().find(w) for w in MEMORY_WORDS if w in line.lower()]
        if hits:
            first = max(0, min(hits) - 120)
            return dict(row, status=f"out of memory (cap {cap_gib:g} GiB)", error=line[first:first + 300].strip())
    if done.returncode == -9:
        return dict(row, status=f"out of memory (cap {cap_gib:g} GiB, killed)", error="SIGKILL")
    return dict(row, status=f"failed (exit {done.returncode})",
                error=(lines[-1] if lines else f"exit code {done.returncode}")[-300:].strip())


def command_line():
    """This process's command as a user reruns it (the backend, the script relative to the repository)."""
    backend = os.environ.get("KERAS_BACKEND")
    argv = [os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]]
    return (f"KERAS_BACKEND={backend} " if backend else "") + "python " + shlex.join(argv)


def write_results(prefix, title, what, command, info, table, payload):
    """Writes `prefix.md` (title, what each figure is, the `command` that reproduces it (None: this process's),
    the machine line, the table) and `prefix.json`."""
    command = command or command_line()
    write_text(prefix + ".md", f"# {title}\n\n{what}\n\nCommand: `{command}`\n\n{machine_line(info)}\n\n{table}\n")
    write_json(prefix + ".json", {"title": title, "command": command, "machine": info, **payload})
    print(f"{title}\n\n{table}\n\nwrote {prefix}.md and {prefix}.json", flush=True)


def read_json(path):
    """The JSON in `path`."""
    with open(path) as f:
        return json.load(f)


def write_json(path, payload):
    """Writes `payload` as indented JSON, creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")


def write_text(path, text):
    """Writes `text` (a markdown report), creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
