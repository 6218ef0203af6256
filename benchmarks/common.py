"""The benchmarks' harness: alternating cells, medians with spread, the machine line, markdown + JSON.

Every benchmark script times its cells with `alternate` (one call of each
cell per round, round 0 a warm-up, so load on a shared machine hits every
cell alike), summarises with `spread` (median, min, max), writes its table
with `write_results` (a header naming the command that reproduces it and
the machine line: platform, CPUs, threads, load average, the checkout's
commit) and compares two checkouts with `--before DIR` through
`run_checkouts` (the same command in each checkout, alternating) instead of
code that knows commits.

Throughput convention (the ERASE paper's, defined once in `keras_erase.throughput`):
`p50` and `p90` are the 50th and 90th percentiles of per-step examples per second
(`batch / step seconds` for each timed step). `p90` is therefore the *fast* end: 90%
of the steps are slower. Step-time percentiles (`step_ms_p50`, `step_ms_p90`, the
latency view, where p90 is the slow end) are reported next to them. For a
data-parallel run, per-step global times come from
`keras_erase.throughput.global_step_seconds` (the slowest rank of each step);
per-rank percentiles are never summed. `QPS_NOTE` says this in one line for tables.

Example:

```python
print(markdown_table([{"mode": "standard", "p50": 5.1e4, "p90": 5.3e4}], ["mode", "p50", "p90"]))
print(spread([0.3, 0.1, 0.2]))
```
"""

import gc
import json
import os
import platform
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from tools.spread import fmt_spread, spread  # noqa: E402,F401 - every script's, from here


QPS_NOTE = (
    "p50/p90 = 50th/90th percentile of per-step examples/s after warm-up (p90 is the fast "
    "end, as in the ERASE paper); step_ms_p50/p90 = step-time percentiles (p90 = slow end)."
)


def rss_bytes(key):
    """The process's `VmRSS` / `VmHWM` (peak) ... from `/proc/self/status`, in bytes (0 if absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    """Resets the process's peak RSS (`VmHWM`) to its current RSS (Linux `/proc/self/clear_refs`)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def percentile(samples, q):
    """The `q`-th percentile (0-100) of `samples` (linear interpolation)."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


def _fmt(value):
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def markdown_table(rows, columns, headers=None):
    """A GitHub markdown table of `rows` (dicts) restricted to `columns`."""
    headers = headers or columns
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def commit(root=_REPO):
    """The checkout's short commit, with `+dirty` when it has uncommitted changes ("" if not a git checkout)."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on this machine
            return ""

    sha = git("rev-parse", "--short", "HEAD")
    return sha + ("+dirty" if sha and git("status", "--porcelain", "--untracked-files=no") else "")


def machine_info(**extra):
    """The machine line's fields: platform, Python, CPUs, load average, the checkout's commit, the time."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
        "commit": commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    info.update(extra)
    return info


def machine_line(info):
    """`machine_info` (with e.g. `threads=`) as one markdown line."""
    return "Machine: " + "; ".join(
        f"{k} {', '.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in info.items()
    ) + "."


def set_threads(backend, threads):
    """Sets the backend's thread counts in this process (None: leave the defaults).

    Returns the intra-op thread count the backend uses (None where it
    cannot tell).
    """
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


def alternate(cells, repeats, block=lambda result: result, warmups=1, clock=None):
    """Times `cells` (name -> zero-argument callable) alternating: one call of each per round.

    The first `warmups` rounds warm up (compilation; round 0's seconds are
    kept as `first_s`). Returns name -> `{"wall": spread, "cpu": spread,
    "times_s", "first_s"}`; `block(result)` waits for an asynchronous result;
    `clock()` starts a timer and returns its stop (default: wall seconds;
    `cuda_clock`: CUDA events).
    """
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


def paired(timed, name, base):
    """`spread` of the per-round ratios `name / base` of an `alternate` result (same rounds, so paired)."""
    return spread([a / b for a, b in zip(timed[name]["times_s"], timed[base]["times_s"])])


def run_cell(argv, root=_REPO, env=None):
    """Runs `python argv...` in a fresh process importing the checkout at `root`; returns its `ROW <json>` line.

    The script runs from `root` (the same relative path in that checkout).
    """
    env = dict(os.environ if env is None else env, PYTHONPATH=os.path.abspath(root))
    done = subprocess.run([sys.executable, *argv], env=env, cwd=os.path.abspath(root),
                          capture_output=True, text=True, check=False)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"{root}: {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(rows[-1])


def run_checkouts(argv, before, rounds, env=None):
    """The same command in this checkout and in `before` (a folder), alternating for `rounds` rounds.

    Returns `{"before": [rows], "after": [rows]}` (`run_cell` rows), the
    before/after comparison every script offers with `--before DIR`.
    """
    roots = {"before": before, "after": _REPO}
    out = {label: [] for label in roots}
    for _ in range(rounds):
        for label, root in roots.items():
            out[label].append(run_cell(argv, root, env))
    return out


def parse_repos(items):
    """`--repos NAME=PATH ...` as `{name: path}` (e.g. `before=/tmp/old after=.`)."""
    return dict(item.split("=", 1) for item in items)


def run_repos(repos, cells, reps, run):
    """Every cell in every checkout of `repos`, `reps` rounds; returns the rows `run(path, cell)` gives.

    The cells rotate each round and the checkouts alternate which goes first,
    so a passing load hits every (checkout, cell) alike. Each row gets `repo`
    (the checkout's name) and `rep`; a `None` row is skipped.
    """
    rows, names = [], list(repos)
    for rep in range(reps):
        shift = rep % len(cells)
        for index, cell in enumerate(cells[shift:] + cells[:shift]):
            for name in names if (rep + index) % 2 == 0 else names[::-1]:
                row = run(repos[name], cell)
                print(name, cell, json.dumps(row, default=str), flush=True)
                if row is not None:
                    rows.append(dict(row, repo=name, rep=rep))
    return rows


def command_line():
    """This process's command as a user reruns it (the backend, the script relative to the repository)."""
    import shlex

    backend = os.environ.get("KERAS_BACKEND")
    argv = [os.path.relpath(os.path.abspath(sys.argv[0]), _REPO), *sys.argv[1:]]
    return (f"KERAS_BACKEND={backend} " if backend else "") + "python " + shlex.join(argv)


def emit_row(row):
    """Prints a cell's result as the `ROW <json>` line `run_cell` reads."""
    print("ROW " + json.dumps(row, default=str), flush=True)


def write_results(prefix, title, what, command, info, table, payload):
    """Writes `prefix.md` (title, what each figure is, the command, the machine line, the table) and `prefix.json`.

    `command`: the one command that reproduces the table (`None`: this process's, `command_line()`).
    """
    command = command or command_line()
    write_text(prefix + ".md", f"# {title}\n\n{what}\n\nCommand: `{command}`\n\n{machine_line(info)}\n\n{table}\n")
    write_json(prefix + ".json", {"title": title, "command": command, "machine": info, **payload})


def write_json(path, payload):
    """Writes `payload` as indented JSON, creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False, default=str)
        f.write("\n")


def write_text(path, text):
    """Writes `text` (a markdown report), creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
