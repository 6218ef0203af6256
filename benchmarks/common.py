"""Small generic helpers for the benchmark scripts: step timing statistics, markdown
tables and JSON output. Nothing here knows about a particular model.

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
stats = throughput_stats([0.010, 0.011, 0.012], batch_size=512)
print(markdown_table([{"mode": "standard", **stats}], ["mode", "p50", "p90"]))
```
"""

import json
import os
import platform
import sys
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


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


def throughput_stats(step_seconds, batch_size):
    """p50/p90 of per-step examples/s (`keras_erase.throughput`) and step-time percentiles.

    Returns a dict with `steps`, `p50`, `p90` (examples/s; p90 = the fast end) and
    `step_ms_p50`, `step_ms_p90` (milliseconds; p90 = the slow end).
    """
    from keras_erase.throughput import throughput_percentiles  # (imports keras: only here)

    step_seconds = [float(s) for s in step_seconds]
    rates = throughput_percentiles(step_seconds, batch_size, percentiles=(50, 90))
    return {
        "steps": rates["steps"],
        "step_ms_p50": 1e3 * percentile(step_seconds, 50),
        "step_ms_p90": 1e3 * percentile(step_seconds, 90),
        "p50": rates["p50"],
        "p90": rates["p90"],
    }


def time_steps(step, warmup, steps, sync=None):
    """Calls `step()` `warmup` times, then returns the seconds of each of `steps` calls.

    `sync` (e.g. `torch.cuda.synchronize`) is called before each clock read.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        step()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return times


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


def machine_info(**extra):
    """A small description of the machine for result files."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    info.update(extra)
    return info


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


def run_checkout_cell(script, repo, cell_args):
    """Runs `python script --cell ...` in a fresh process that imports the checkout at `repo`.

    The cell prints its result as one `ROW <json>` line; returns it parsed.
    Used by the before/after benchmarks (`erase_handoff.py`, `erase_host_time.py`).
    """
    import subprocess

    command = [sys.executable, os.path.abspath(script), "--cell", *map(str, cell_args)]
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=os.path.abspath(repo))
    done = subprocess.run(command, env=env, cwd=os.path.abspath(repo), capture_output=True,
                          text=True, check=False)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"{repo} {cell_args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(rows[-1])
