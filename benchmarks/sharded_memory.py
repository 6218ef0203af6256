"""Per-device memory of a CutBCE train step with the item table split: jax (default; `replicated`, `sharded`
and `gspmd` on 8 simulated devices, `memory_analysis()`) or `--torch` (1, 2, 4 gloo ranks, `TORCH_WHAT`).

    python benchmarks/sharded_memory.py [--quick]        # results/sharded_memory.{md,json}
    KERAS_BACKEND=torch python benchmarks/sharded_memory.py --torch [--quick]   # cutbce_vocab_parallel.*
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import RESULTS, emit_row, fmt_spread, machine_info, markdown_table, peak_extra_mb  # noqa: E402
from benchmarks.common import rss_bytes, run_cell, spread, write_results  # noqa: E402

SHAPES = [(4096, 64, 1 << 20), (8192, 128, 1 << 21)]  # (rows M, dim D, vocab V)
QUICK_SHAPES = [(512, 32, 1 << 14)]
VARIANTS = ("replicated", "sharded", "gspmd")
MIB = 1 << 20


def _measure(rows, dim, vocab, variant):
    """One variant's compiled per-device memory (the jax child process)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_cutbce.backends.jax import chunked, sharded

    devices = jax.devices()[:8]
    axis = "data" if variant == "replicated" else "model"
    mesh = jax.sharding.Mesh(devices, (axis,))
    table_spec = P() if variant == "replicated" else P("model", None)
    bias_spec = P() if variant == "replicated" else P("model")
    row_spec = P("data", None) if variant == "replicated" else P()
    spec = sharded.VocabSharding(mesh, ("model",))

    def objective(hidden, table, bias, ids):
        if variant == "sharded":
            loss = sharded.cut_bce(hidden, table, ids, bias, sharding=spec)
        else:
            loss = chunked.cut_bce(hidden, table, ids, bias)
        return jnp.sum(loss)

    def arg(shape, dtype, pspec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, pspec))

    args = (arg((rows, dim), jnp.float32, row_spec), arg((vocab, dim), jnp.float32, table_spec),
            arg((vocab,), jnp.float32, bias_spec), arg((rows, 8), jnp.int32, row_spec))
    compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2))).lower(*args).compile()
    stats = compiled.memory_analysis()
    grad_table_sharding = jax.tree.leaves(compiled.output_shardings)[2]
    sizes = {k: getattr(stats, f"{k}_size_in_bytes") for k in ("argument", "output", "temp", "alias")}
    memory = devices[0].memory_stats()
    return {"rows": rows, "dim": dim, "vocab": vocab, "variant": variant, "devices": len(devices),
            "platform": devices[0].platform,
            "table_bytes_per_device": 4 * dim * NamedSharding(mesh, table_spec).shard_shape((vocab, dim))[0],
            "grad_table_bytes_per_device": 4 * dim * grad_table_sharding.shard_shape((vocab, dim))[0],
            **{f"{k}_bytes": v for k, v in sizes.items()},
            "peak_bound_bytes": sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"],
            "xla_peak_bytes": getattr(stats, "peak_memory_in_bytes", None),
            "device_memory_stats": None if memory is None else dict(memory)}


def _run_child(rows, dim, vocab, variant):
    env = dict(os.environ, KERAS_BACKEND="jax")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    try:
        return run_cell([os.path.abspath(__file__), "--child", str(rows), str(dim), str(vocab), variant], env)
    except RuntimeError as error:
        return {"rows": rows, "dim": dim, "vocab": vocab, "variant": variant,
                "error": str(error).strip().splitlines()[-1][:200]}


TORCH_WHAT = (
    "Each rank holds `ItemEmbedding(V, D, vocab_parallel=True)`'s rows and runs steps of "
    "`mean(cut_binary_crossentropy)` over its `M / R` of the global `M` positions, its backward and a Keras Adam "
    "update of its rows. Per rank: `table MiB` = its rows' bytes (`ceil(V / R) * D * 4`); `Adam MiB` = its "
    "optimizer slots; `peak over start MiB` = the process's peak RSS (`VmHWM`) during the steps minus its RSS "
    "after building everything but the first step's buffers (what the step itself adds: gathered positions, "
    "tiles, gradients); `peak MiB` = the peak RSS (with torch and Keras loaded). Step time: median (min-max) of "
    "the timed steps after one warm-up, the slowest rank's (R = 1, 2 only: the machine has 2 cores).")


