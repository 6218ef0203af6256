"""Per-chip HBM of a CutBCE train step on TPU pods, the item table split along V.

Compiles (never runs) `jit(value_and_grad)` of the summed CutBCE loss w.r.t.
the hidden states and the item table, with the table placed
`P("model", None)` over every chip of a TPU topology and the rows
replicated, through the vocab-sharded path
(`keras_cutbce.backends.jax.sharded.cut_bce`). The real TPU compiler (libtpu:
Mosaic for the Pallas kernels, XLA:TPU for the rest) compiles for deviceless
TPU devices (`jax.experimental.topologies.get_topology_desc`), so this runs on
a CPU host with `jax[tpu]` installed; nothing executes, so there is no timing.

Kernels per shard (`--kernels`):

- `auto`: what the sharded path compiles for a TPU: the Pallas TPU kernels
  (the program must contain `tpu_custom_call`s and no host callback);
- `chunked`: the chunked XLA loop inside `shard_map` (the path before the
  Pallas kernels ran per shard).

Per chip, from the compiled executable's `memory_analysis()` (the SPMD
program is the per-chip program): arguments (hidden states, table shard,
ids), outputs (loss, hidden gradient, table-gradient shard), temporaries, and
`step = arguments + outputs + temporaries - aliased`. `with Adam` adds two
float32 moments of the table shard (what an optimizer keeps; derived, not
compiled). `HBM` is the chip's capacity (v5e 16 GiB, v6e 32 GiB per chip).

Usage:
    TPU_SKIP_MDS_QUERY=1 python tools/sharded_tpu.py         # writes results/sharded_tpu.{md,json}
    TPU_SKIP_MDS_QUERY=1 python tools/sharded_tpu.py --quick # one small compile
    TPU_SKIP_MDS_QUERY=1 python tools/sharded_tpu.py --family softmax --label-smoothing 0.1 \
        --out benchmarks/results/sharded_tpu_softmax                 # the softmax cross-entropy
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


TOPOLOGIES = ("v6e:2x2", "v6e:4x4", "v5e:4x8")
VOCABS = (10**7, 10**8)
DIMS = (64, 128)
ROWS = 4096
NUM_IDS = 8
HBM_GIB = {"v5e": 16, "v6e": 32}
GIB = 2**30
QUICK = dict(topologies=("v6e:2x2",), vocabs=(10**5,), dims=(64,), kernels=("auto",))


def libtpu_available():
    """True when `libtpu` (the TPU compiler, from `jax[tpu]`) is importable."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def topology_devices(name):
    """Deviceless TPU devices of a topology such as `"v6e:2x2"` (needs libtpu)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server here
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other compiles may hold libtpu
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=name).devices


def compile_sharded_step(devices, rows, dim, vocab, kernel="auto", dtype="float32", family="bce",
                         label_smoothing=0.0):
    """Compiles the loss-and-gradients step (`family`: `"bce"` or `"softmax"`) with the table split along V over `devices`.

    Returns:
        The `jax.stages.Compiled` executable.

    Example:

    ```python
    compiled = compile_sharded_step(topology_devices("v6e:2x2"), 4096, 64, 10**7)
    print(compiled.memory_analysis().temp_size_in_bytes)
    ```
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_cutbce.backends.jax import sharded

    mesh = Mesh(devices, ("model",))
    spec = sharded.VocabSharding(mesh, ("model",))

    loss = getattr(sharded, f"cut_{family}")

    def objective(hidden, table, ids):
        return jnp.sum(loss(hidden, table, ids, sharding=spec, kernel=kernel,
                            label_smoothing=label_smoothing))

    def arg(shape, dt, pspec):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, pspec))

    args = (
        arg((rows, dim), dtype, P()),
        arg((vocab, dim), dtype, P("model", None)),
        arg((rows, NUM_IDS), jnp.int32, P()),
    )
    step = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))
    return step.lower(*args).compile()


