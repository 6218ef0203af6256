"""The main job: both examples on their built-in data, tables printed.

`python -m examples.run_all [--backend torch]` runs, each in its own process
(so that each run's peak memory is its own):

1. SASRec with `CutBCELoss` (`--loss cutbce`) on the synthetic catalogue;
2. the same SASRec with dense full-logits BCE (`--loss dense`), same seed;
3. the CTR model in every ERASE mode available here (`--compare`),

then prints the SASRec table (cutbce vs dense vs most popular) and the CTR
table (QPS gain and NE gap against the undetached baseline). Results are
written under `--out` (default `runs/`). Extra arguments after `--` go to
both examples (e.g. `-- --epochs 1`).

Example:

```
python -m examples.run_all --backend torch
```
"""

import argparse
import json
import os
import subprocess
import sys
import time


def _run(module, args, env):
    command = [sys.executable, "-m", module, *args]
    print("$ " + " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True)
    return time.perf_counter() - start


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m examples.run_all", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["jax", "torch", "tensorflow"],
                        help="Keras backend (default: $KERAS_BACKEND, else torch)")
    parser.add_argument("--out", default="runs", help="folder for the JSON results and the plot")
    parser.add_argument("--sasrec-args", default="", help="extra arguments for examples.sasrec")
    parser.add_argument("--ctr-args", default="", help="extra arguments for examples.ctr")
    parser.add_argument("--verbose", type=int, default=1, help="fit's verbosity in both examples")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    env["KERAS_BACKEND"] = args.backend or env.get("KERAS_BACKEND") or "torch"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    os.makedirs(args.out, exist_ok=True)
    verbose = ["--verbose", str(args.verbose)]
    sasrec_extra = args.sasrec_args.split()
    ctr_extra = args.ctr_args.split()
    seconds = {}
    sasrec = {}
    for loss in ("cutbce", "dense"):
        path = os.path.join(args.out, f"sasrec_{loss}.json")
        seconds[f"sasrec {loss}"] = _run(
            "examples.sasrec", ["--loss", loss, "--json", path, *verbose, *sasrec_extra], env
        )
        with open(path) as f:
            sasrec[loss] = json.load(f)
    ctr_json = os.path.join(args.out, "ctr_compare.json")
    plot = os.path.join(args.out, "ctr_ne.png")
    seconds["ctr compare"] = _run(
        "examples.ctr",
        ["--compare", "--json", ctr_json, "--plot", plot, *verbose, *ctr_extra],
        env,
    )
    with open(ctr_json) as f:
        ctr = json.load(f)

    from examples.sasrec.tables import sasrec_table

    print()
    print(f"## SASRec, next-8 items, leave-last-8-out (backend {env['KERAS_BACKEND']}, "
          f"{sasrec['cutbce']['num_items']} items, {sasrec['cutbce']['num_users']} users)")
    print(sasrec_table(sasrec))
    print()
    print(f"## CTR with ERASE (backend {env['KERAS_BACKEND']}); NE per step: {plot}")
    print(ctr["table"])
    print()
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
          + f", total {sum(seconds.values()):.0f} s")
    return {"sasrec": sasrec, "ctr": ctr, "seconds": seconds}


if __name__ == "__main__":
    main()
