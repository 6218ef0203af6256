"""Nsight Compute's counters of the Triton kernels: where `ncu` is, and its CSV read per kernel and logit.

Used by `benchmarks/cutbce_triton_gpu.py` (the GPU check's Nsight section).
"""

import csv
import io
import shutil

NCU_METRICS = ("smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
               "sm__warps_active.avg.per_cycle_active",
               "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio")


def ncu_tool():
    """The Nsight Compute command line, if installed."""
    found = shutil.which("ncu")
    if found:
        return found
    import glob

    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")
                        + glob.glob("/usr/local/cuda*/bin/ncu"))
    return candidates[-1] if candidates else None


def parse_ncu_csv(text, logits):
    """Per kernel: warp instructions per logit, issue activity, warps per SM, top 3 stalls."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(table) < 2:
        raise ValueError(f"no ncu metrics in its output: {text[-500:]}")
    header, rows = table[0], table[1:]
    name_col = header.index("Kernel Name")

    def number(value):
        try:
            return float(value.replace(",", ""))
        except ValueError:
            return None

    found = []
    for row in rows:
        values = dict(zip(header, row))
        if not values.get("Kernel Name") or number(values.get("smsp__inst_executed.sum", "")) is None:
            continue  # the units row
        stalls = {k.split("issue_stalled_")[1].split("_per_issue")[0]: number(v)
                  for k, v in values.items() if "issue_stalled_" in k and number(v) is not None}
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:3]
        found.append(dict(
            kernel=row[name_col].split("(")[0],
            instructions_per_logit=number(values["smsp__inst_executed.sum"]) / logits,
            issue_active_pct=number(values["smsp__issue_active.avg.pct_of_peak_sustained_active"]),
            warps_per_sm=number(values["sm__warps_active.avg.per_cycle_active"]),
            top_stalls=", ".join(f"{k} {v:.2f}" for k, v in top),
        ))
    return found
