"""HBM traffic of the CutBCE Pallas kernels, read from their pipeline schedule.

Nothing here runs on a TPU and nothing is timed. The program (value and
gradients of the loss) is traced for a TPU target (a deviceless device of
`--topology`, so the kernels are tiled for that generation's VMEM) and every
`pallas_call` in it is walked grid step by grid step: the Pallas TPU
pipeline fetches an input block when its block index differs from the
previous step's (and at the first step), and writes an output block back
when the next step's index differs (and at the last step). The bytes moved
are those blocks' bytes. So the table's traffic (operands with a
vocabulary-sized dimension) and the row inputs' traffic (hidden states, ids,
cotangent) are the kernels' own schedule, not an estimate.

The same program is also compiled (Mosaic, XLA:TPU) for its HBM
temporaries. Reported per case: the kernels (`pallas_call`s), how many times the table is
read (table-shaped bytes fetched / the table's bytes), how many times the
table gradient is written and read back, the row inputs' bytes and the
total HBM bytes the kernels move; and the id compares per logit that find
the positives, for `L = 8` ids a row drawn uniformly and Zipf-distributed
(exponent 1.2, item 0 the most popular): `L` when every id is compared
with every logit, else the mean over (vocabulary tile, row tile) steps of
the most ids one row of the row tile has in the vocabulary tile.

Usage (needs libtpu: `pip install ".[tpu-compile]"`):

    python tools/pallas_traffic.py                     # v6e:2x2
    python tools/pallas_traffic.py --topology v5p:2x2x1
    python tools/pallas_traffic.py --repo ../other-checkout --json before.json

`--repo` imports `keras_cutbce` from another checkout (e.g. the commit
before a kernel change), so before/after come from the same script.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CASES = (  # (rows M, dim D, vocabulary V, dtype)
    (4096, 64, 876_000, "float32"),
    (16384, 64, 876_000, "float32"),
    (4096, 128, 876_000, "float32"),
    (4096, 64, 876_000, "bfloat16"),
    (32768, 64, 876_000, "bfloat16"),
)
NUM_IDS = 8
GiB = 2**30


def _pallas_calls(jaxpr):
    """Every `pallas_call` equation of a jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _pallas_calls(getattr(inner, "jaxpr", inner))


def _block_indices(mapping, grid):
    """`[steps, ndim]` block indices of one operand over the grid (row-major order)."""
    import jax
    import numpy as np

    axes = np.meshgrid(*[np.arange(n, dtype=np.int32) for n in grid], indexing="ij")
    flat = [a.reshape(-1) for a in axes]
    closed = mapping.index_map_jaxpr

    extra = len(closed.jaxpr.invars) - len(grid)  # scalar-prefetch refs (unused by our maps)

    def index(*idx):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *idx, *([None] * extra))

    out = jax.vmap(index)(*flat)
    return np.stack([np.broadcast_to(np.asarray(o), flat[0].shape) for o in out], axis=1)


def _moves(indices):
    """How many block transfers a pipelined operand makes."""
    import numpy as np

    changes = np.any(indices[1:] != indices[:-1], axis=1).sum()
    return int(changes) + 1  # inputs: first fetch; outputs: last write-back


def kernel_traffic(jaxpr, vocab_size):
    """Per `pallas_call`: name, grid and bytes moved (table-shaped, rows, total)."""
    import numpy as np

    calls = []
    for eqn in _pallas_calls(jaxpr):
        gm = eqn.params["grid_mapping"]
        grid = tuple(int(n) for n in gm.grid)
        mappings = list(gm.block_mappings)
        num_in = gm.num_inputs
        entry = dict(name=str(eqn.params.get("name") or "kernel"),
                     grid=grid, table_read=0, table_written=0, rows=0, total=0)
        for k, mapping in enumerate(mappings):
            aval = mapping.array_aval
            block_bytes = int(np.prod(mapping.block_aval.shape)) * aval.dtype.itemsize
            moved = _moves(_block_indices(mapping, grid)) * block_bytes
            entry["total"] += moved
            if vocab_size in aval.shape:
                entry["table_written" if k >= num_in else "table_read"] += moved
            elif k < num_in:
                entry["rows"] += moved
        calls.append(entry)
    return calls


def _program(case, device):
    import jax
    import jax.numpy as jnp

    m, d, v, dtype = case
    pallas = _pallas()

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.SingleDeviceSharding(device))

    args = (spec((m, d), dtype), spec((v, d), dtype), spec((m, NUM_IDS), jnp.int32),
            spec((m,), jnp.float32))

    def weighted_sum(h, t, ids, w):
        return jax.value_and_grad(
            lambda h, t: pallas.cut_bce_weighted_sum(h, t, ids, None, w), argnums=(0, 1)
        )(h, t)

    def per_row(h, t, ids, w):
        return jax.value_and_grad(
            lambda h, t: jnp.vdot(w, pallas.cut_bce(h, t, ids, None)), argnums=(0, 1)
        )(h, t)

    return {"weighted_sum": (weighted_sum, args), "loss": (per_row, args)}


def _pallas():
    """The Pallas package of the checkout being measured (`pallas_tpu` in older ones)."""
    try:
        from keras_cutbce.backends.jax import pallas
    except ImportError:
        from keras_cutbce.backends.jax import pallas_tpu as pallas
    return pallas