def _rank(rank, world, vocab, dim, rows, steps):
    """One gloo rank of `--torch`: its table and Adam bytes, the steps' peak RSS and step seconds."""
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


def torch_ranks(args):
    """`--torch`: R = 1, 2, 4 ranks (`keras_erase.torch.launch.run_local`), one row per R."""
    from keras_erase.torch.launch import run_local

    vocab, dim, rows = (10**4 if args.quick else 10**6), 64, 256
    table, payload = [], []
    for world in (1, 2, 4):
        steps = args.steps if world <= 2 else 1
        ranks = run_local(_rank, world, args=(vocab, dim, rows, steps), threads_per_rank=1, timeout_s=1800)
        slowest = [max(r["times"][i] for r in ranks) for i in range(steps)]
        row = {"R": world, "table MiB": max(r["table"] for r in ranks) / MIB,
               "Adam MiB": max(r["adam"] for r in ranks) / MIB,
               "peak over start MiB": max(r["extra_mb"] for r in ranks),
               "peak MiB": max(r["peak"] for r in ranks) / MIB,
               "step s": fmt_spread(spread(slowest)) if world <= 2 else "-"}
        table.append(row)
        payload.append({**row, "step_s": spread(slowest) if world <= 2 else None, "per_rank": ranks})
        print(row, flush=True)
    what = TORCH_WHAT + f"\n\nV = {vocab}, D = {dim}, M = {rows} positions (8 targets each)."
    write_results(args.out or os.path.join(RESULTS, "cutbce_vocab_parallel" + ("_quick" if args.quick else "")),
                  "CutBCE with the table split over torch.distributed ranks (gloo, CPU)", what, None,
                  machine_info(threads=1), markdown_table(table, list(table[0])), {"rows": payload})


COLUMNS = {"rows": "M", "dim": "D", "vocab": "V", "variant": "variant", "table_bytes_per_device": "table / device",
           "grad_table_bytes_per_device": "table grad / device", "argument_bytes": "arguments",
           "output_bytes": "outputs", "temp_bytes": "temporaries", "peak_bound_bytes": "peak bound",
           "xla_peak_bytes": "XLA peak", "error": "error"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape")
    parser.add_argument("--out", help="without extension (default: results/sharded_memory; --torch: "
                                      "results/cutbce_vocab_parallel)")
    parser.add_argument("--torch", action="store_true", help="the table over torch gloo ranks (R = 1, 2, 4)")
    parser.add_argument("--steps", type=int, default=3, help="--torch: timed steps")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch:
        return torch_ranks(args)
    if args.child:
        rows, dim, vocab, variant = args.child
        return emit_row(_measure(int(rows), int(dim), int(vocab), variant))
    results = [_run_child(*shape, variant) for shape in (QUICK_SHAPES if args.quick else SHAPES)
               for variant in VARIANTS]
    lines = [{k: (f"{v / MIB:,.1f}" if "bytes" in k and v is not None else v) for k, v in r.items()}
             for r in results]
    what = (
        "Per-device memory (MiB) of `jit(value_and_grad)` of CutBCE (loss, grads of hidden, table, bias) on 8 "
        "devices, from the compiled executable's `memory_analysis()`; peak bound = arguments + outputs + "
        "temporaries - aliased; XLA peak = `peak_memory_in_bytes` of the same analysis. Temporaries follow the "
        "tile rule (`keras_cutbce.math.tiling`, ~64 MiB of [rows, tile] intermediates), and with the table split "
        f"on V alone every device sees all M rows. Platform: {results[0].get('platform', '?')} "
        f"({results[0].get('devices', '?')} devices).")
    columns = [c for c in COLUMNS if any(c in r for r in results)]
    write_results(args.out or os.path.join(RESULTS, "sharded_memory"),
                  "CutBCE per-device memory: table sharded 8 ways vs replicated", what, None,
                  machine_info(), markdown_table(lines, columns, [COLUMNS[c] for c in columns]), {"rows": results})


if __name__ == "__main__":
    main()
