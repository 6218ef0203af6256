"""The vocabulary tile of CutBCE on torch CPU: time and memory of one training step per tile.

For every shape (M rows, V items; D and L fixed), one process times the loss
path `CutBCELoss` runs (`weighted_loss_sum`, forward + the gradients of h, E
and b) at every tile width of the sweep, side by side: each round runs every
tile once, in turn, after one warm-up round; the table gives medians over the
rounds with their range. Figures per tile:

- wall s: seconds of one step (what a user waits for);
- CPU s: the process's CPU seconds in that step, all threads together (the
  steadier figure on a shared machine, and the unit of the tile rule's target);
- peak MB: one step's peak RSS above the RSS once the inputs exist, in a
  fresh process per tile (`/proc/self/clear_refs` resets the peak): the
  gradients (the `[V, D]` table's among them) and the tile's buffers. (In
  the timing process freed buffers are reused by the next tile, so its
  peaks would not tell the tiles apart.)

The tiles swept are powers of two from 1024 to 65536 (`--tiles`; none whose
four float32 `[M, tile]` buffers would pass 2 GiB) plus the two default
rules: `old default` (the rule before: a 128 MiB budget for four float32
`[M, tile]` buffers, at most 8192 items) and `default` (this checkout's
`keras_cutbce.math.tiling` rule on torch CPU).

Usage:
    python benchmarks/cutbce_torch_tile.py --vocab 100000  # 3 M x 9 tiles (about 40 min, 2 cores)
    python benchmarks/cutbce_torch_tile.py --quick         # a small grid, to check it runs
    python benchmarks/cutbce_torch_tile.py --rows 160,1280 --vocab 1000000 --tiles 32768
        --repeats 2 --out benchmarks/results/cutbce_torch_tile_1m  # 10^6 items (about 15 min)

Writes `benchmarks/results/cutbce_torch_tile.{md,json}` (or `--out PREFIX`).
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_info, markdown_table, reset_peak_rss, rss_bytes  # noqa: E402
from benchmarks.common import write_json, write_text  # noqa: E402

ROWS = (160, 1280, 5120)  # batch 8, 64, 256 x 20 positions
VOCABS = (100_000, 1_000_000)
TILES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
OLD_BUDGET_BYTES, OLD_MAX_TILE = 128 * 2**20, 8192
MAX_BUFFER_BYTES = 2 * 2**30  # tiles whose four [M, tile] float32 buffers pass this are skipped


def old_default(rows, vocab):
    """The torch CPU tile rule before this benchmark: 128 MiB / (16 B x M), in [128, 8192]."""
    tile = (OLD_BUDGET_BYTES // (16 * rows)) // 128 * 128
    return min(min(max(tile, 128), OLD_MAX_TILE), -(-vocab // 128) * 128)


def _step_fn(rows, dim, vocab, labels, seed=0):
    """Returns `step(tile)`: one forward + backward of `weighted_loss_sum` at that tile."""
    import numpy as np
    import torch

    from keras_cutbce.ops import weighted_loss_sum

    rng = np.random.default_rng(seed)
    hidden = torch.tensor((rng.normal(size=(rows, dim)) / np.sqrt(dim)).astype("float32"))
    table = torch.tensor(rng.normal(size=(vocab, dim)).astype("float32") * 0.1)
    bias = torch.tensor((rng.normal(size=(vocab,)) * 0.1).astype("float32"))
    ids = torch.tensor(rng.integers(-1, vocab, size=(rows, labels)).astype("int32"))
    weights = torch.full((rows,), 1.0 / rows)

    def step(tile):
        h, t, b = (x.detach().requires_grad_(True) for x in (hidden, table, bias))
        loss = weighted_loss_sum(h, t, ids, weights, b, chunk_size=tile, implementation="chunked")
        grads = torch.autograd.grad(loss, (h, t, b))
        del grads, loss

    return step


def peak_mb(rows, vocab, dim, labels, tile):
    """One step's peak RSS above the inputs, in MB, measured in a fresh process."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--cell", *map(str, (rows, vocab, dim, labels,
                                                                            tile))],
        capture_output=True, text=True, check=False,
        env=dict(os.environ, KERAS_BACKEND="torch"),
    )
    found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not found:
        raise RuntimeError(f"memory cell {rows, vocab, tile} failed:\n{done.stderr[-2000:]}")
    return json.loads(found[-1])["peak_mb"]


def _cell(rows, vocab, dim, labels, tile):
    import json

    step = _step_fn(rows, dim, vocab, labels)
    base = rss_bytes("VmRSS")
    reset_peak_rss()
    step(tile)
    print("ROW " + json.dumps({"peak_mb": (rss_bytes("VmHWM") - base) / 2**20}), flush=True)