def _compares_per_logit(case, device, ids):
    """Mean id compares per logit of the kernels for `ids` (static `L` without counts)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_cutbce.backends.jax import compile_platform
    from keras_cutbce.common import round_up

    pallas = _pallas()
    sort_ids = None  # `api.sorted_positives`: `row_inputs` takes each row's ids sorted
    if hasattr(pallas, "api"):  # a package: the passes in `api`
        tiling = getattr(pallas, "tiling", None) or pallas.api  # the tile rule (in `api` in later checkouts)
        sort_ids = getattr(pallas.api, "sorted_positives", None)
        row_inputs, in_tile_counts = pallas.api.row_inputs, pallas.api.in_tile_counts
    elif hasattr(pallas, "_in_tile_counts"):  # an older checkout: one module
        tiling = pallas
        row_inputs, in_tile_counts = pallas._row_inputs, pallas._in_tile_counts
    else:
        return float(ids.shape[1])
    from types import SimpleNamespace

    m, d, v, dtype = case
    capacity = compile_platform.chip_info(device.device_kind).vmem_bytes
    budget = getattr(tiling, "tile_budget_bytes", tiling.vmem_budget_bytes)(capacity)
    row_tile, tile = tiling.choose_tiles(m, v, d, dtype, budget)
    cfg = SimpleNamespace(vocab_size=v, tile=tile, vocab_tile=tile, row_tile=row_tile,
                          dv_view=d % 128 != 0, num_tiles=-(-v // tile))
    rows = round_up(m, row_tile)
    with jax.default_device(jax.devices("cpu")[0]):
        rows_ids = jnp.asarray(ids)
        if sort_ids is not None:
            rows_ids = sort_ids(rows_ids, v)[0]
        _, ids_t, _ = row_inputs(jnp.zeros((m, d)), rows_ids, None, rows, cfg)
        return float(np.mean(np.asarray(in_tile_counts(ids_t, cfg))))


def _ids(m, v, zipf, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    if not zipf:
        return rng.integers(0, v, size=(m, NUM_IDS)).astype(np.int32)
    ranks = np.arange(1, v + 1, dtype=np.float64)
    p = ranks ** -1.2
    return rng.choice(v, size=(m, NUM_IDS), p=p / p.sum()).astype(np.int32)


def measure(topology):
    import jax
    import numpy as np

    if ROOT not in sys.path:  # after `--repo`: keras_cutbce still comes from there
        sys.path.append(ROOT)
    from tools import tpu_aot

    device = tpu_aot.topology_devices(topology)[0]
    rows = []
    for case in CASES:
        m, d, v, dtype = case
        table_bytes = v * d * np.dtype(dtype if dtype != "bfloat16" else np.float16).itemsize
        for op, (fn, args) in _program(case, device).items():
            with jax.set_mesh(jax.sharding.Mesh([device], ("cutbce_target",))):
                jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
                compiled = jax.jit(fn).lower(*args).compile()
            temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
            calls = kernel_traffic(jaxpr, v)
            rows.append(dict(
                op=op, rows=m, dim=d, vocab=v, dtype=dtype, kernels=len(calls),
                grids=[c["grid"] for c in calls], names=[c["name"] for c in calls],
                table_reads=round(sum(c["table_read"] for c in calls) / table_bytes, 2),
                table_grad_writes=round(sum(c["table_written"] for c in calls) / table_bytes, 2),
                row_gib=round(sum(c["rows"] for c in calls) / GiB, 3),
                total_gib=round(sum(c["total"] for c in calls) / GiB, 3),
                table_gib=round(table_bytes / GiB, 3),
                temp_mib=round(temp_mib, 1),
                compares_uniform=round(_compares_per_logit(case, device, _ids(m, v, False)), 2),
                compares_zipf=round(_compares_per_logit(case, device, _ids(m, v, True)), 2),
            ))
    return rows


def markdown(rows, topology):
    lines = [
        f"HBM traffic of the Pallas kernels, compiled for one chip of `{topology}` (their pipeline "
        "schedule; nothing ran, nothing timed). Table reads and table-gradient writes in units of "
        "the table's bytes (a table-shaped gradient written in f32 for a bf16 table counts 2); "
        "row inputs and total in GiB; HBM temporaries as compiled (`memory_analysis()`). "
        "Id compares per logit: uniform / Zipf(1.2) ids, L = 8.",
        "",
        "| op | M | D | V | dtype | kernels | table reads | table-grad writes | row inputs GiB "
        "| total GiB | id compares / logit | HBM temporaries MiB |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['rows']} | {r['dim']} | {r['vocab']:,} | {r['dtype']} | {r['kernels']} "
            f"| {r['table_reads']} | {r['table_grad_writes']} | {r['row_gib']} | {r['total_gib']} "
            f"| {r['compares_uniform']} / {r['compares_zipf']} | {r['temp_mib']} |"
        )
    return "\n".join(lines)


def _commit(repo):
    """The checkout's commit (short hash, "+" when it has uncommitted changes), or None."""
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", "-C", repo, *cmd], capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip()
    return (head + ("+" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
            ) or None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v6e:2x2")
    parser.add_argument("--repo", default=ROOT, help="checkout to import keras_cutbce from")
    parser.add_argument("--json", default=None,
                        help="where to write the JSON (default: results/); the markdown beside it")
    args = parser.parse_args(argv)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["KERAS_BACKEND"] = "jax"
    sys.path.insert(0, os.path.abspath(args.repo))
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        print("libtpu is not installed (pip install '.[tpu-compile]'): no TPU target to trace for.")
        return 2
    rows = measure(args.topology)
    text = markdown(rows, args.topology)
    print(text)
    path = args.json or os.path.join(
        RESULTS, f"pallas_traffic_{args.topology.split(':')[0]}.json")
    with open(path, "w") as f:
        json.dump({"topology": args.topology, "commit": _commit(args.repo), "rows": rows},
                  f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
