"""JAX's chunked loss path before/after a change: peak extra memory and wall time against dense BCE.

The loss path is `keras_cutbce.ops.weighted_loss_sum` (what `CutBCELoss`
runs in `fit`), forward + gradients of the hidden states, table and bias,
`implementation="chunked"`, float32, on CPU. Two figures, each for this
checkout and for `--old-root` (an older checkout, e.g. `git worktree add
/tmp/old HEAD~1`):

- memory at `--memory-shape` (default (1024, 128, 262144), where the table
  gradient alone is 128 MiB): the peak RSS of the timed runs above the RSS
  once the inputs exist, measured by `benchmarks/cutbce_cpu.py --worker`
  of each checkout in its own subprocess (`/proc/self/clear_refs` resets
  the peak after the warm-up), `--memory-runs` subprocesses per checkout,
  alternating, median;
- speed at `--speed-shape` (default (4096, 64, 32768)): wall time at the
  default thread count, dense Keras BCE, this checkout's loss path and the
  old checkout's chunked kernel alternating in one process
  (`benchmarks/cutbce_cpu.py --side-by-side`), median of `--repeats`; the
  ratio over dense BCE is the figure (absolute seconds move with the
  machine's load).

Usage:
    python benchmarks/cutbce_jax_loss_path.py --old-root /tmp/old

Writes `benchmarks/results/cutbce_jax_loss_path.{md,json}` (or `--out PREFIX`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker_memory(root, shape, repeats):
    """Peak extra MB of one `cutbce_loss` worker of the checkout at `root`."""
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=root)
    script = os.path.join(root, "benchmarks", "cutbce_cpu.py")
    cmd = [sys.executable, script, "--worker", "--variant", "cutbce_loss",
           "--shape", ",".join(map(str, shape)), "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _side_by_side(old_root, shape, repeats, out):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "cutbce_cpu.py"), "--side-by-side",
           "--backends", "jax", "--shapes", ",".join(map(str, shape)), "--repeats", str(repeats),
           "--out", out]
    if old_root:
        cmd += ["--old-root", old_root]
    subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    with open(out + "_side_by_side.json") as f:
        return json.load(f)["backends"]["jax"]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-root", help="an older checkout measured beside this one")
    parser.add_argument("--old-label", default="", help="what the older checkout is (e.g. a commit)")
    parser.add_argument("--memory-shape", default="1024,128,262144")
    parser.add_argument("--speed-shape", default="4096,64,32768")
    parser.add_argument("--memory-runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "cutbce_jax_loss_path"))
    args = parser.parse_args()
    memory_shape = tuple(int(x) for x in args.memory_shape.split(","))
    speed_shape = tuple(int(x) for x in args.speed_shape.split(","))
    roots = {"after": ROOT}
    if args.old_root:
        roots = {"before": os.path.abspath(args.old_root), "after": ROOT}
    memory = {name: [] for name in roots}
    for _ in range(args.memory_runs):
        for name, root in roots.items():
            memory[name].append(_worker_memory(root, memory_shape, 2)["peak_extra_mb"])
            print(name, "memory", memory[name][-1], flush=True)
    speed = _side_by_side(args.old_root, speed_shape, args.repeats, args.out)
    wall = speed["median_s"]
    ratios = {"after": wall["loss"] / wall["dense"]}
    if "loss_old" in wall:
        ratios["before"] = wall["loss_old"] / wall["dense"]
    results = {"memory_shape": memory_shape, "speed_shape": speed_shape, "roots": roots,
               "peak_extra_mb": memory, "side_by_side": speed, "wall_ratio": ratios,
               "loadavg": os.getloadavg()}
    m, d, v = memory_shape
    lines = [
        "| checkout | peak extra MB at "
        f"({m}, {d}, {v}) (median of {args.memory_runs}) | runs | loss path / dense BCE, wall "
        f"at {speed_shape} |",
        "|---|---:|---|---:|",
    ]
    for name in roots:
        runs = ", ".join(f"{x:.0f}" for x in memory[name])
        ratio = ratios.get(name)
        lines.append(f"| {name} | {statistics.median(memory[name]):.0f} | {runs} | "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} |")
    table = "\n".join(lines)
    print(table)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# JAX chunked loss path: memory and speed, before and after\n\n"
                f"`weighted_loss_sum` (what `fit` runs), forward + gradients of h, E, b, float32, "
                f"CPU, {os.cpu_count()} cores, default threads. Memory: peak RSS of the timed runs "
                "above the inputs, one subprocess per run. Speed: dense Keras BCE and the loss "
                f"paths alternating in one process, medians of {args.repeats}; seconds in "
                f"`{os.path.basename(args.out)}_side_by_side.md`. "
                + (f"Before: {args.old_label}. " if args.old_label else "")
                + "Load average at the end: "
                f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared machine).\n\n"
                f"Command: `python benchmarks/cutbce_jax_loss_path.py"
                f"{' --old-root ' + args.old_root if args.old_root else ''}"
                f"{' --memory-runs ' + str(args.memory_runs) if args.memory_runs != 3 else ''}`"
                f"\n\n{table}\n")


if __name__ == "__main__":
    main()