def measure(rows, vocab, dim, labels, tiles, repeats):
    """Returns one row per tile: medians and ranges of wall s, CPU s and peak MB."""
    import gc

    from keras_cutbce.math.tiling import default_chunk_size
    from keras_cutbce.math.tiling import max_tile
    from keras_cutbce.math.tiling import tile_budget_bytes

    step = _step_fn(rows, dim, vocab, labels)
    budget = tile_budget_bytes("torch", "cpu", table_bytes=4 * vocab * dim)
    new_default = default_chunk_size(rows, vocab, budget, max_tile("torch", "cpu"))
    chosen = {tile: [] for tile in tiles}
    chosen.setdefault(old_default(rows, vocab), []).append("old default")
    chosen.setdefault(new_default, []).append("default")
    order = sorted(chosen)
    samples = {tile: {"wall": [], "cpu": []} for tile in order}
    for round_ in range(repeats + 1):
        for tile in order:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            step(tile)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if round_:  # round 0 warms up
                samples[tile]["wall"].append(wall)
                samples[tile]["cpu"].append(cpu)
            print(f"M={rows} V={vocab} tile={tile} wall={wall:.2f}s cpu={cpu:.2f}s", flush=True)
    out = []
    for tile in order:
        s = samples[tile]
        out.append({
            "rows": rows, "vocab": vocab, "tile": tile, "rule": ", ".join(chosen[tile]),
            "wall_s": statistics.median(s["wall"]), "wall_min": min(s["wall"]),
            "wall_max": max(s["wall"]), "cpu_s": statistics.median(s["cpu"]),
            "cpu_min": min(s["cpu"]), "cpu_max": max(s["cpu"]),
            "peak_mb": peak_mb(rows, vocab, dim, labels, tile),
        })
    reference = next(r for r in out if "old default" in r["rule"])
    for row in out:
        row["cpu_vs_old_default"] = row["cpu_s"] / reference["cpu_s"]
        row["wall_vs_old_default"] = row["wall_s"] / reference["wall_s"]
    return out


def _report(rows, args, load_start, load_end, threads):
    lines = [
        f"# CutBCE on torch CPU: the vocabulary tile, D = {args.dim}, L = {args.labels}, float32",
        "",
        "One training step of the loss path (`weighted_loss_sum`, what `CutBCELoss` runs: "
        "forward + gradients of h, E, b) per tile, every tile once per round, "
        f"{args.repeats} rounds after a warm-up round, one process per run; medians, with the "
        "range over the rounds. wall s = seconds of one step; CPU s = the process's CPU "
        "seconds in it (all threads); peak MB = one step's peak RSS above the inputs, in a fresh "
        "process per tile (the gradients, the table's among them, and the tile's buffers). "
        "Ratios are over the old default's median (the rule before: a 128 MiB budget, at most "
        "8192 items); `default` is this checkout's rule. "
        f"torch threads: {threads} (torch's default on this machine, as users run it). "
        f"Load average (1, 5, 15 min) at start {load_start}, at end {load_end} "
        "(a shared 2-core machine: other jobs ran beside it, CPU s is the steadier figure).",
        "",
        f"Command: `python benchmarks/cutbce_torch_tile.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
    ]
    for row in rows:
        row["wall"] = f"{row['wall_s']:.2f} ({row['wall_min']:.2f}-{row['wall_max']:.2f})"
        row["cpu"] = f"{row['cpu_s']:.2f} ({row['cpu_min']:.2f}-{row['cpu_max']:.2f})"
    columns = ["rows", "vocab", "tile", "rule", "wall", "cpu", "cpu_vs_old_default",
               "wall_vs_old_default", "peak_mb"]
    headers = ["M", "V", "tile", "rule", "wall s (range)", "CPU s (range)",
               "CPU / old default", "wall / old default", "peak MB"]
    lines.append(markdown_table(rows, columns, headers))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--vocab", default=",".join(map(str, VOCABS)))
    parser.add_argument("--tiles", default=",".join(map(str, TILES)))
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--labels", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="rows 160, V 20000, 1 round")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "cutbce_torch_tile"))
    parser.add_argument("--cell", nargs=5, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        return _cell(*args.cell)
    if args.quick:
        args.rows, args.vocab, args.tiles, args.repeats = "160", "20000", "1024,8192", 1
    import torch

    threads = torch.get_num_threads()
    load_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    for num_rows in map(int, args.rows.split(",")):
        for vocab in map(int, args.vocab.split(",")):
            tiles = [t for t in map(int, args.tiles.split(","))
                     if t <= -(-vocab // 128) * 128 and 16 * num_rows * t <= MAX_BUFFER_BYTES]
            rows += measure(num_rows, vocab, args.dim, args.labels, tiles, args.repeats)
    load_end = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    report = _report(rows, args, load_start, load_end, threads)
    write_text(args.out + ".md", report)
    write_json(args.out + ".json", {"machine": machine_info(torch_threads=threads,
                                                            load_start=load_start,
                                                            load_end=load_end),
                                    "args": vars(args), "rows": rows})
    print(report)


if __name__ == "__main__":
    main()
