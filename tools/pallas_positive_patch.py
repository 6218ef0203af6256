"""Bundles a scalar pass over a grid step's positives needs per positive, by libtpu's final bundles (v6e, deviceless).

A prototype of the alternative to the fused BCE kernel's per-logit positives work (docs/tpu.md,
"Where the targets stand"): a `fori_loop` over an SMEM list of `(row, item)` pairs that loads each
positive's `(8, 128)` vector register from a VMEM tile, flips that one logit's sign and stores it back.
Prints the loop body's bundles with signed (`//`, `%`) and unsigned (shift, mask) index arithmetic.
Run from the repository root: `.venv/bin/python tools/pallas_positive_patch.py` (jax[tpu]).
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

CHILD = r'''
import os, sys
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tools import tpu_aot
signed = sys.argv[1] == "signed"

def kernel(rows_ref, cols_ref, n_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]
    sub = lax.broadcasted_iota(jnp.int32, (8, 128), 0)
    lane = lax.broadcasted_iota(jnp.int32, (8, 128), 1)

    def body(i, carry):  # positive i: row r, item c of the tile; its (8, 128) vreg loaded, flipped, stored
        r, c = rows_ref[i], cols_ref[i]
        if signed:
            r0, c0, rr, cc = (r // 8) * 8, (c // 128) * 128, r % 8, c % 128
        else:
            r0, c0 = (lax.shift_right_logical(r, 3) << 3), (lax.shift_right_logical(c, 7) << 7)
            rr, cc = r & 7, c & 127
        rs, cs = pl.ds(pl.multiple_of(r0, 8), 8), pl.ds(pl.multiple_of(c0, 128), 128)
        v = o_ref[rs, cs]
        o_ref[rs, cs] = jnp.where((sub == rr) & (lane == cc), -v, v)
        return carry

    lax.fori_loop(0, n_ref[0], body, 0)

def f(rows, cols, n, x):
    spec = pl.BlockSpec((512, 256), lambda i, *_: (i, 0))
    grid = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=(4,), in_specs=[spec], out_specs=spec)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=grid)(rows, cols, n, x)

dev = tpu_aot.topology_devices("v6e:2x2")[0]
S = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=jax.sharding.SingleDeviceSharding(dev))
tpu_aot.compile_report(f, (S((256,), jnp.int32), S((256,), jnp.int32), S((1,), jnp.int32),
                           S((2048, 256), jnp.float32)), target=dev)
'''

for variant in ("signed", "unsigned"):
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true "
                   "--xla_jf_dump_llo_pass_label_regex=final_bundles")
        subprocess.run([sys.executable, "-c", CHILD, variant], env=env, check=True, capture_output=True)
        (path,) = glob.glob(os.path.join(dump, "*-f.1-01-final_bundles.txt"))
        with open(path) as f:  # the loop body's bundles: nesting depth 2 (`>>`)
            addresses = [int(a, 16) for a in re.findall(r"^\s+0x([0-9a-f]+) +(?:LB)?: >>", f.read(), re.M)]
        print(f"{variant} index arithmetic: {max(addresses) - min(addresses) + 1} bundles per positive (loop body)")