def measure(topology, rows, dim, vocab, kernel, dtype="float32", family="bce", label_smoothing=0.0):
    """One compile: per-chip memory and what the program contains."""
    import numpy as np

    devices = topology_devices(topology)
    start = time.perf_counter()
    compiled = compile_sharded_step(devices, rows, dim, vocab, kernel, dtype, family, label_smoothing)
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    text = compiled.as_text()
    chips = len(devices)
    itemsize = np.dtype(dtype).itemsize
    shard_bytes = -(-vocab // chips) * dim * itemsize
    step = (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    hbm = HBM_GIB[topology.split(":")[0]] * GIB
    return {
        "topology": topology, "chips": chips, "device_kind": devices[0].device_kind,
        "kernel": kernel, "rows": rows, "dim": dim, "vocab": vocab, "dtype": dtype,
        "family": family, "label_smoothing": label_smoothing,
        "table_shard_bytes": shard_bytes,
        "argument_bytes": stats.argument_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
        "step_bytes": step,
        "with_adam_bytes": step + 2 * -(-vocab // chips) * dim * 4,
        "hbm_bytes": hbm,
        "tpu_custom_calls": text.count("tpu_custom_call"),
        "host_callbacks": text.count("callback"),
        "while_loops": text.count(" while("),
        "compile_seconds": round(seconds, 1),
    }


def _run_child(config):
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(config)],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    if proc.returncode != 0:
        return dict(config, error=(proc.stderr.strip().splitlines() or ["?"])[-1][:300])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(value):
    return f"{value / GIB:.2f}"


def markdown(results):
    lines = [
        "| topology | chips | V | D | kernel | table shard | arguments | outputs "
        "| temporaries | step | with Adam | HBM | fits (step / Adam) | Pallas calls |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        chips = r.get("chips") or math.prod(int(n) for n in r["topology"].split(":")[1].split("x"))
        head = f"| {r['topology']} | {chips} | {r['vocab']:.0e} | {r['dim']} "
        if "error" in r:
            lines.append(head + f"| {r['kernel']} | does not compile: {r['error']} |||||||||")
            continue
        fits = "/".join(
            "yes" if r[k] <= r["hbm_bytes"] else "no" for k in ("step_bytes", "with_adam_bytes")
        )
        lines.append(
            head + f"| {r['kernel']} | {_gib(r['table_shard_bytes'])} "
            f"| {_gib(r['argument_bytes'])} | {_gib(r['output_bytes'])} "
            f"| {_gib(r['temp_bytes'])} | {_gib(r['step_bytes'])} "
            f"| {_gib(r['with_adam_bytes'])} | {_gib(r['hbm_bytes'])} | {fits} "
            f"| {r['tpu_custom_calls']} |"
        )
    return "\n".join(lines)


def _write(out, results, machine, rows):
    """Prints and writes the markdown report and the JSON (`machine` has the load average)."""
    load = ", ".join(f"{v:.1f}" for v in machine["load_average"])
    family, smoothing = results[0].get("family", "bce"), results[0].get("label_smoothing", 0.0)
    name = "CutBCE" if family == "bce" else "the softmax cross-entropy"
    name += f" (label smoothing {smoothing})" if smoothing else ""
    note = (
        f"Per-chip memory (GiB) of `jit(value_and_grad)` of {name} (loss; gradients of the "
        f"hidden states and the table), M = {rows} rows (replicated), {NUM_IDS} target "
        "ids per row, float32, the table split along V over every chip "
        "(`keras_cutbce.backends.jax.sharded`), compiled by libtpu for deviceless TPU "
        "topologies from a CPU host (nothing ran on a chip): `memory_analysis()` of the "
        "per-chip program. step = arguments + outputs + temporaries; with Adam = step + "
        "two float32 moments of the table shard (derived). kernel `auto` = Pallas per "
        "shard (what a TPU compile gets), `chunked` = the XLA loop. Compiled on a shared "
        f"CPU host, load average {load}."
    )
    table = markdown(results)
    print(note + "\n\n" + table)
    with open(out + ".md", "w") as f:
        title = "CutBCE" if family == "bce" else "CutSoftmax"
        f.write(f"# {title} on TPU pods: per-chip HBM, table sharded on V\n\n" + note + "\n\n" + table + "\n")
    with open(out + ".json", "w") as f:
        json.dump({"machine": machine, "rows": rows, "results": results}, f, indent=2, default=str)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    parser.add_argument("--vocabs", nargs="+", type=lambda s: int(float(s)), default=list(VOCABS))
    parser.add_argument("--dims", nargs="+", type=int, default=list(DIMS))
    parser.add_argument("--kernels", nargs="+", default=["auto", "chunked"],
                        choices=["auto", "chunked"])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--family", default="bce", choices=["bce", "softmax"])
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--quick", action="store_true", help="one small compile")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "sharded_tpu"))
    parser.add_argument("--render", action="store_true",
                        help="rewrite the markdown from the existing --out JSON (no compile)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return 0
    if args.render:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        rows = saved.get("rows") or saved["results"][0]["rows"]
        _write(args.out, saved["results"], saved["machine"], rows)
        return 0
    if not libtpu_available():
        print("libtpu is not installed: pip install 'jax[tpu]' (same version as jax).")
        return 2
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, list(value))
    results = []
    for topology in args.topologies:
        for vocab in args.vocabs:
            for dim in args.dims:
                for kernel in args.kernels:
                    config = dict(topology=topology, rows=args.rows, dim=dim, vocab=vocab,
                                  kernel=kernel, family=args.family,
                                  label_smoothing=args.label_smoothing)
                    results.append(_run_child(config))
                    print(json.dumps(results[-1]), flush=True)
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
               "load_average": [round(v, 2) for v in os.getloadavg()],
               "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write(args.out, results, machine, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
