"""Per-device memory of a CutBCE train step with the item table sharded 8 ways vs replicated.

On 8 devices (8 simulated CPU devices unless real accelerators are present:
`XLA_FLAGS=--xla_force_host_platform_device_count=8` is set for the child process), compiles
`jit(value_and_grad)` of the summed CutBCE loss w.r.t. hidden states, table and bias, for:

- `replicated`: data parallel, rows split 8 ways, the table and its gradient on every device (the plain
  chunked kernel; XLA all-reduces the gradient);
- `sharded`: the table split 8 ways along V (`P("model", None)`), the vocab-sharded path
  (`keras_cutbce.backends.jax.sharded`);
- `gspmd`: the same sharded table through the single-device chunked kernel, left to XLA's automatic
  partitioner (what happens without the sharded path).

Memory comes from the compiled executable's `memory_analysis()` (per device: the SPMD program is the
per-device program): arguments, outputs (the gradients), temporaries, and their sum as the peak bound; plus
the table and table-gradient bytes one device holds, from the shardings. (`memory_stats()` of CPU devices is
None, so nothing is executed: only compiled.)

Usage:
    python benchmarks/sharded_memory.py            # writes benchmarks/results/sharded_memory.{md,json}
    python benchmarks/sharded_memory.py --quick    # one small shape
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import RESULTS, emit_row, machine_info, markdown_table, run_cell, write_results  # noqa: E402

SHAPES = [(4096, 64, 1 << 20), (8192, 128, 1 << 21)]  # (rows M, dim D, vocab V)
QUICK_SHAPES = [(512, 32, 1 << 14)]
VARIANTS = ("replicated", "sharded", "gspmd")
MIB = 1 << 20


def _measure(rows, dim, vocab, variant):
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

    args = (
        arg((rows, dim), jnp.float32, row_spec),
        arg((vocab, dim), jnp.float32, table_spec),
        arg((vocab,), jnp.float32, bias_spec),
        arg((rows, 8), jnp.int32, row_spec),
    )
    step = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2)))
    compiled = step.lower(*args).compile()
    stats = compiled.memory_analysis()
    out_shardings = compiled.output_shardings
    grad_table_sharding = jax.tree.leaves(out_shardings)[2]
    table_bytes = 4 * dim * NamedSharding(mesh, table_spec).shard_shape((vocab, dim))[0]
    grad_rows = grad_table_sharding.shard_shape((vocab, dim))[0]
    result = {
        "rows": rows, "dim": dim, "vocab": vocab, "variant": variant,
        "devices": len(devices), "platform": devices[0].platform,
        "table_bytes_per_device": table_bytes,
        "grad_table_bytes_per_device": 4 * dim * grad_rows,
        "argument_bytes": stats.argument_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
    }
    peak = getattr(stats, "peak_memory_in_bytes", None)
    result["peak_bound_bytes"] = (
        result["argument_bytes"] + result["output_bytes"] + result["temp_bytes"]
        - result["alias_bytes"]
    )
    result["xla_peak_bytes"] = peak
    memory = devices[0].memory_stats()
    result["device_memory_stats"] = None if memory is None else dict(memory)
    return result


def _run_child(rows, dim, vocab, variant):
    env = dict(os.environ, KERAS_BACKEND="jax")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    try:
        return run_cell([os.path.abspath(__file__), "--child", str(rows), str(dim), str(vocab), variant], env)
    except RuntimeError as error:
        return {"rows": rows, "dim": dim, "vocab": vocab, "variant": variant,
                "error": str(error).strip().splitlines()[-1][:200]}


COLUMNS = {"rows": "M", "dim": "D", "vocab": "V", "variant": "variant", "table_bytes_per_device": "table / device",
           "grad_table_bytes_per_device": "table grad / device", "argument_bytes": "arguments",
           "output_bytes": "outputs", "temp_bytes": "temporaries", "peak_bound_bytes": "peak bound",
           "xla_peak_bytes": "XLA peak", "error": "error"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape")
    parser.add_argument("--out", default=os.path.join(RESULTS, "sharded_memory"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
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
    write_results(args.out, "CutBCE per-device memory: table sharded 8 ways vs replicated", what, None,
                  machine_info(), markdown_table(lines, columns, [COLUMNS[c] for c in columns]), {"rows": results})


if __name__ == "__main__":
    main()
