"""The vocabulary tile of CutBCE on torch CPU: one training step per `--tiles` width and the tile rule's
(`default`), alternating; peak RSS in a fresh process per tile (docs/benchmarks.md).

    python benchmarks/cutbce_torch_tile.py --vocab 100000      # results/cutbce_torch_tile.{md,json}
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import RESULTS, alternate, emit_row, fmt_spread, machine_info, markdown_table  # noqa: E402
from benchmarks.common import peak_extra_mb, run_cell, write_results  # noqa: E402
from keras_cutbce.math.tiling import default_chunk_size, max_tile, tile_budget_bytes  # noqa: E402
from keras_cutbce.ops import weighted_loss_sum  # noqa: E402

ROWS = (160, 1280, 5120)  # batch 8, 64, 256 x 20 positions
VOCABS = (100_000, 1_000_000)
TILES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
MAX_BUFFER_BYTES = 2 * 2**30  # tiles whose four [M, tile] float32 buffers pass this are skipped


def _step_fn(rows, dim, vocab, labels, seed=0):
    """Returns `step(tile)`: one forward + backward of `weighted_loss_sum` at that tile."""
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


def measure(rows, vocab, dim, labels, tiles, repeats):
    """Returns one row per tile: wall s, CPU s (spreads) and peak MB."""
    step = _step_fn(rows, dim, vocab, labels)
    default = default_chunk_size(rows, vocab, tile_budget_bytes("torch", "cpu", table_bytes=4 * vocab * dim),
                                 max_tile("torch", "cpu"))
    timed = alternate({tile: (lambda tile=tile: step(tile)) for tile in sorted({*tiles, default})}, repeats)
    out = []
    for tile, entry in timed.items():
        peak = run_cell([os.path.abspath(__file__), "--cell", *map(str, (rows, vocab, dim, labels, tile))],
                        dict(os.environ, KERAS_BACKEND="torch"))["peak_mb"]
        out.append({"rows": rows, "vocab": vocab, "tile": tile, "rule": "default" if tile == default else "",
                    "wall": entry["wall"], "cpu": entry["cpu"], "peak_mb": peak})
    for row in out:
        for key in ("wall", "cpu"):
            row[f"{key}_vs_default"] = row[key]["median"] / timed[default][key]["median"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--vocab", default=",".join(map(str, VOCABS)))
    parser.add_argument("--tiles", default=",".join(map(str, TILES)))
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--labels", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="rows 160, V 20000, 1 round")
    parser.add_argument("--out", default=os.path.join(RESULTS, "cutbce_torch_tile"))
    parser.add_argument("--cell", nargs=5, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:  # one step's peak in this fresh process
        rows, vocab, dim, labels, tile = args.cell
        step = _step_fn(rows, dim, vocab, labels)
        return emit_row({"peak_mb": peak_extra_mb(lambda: step(tile))[1]})
    if args.quick:
        args.rows, args.vocab, args.tiles, args.repeats = "160", "20000", "1024,8192", 1
    info = machine_info(threads=f"torch default ({torch.get_num_threads()})")
    rows = []
    for num_rows in map(int, args.rows.split(",")):
        for vocab in map(int, args.vocab.split(",")):
            tiles = [t for t in map(int, args.tiles.split(","))
                     if t <= -(-vocab // 128) * 128 and 16 * num_rows * t <= MAX_BUFFER_BYTES]
            rows += measure(num_rows, vocab, args.dim, args.labels, tiles, args.repeats)
    info["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    lines = [dict(r, wall=fmt_spread(r["wall"]), cpu=fmt_spread(r["cpu"])) for r in rows]
    what = (
        f"One training step of the loss path (`weighted_loss_sum`, what `CutBCELoss` runs: forward + gradients of "
        f"h, E, b) per tile, D = {args.dim}, L = {args.labels}, float32; every tile once per round, {args.repeats} "
        "rounds after a warm-up round, one process per shape; median (min-max) over the rounds. wall s = seconds of "
        "one step; CPU s = the process's CPU seconds in it (all threads); peak MB = one step's peak RSS above the "
        "inputs, in a fresh process per tile. Ratios are over the median of `default` (the tile rule's choice). "
        "torch's default threads, as users run it.")
    columns = ["rows", "vocab", "tile", "rule", "wall", "cpu", "cpu_vs_default", "wall_vs_default", "peak_mb"]
    write_results(args.out, "CutBCE on torch CPU: the vocabulary tile", what, None, info,
                  markdown_table(lines, columns, ["M", "V", "tile", "rule", "wall s", "CPU s", "CPU / default",
                                                  "wall / default", "peak MB"]), {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
