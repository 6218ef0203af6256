"""`CutSoftmaxLoss`'s loss path vs dense Keras softmax CE on CPU, this checkout against `--before DIR`.

Each round runs `cutbce_cpu.py --softmax-cell time` (dense and the
`CutSoftmaxLoss` path alternating in one process) once in each checkout,
the checkouts alternating; the table gives medians (min-max) over all the
rounds' calls and each call's ratio over its own process's dense call.

    git archive BASE | tar -x -C /tmp/before
    python benchmarks/softmax_cpu_before_after.py --before /tmp/before --backends torch,tensorflow
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import fmt_spread, machine_info, run_checkouts, spread, write_results  # noqa: E402
from benchmarks.cutbce_cpu import _thread_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the checkout to compare with")
    parser.add_argument("--backends", default="torch,tensorflow")
    parser.add_argument("--shapes", default="4096,64,32768", help="M,D,V shapes separated by ';'")
    parser.add_argument("--rounds", type=int, default=3, help="processes per checkout")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each cell per process")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cutsoftmax_cpu_before_after"))
    args = parser.parse_args()
    info = machine_info(threads=args.threads, before=os.path.abspath(args.before))
    lines = ["| backend | M, D, V | checkout | dense CPU s | `CutSoftmaxLoss` path CPU s | CPU / dense "
             "(per call) | dense wall s | path wall s |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for backend in args.backends.split(","):
        env = _thread_env(dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3"), int(args.threads))
        for shape in args.shapes.split(";"):
            argv = ["benchmarks/cutbce_cpu.py", "--shape", shape, "--threads", args.threads, "--softmax-cell",
                    "time", "--repeats", str(args.repeats), "--variants", "dense,cut_loss"]
            runs = run_checkouts(argv, args.before, args.rounds, env)
            for label in ("before", "after"):
                samples = {(name, key): [] for name in ("dense", "cut_loss") for key in ("cpu_s", "times_s")}
                ratios = []
                for run in runs[label]:
                    cells = run["cells"]
                    for (name, key), values in samples.items():
                        values.extend(cells[name][key])
                    ratios.extend(c / d for c, d in zip(cells["cut_loss"]["cpu_s"], cells["dense"]["cpu_s"]))
                stats = {f"{name} {key}": spread(values) for (name, key), values in samples.items()}
                stats["ratio cpu"] = spread(ratios)
                rows.append({"backend": backend, "shape": shape, "checkout": label, **stats,
                             "loadavg": [run["loadavg"] for run in runs[label]]})
                lines.append(f"| {backend} | {shape.replace(',', ', ')} | {label} | "
                             f"{fmt_spread(stats['dense cpu_s'])} | {fmt_spread(stats['cut_loss cpu_s'])} | "
                             f"{fmt_spread(stats['ratio cpu'])} | {fmt_spread(stats['dense times_s'])} | "
                             f"{fmt_spread(stats['cut_loss times_s'])} |")
                print(lines[-1], flush=True)
    info["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    what = (f"Softmax cross-entropy, one target id a position, float32, CPU, loss plus the gradients of hidden, "
            f"table and bias: dense Keras (`sparse_categorical_crossentropy` of a matmul's logits) and the "
            f"`CutSoftmaxLoss` path (`loss_sum`, `implementation=\"auto\"`: the chunked loop on CPU). Per "
            f"backend and shape {args.rounds} rounds, each one fresh process per checkout (before, after, "
            f"alternating) timing both cells alternating, {args.repeats} calls each after a warm-up; seconds "
            f"of one call, median (min-max) over all calls; CPU / dense: each call's CPU seconds over the same "
            f"round's dense call. Threads: {args.threads}. CPU time is the figure: other jobs load the machine "
            f"(load averages in the JSON, per process).")
    write_results(args.out, "CutSoftmaxLoss on CPU, before and after", what, None, info, "\n".join(lines),
                  {"rows": rows})


if __name__ == "__main__":
    main()
