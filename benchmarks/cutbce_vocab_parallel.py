"""Per-rank memory and step time of a CutBCE train step with the table split over R gloo ranks (torch, CPU).

Each rank holds `ItemEmbedding(V, D, vocab_parallel=True)`'s rows and runs
steps of `mean(cut_binary_crossentropy)` over its `M / R` of the global `M`
positions, its backward and a Keras Adam update of its rows. Per rank:
`table MiB` = its rows' bytes (`ceil(V / R) * D * 4`); `Adam MiB` = its
optimizer slots; `peak over start MiB` = the process's peak RSS (`VmHWM`)
during the steps minus its RSS after building everything but the first
step's buffers (what the step itself adds: gathered positions, tiles,
gradients); `peak MiB` = the peak RSS (with torch and Keras loaded). Step
time: median (min-max) of the timed steps after one warm-up, the slowest
rank's (R = 1, 2 only: the machine has 2 cores).

Usage:
    python benchmarks/cutbce_vocab_parallel.py            # V = 10^6, D = 64, M = 256: writes results/cutbce_vocab_parallel.{md,json}
    python benchmarks/cutbce_vocab_parallel.py --quick    # V = 10^4
"""

import argparse
import os
import time

from common import fmt_spread, machine_info, markdown_table, peak_extra_mb, rss_bytes, spread
from common import write_results

MIB = 1 << 20


def _rank(rank, world, vocab, dim, rows, steps):
    import keras
    import numpy as np
    import torch

    from keras_cutbce import ItemEmbedding, cut_binary_crossentropy

    items = ItemEmbedding(vocab, dim, vocab_parallel=True)
    items.build()
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build([items.embeddings])
    rng = np.random.default_rng(rank)
    hidden = torch.tensor(rng.normal(size=(rows // world, dim)).astype("float32"))
    ids = torch.tensor(rng.integers(0, vocab, size=(rows // world, 8)).astype("int32"))

    def steps_timed():
        times = []
        for _ in range(steps + 1):
            began = time.perf_counter()
            loss = cut_binary_crossentropy(hidden, items, ids).mean()
            (grad,) = torch.autograd.grad(loss, [items.embeddings.value])
            optimizer.apply([grad / world], [items.embeddings])
            torch.distributed.barrier()
            times.append(time.perf_counter() - began)
        return times

    times, extra_mb = peak_extra_mb(steps_timed)
    slots = sum(int(np.prod(v.shape)) * 4 for v in optimizer.variables if len(v.shape) == 2)
    return {"table": items.embeddings.value.numel() * 4, "adam": slots, "extra_mb": extra_mb,
            "peak": rss_bytes("VmHWM"), "times": times[1:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from keras_erase.torch.launch import run_local

    vocab, dim, rows = (10**4 if args.quick else 10**6), 64, 256
    table, payload = [], []
    for world in (1, 2, 4):
        steps = args.steps if world <= 2 else 1
        ranks = run_local(_rank, world, args=(vocab, dim, rows, steps), threads_per_rank=1,
                          timeout_s=1800)
        slowest = [max(r["times"][i] for r in ranks) for i in range(steps)]
        row = {
            "R": world,
            "table MiB": max(r["table"] for r in ranks) / MIB,
            "Adam MiB": max(r["adam"] for r in ranks) / MIB,
            "peak over start MiB": max(r["extra_mb"] for r in ranks),
            "peak MiB": max(r["peak"] for r in ranks) / MIB,
            "step s": fmt_spread(spread(slowest)) if world <= 2 else "-",
        }
        table.append(row)
        payload.append({**row, "step_s": spread(slowest) if world <= 2 else None, "per_rank": ranks})
        print(row, flush=True)
    what = __doc__.split("\n\n")[1] + f"\n\nV = {vocab}, D = {dim}, M = {rows} positions (8 targets each)."
    here = os.path.dirname(os.path.abspath(__file__))
    write_results(os.path.join(here, "results", "cutbce_vocab_parallel" + ("_quick" if args.quick else "")),
                  "CutBCE with the table split over torch.distributed ranks (gloo, CPU)", what, None,
                  machine_info(threads=1), markdown_table(table, list(table[0])), {"rows": payload})


if __name__ == "__main__":
    main()
