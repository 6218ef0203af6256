"""Small generic helpers for the benchmark scripts: step timing statistics, markdown
tables and JSON output. Nothing here knows about a particular model.

Throughput convention: `p50` is `batch / median(step seconds)` and `p90` is
`batch / 90th percentile(step seconds)`, i.e. the examples per second that 90% of
the steps reach or beat (the tail-latency view used for "p90 QPS").

Example:

```python
stats = throughput_stats([0.010, 0.011, 0.012], batch_size=512)
print(markdown_table([{"mode": "standard", **stats}], ["mode", "p50", "p90"]))
```
"""

import json
import os
import platform
import time

import numpy as np


def percentile(samples, q):
    """The `q`-th percentile (0-100) of `samples` (linear interpolation)."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


def throughput_stats(step_seconds, batch_size):
    """p50/p90 examples per second and step-time percentiles for a list of step times."""
    step_seconds = [float(s) for s in step_seconds]
    p50_s, p90_s = percentile(step_seconds, 50), percentile(step_seconds, 90)
    return {
        "steps": len(step_seconds),
        "step_ms_p50": 1e3 * p50_s,
        "step_ms_p90": 1e3 * p90_s,
        "p50": batch_size / p50_s,
        "p90": batch_size / p90_s,
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
