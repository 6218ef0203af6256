"""The main job: both examples on their built-in data, tables printed.

`python -m examples.run_all [--backend torch]` runs, each in its own process
(so that each run's peak memory is its own):

1. SASRec with `CutBCELoss` (`--loss cutbce`) on the synthetic catalogue,
   7 epochs (`SASREC_EPOCHS`; the example's own default is 10);
2. the same SASRec with dense full-logits BCE (`--loss dense`), same seed;
3. the same SASRec with BCE on one sampled negative per target
   (`--loss sampled`, the original SASRec recipe), same seed;
   then the softmax users train as often: full-catalogue softmax
   cross-entropy through the dense logits (`--loss softmax`) and without
   them (`--loss cutsoftmax`, `CutSoftmaxLoss`), same seed (the same
   numbers, less memory);
4. the CTR model in every ERASE mode available here (`--compare`), with
   `erase-auto` (`EraseModel(dispatch="auto")`) on every backend: every mode
   in one process, timed alternating (`examples.ctr.compare`), and the
   baseline and detached models with `--ctr-seeds` seeds (default 3): NE and
   AUC as mean +- sd (the ERASE schedules have the detached gradients),

then prints the SASRec table (each loss vs most popular) and the CTR table
(QPS gain and NE gap against the undetached baseline). The JSON results and
the plot are written under `--out` (default: `runs/` at the repository root,
whatever the current directory); their paths are printed. Extra arguments go
to one example through `--sasrec-args` / `--ctr-args`, e.g.
`--sasrec-args "--epochs 1" --ctr-args "--num-examples 20000"`.

Example:

```
python -m examples.run_all --backend torch
python -m examples.run_all --out /tmp/runs --sasrec-args "--epochs 2"
```
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from examples import DEFAULT_OUTPUT_DIR, positive_int
from examples.sasrec.tables import run_name, sasrec_table

SASREC_RUNS = (("cutbce", []), ("dense", []), ("sampled", ["--num-negatives", "1"]),
               ("softmax", []), ("cutsoftmax", []))
# The main job's SASRec epochs (`--sasrec-args "--epochs N"` overrides): past the
# plateau the exact losses leave after epoch 5, 0.18-0.20 hit@8 above most popular
# (`--epochs 7` on torch: cutbce 0.585, cutsoftmax 0.602, most popular 0.405; cutbce
# at 10: 0.626), 30% less training than the example's 10 (issue 52: the main job
# under 5 minutes with setup on a quiet 2-core machine).
SASREC_EPOCHS = 7


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(module, args, env):
    """Runs one example in its own process: (wall seconds, user + sys CPU seconds)."""
    command = [sys.executable, "-m", module, *args]
    print("$ " + " ".join(command[1:]), flush=True)
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run(command, env=env, check=True)
    return time.perf_counter() - start, _children_cpu() - cpu


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m examples.run_all",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", choices=["jax", "torch", "tensorflow"],
                        help="Keras backend (None: $KERAS_BACKEND, else torch)")
    parser.add_argument("--out", default=DEFAULT_OUTPUT_DIR,
                        help="folder for the JSON results and the plot")
    parser.add_argument("--sasrec-args", default="", help="extra arguments for examples.sasrec")
    parser.add_argument("--ctr-args", default="", help="extra arguments for examples.ctr")
    parser.add_argument("--ctr-seeds", type=positive_int, default=3,
                        help="training seeds per CTR mode (NE and AUC as mean +- sd over them)")
    parser.add_argument("--verbose", type=int, choices=[0, 1, 2], default=None,
                        help="fit's verbosity in both examples (None: 1 on a terminal, "
                             "else 2, one line per epoch)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    env["KERAS_BACKEND"] = args.backend or env.get("KERAS_BACKEND") or "torch"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    print(f"[run_all] results go to {out}", flush=True)
    verbose = ["--verbose", str(args.verbose)] if args.verbose is not None else []
    sasrec_extra = args.sasrec_args.split()
    ctr_extra = args.ctr_args.split()
    seconds = {}
    sasrec = {}
    written = []
    for loss, loss_args in SASREC_RUNS:
        path = os.path.join(out, f"sasrec_{loss}.json")
        seconds[f"sasrec {loss}"] = _run(
            "examples.sasrec",
            ["--loss", loss, *loss_args, "--epochs", str(SASREC_EPOCHS), "--json", path, *verbose,
             *sasrec_extra], env,
        )
        with open(path) as f:
            result = json.load(f)
        sasrec[run_name(result)] = result
        written.append(path)
    ctr_json = os.path.join(out, "ctr_compare.json")
    plot = os.path.join(out, "ctr_ne.png")
    seconds["ctr compare"] = _run(
        "examples.ctr",
        ["--compare", "--seeds", str(args.ctr_seeds), "--json", ctr_json, "--plot", plot,
         *verbose, *ctr_extra],
        env,
    )
    with open(ctr_json) as f:
        ctr = json.load(f)
    written += [ctr_json, plot]

    first = next(iter(sasrec.values()))
    print()
    print(f"## SASRec, next-8 items, leave-last-8-out (backend {env['KERAS_BACKEND']}, "
          f"{first['num_items']} items, {first['num_users']} users, {first['epochs']} epochs)")
    print(sasrec_table(sasrec))
    print()
    print(f"## CTR with ERASE (backend {env['KERAS_BACKEND']}); NE per step: {plot}")
    print(ctr["table"])
    print()
    print("wall time (user + sys CPU): "
          + ", ".join(f"{k} {wall:.0f} s ({cpu:.0f} s)" for k, (wall, cpu) in seconds.items())
          + f", total {sum(w for w, _ in seconds.values()):.0f} s"
          + f" ({sum(c for _, c in seconds.values()):.0f} s)")
    print("written: " + ", ".join(written))
    return {"sasrec": sasrec, "ctr": ctr, "seconds": seconds, "written": written}


if __name__ == "__main__":
    main()
