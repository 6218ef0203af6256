"""Scoped VMEM of the CutBCE Pallas kernels over the shapes the docs promise, compiled deviceless.

Nothing runs on a TPU. Each case (chip, generation known or not, M, D, V,
dtype) compiles value and gradients of `keras_cutbce.ops.weighted_loss_sum`
(`implementation="auto"`, 8 ids a row: the fused kernel, one pass per
resident row block) for one chip of the generation, in a child process with
the `keras_cutbce` of `--repo`, and reports whether it compiles (else the
compiler's error), the tiles and row blocks the tiling rule chose, the
largest scoped VMEM of a pass against its limit (the one it asked for, else
the 16 MiB default) and the HBM temporaries. "known": compiled under
`jax.set_mesh` of the target device (what a TPU host gets); "unknown": the
generation decided at lowering (a CPU host without a mesh: tiles for any
generation). `--cycles JSON...` puts the fused kernel's cycles per 1024
logits of `tools/pallas_cycles.py` runs beside each case
(`--before-cycles`: earlier runs'). `--cached-only` compiles nothing and
reports the cases not in `--cache` as not run (a grid split over several
runs).

Usage (needs libtpu; a case is a 20 s to 10 min compile on one core, results
are cached under `--cache`):

    python tools/pallas_vmem.py                                   # the grid
    python tools/pallas_vmem.py --repo ../before --json /tmp/pallas_vmem_before.json
    python tools/pallas_vmem.py --cached-only --compare /tmp/pallas_vmem_before.json \\
        --cycles benchmarks/results/pallas_cycles_vmem.json
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--child" in sys.argv:  # the `--repo` checkout's keras_cutbce (on PYTHONPATH), not ROOT's
    import keras_cutbce  # noqa: F401
sys.path.insert(0, ROOT)
from tools.pallas_cycles import CHIPS, chip_label, commit_label, source_digest  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
MiB = 2**20
DEFAULT_SCOPED_VMEM = 16 * MiB
NUM_IDS = 8
SHAPES = tuple((m, 64, v) for m in (4096, 8192, 16384, 32768) for v in (100_000, 876_000)) + (
    (4096, 128, 876_000), (8192, 128, 1_000_000))


def compile_case(case):
    """Compiles one case in this process; returns its facts as a dict."""
    import jax
    import jax.numpy as jnp

    from tools import tpu_aot
    from keras_cutbce import ops
    from keras_cutbce.backends.jax import compile_platform
    from keras_cutbce.backends.jax import pallas

    tiling = getattr(pallas, "tiling", None) or pallas.api  # the tile rule (in `api` in later checkouts)

    device = tpu_aot.topology_devices(CHIPS[case["chip"]].topology)[0]
    known = case["target"] == "known"
    m, d, v, dtype = case["rows"], case["dim"], case["vocab"], case["dtype"]
    info = compile_platform.chip_info(device.device_kind)
    capacity = info.vmem_bytes if known else None
    # The tiles' budget (`vmem_budget_bytes` in checkouts before `tile_budget_bytes`).
    budget = getattr(tiling, "tile_budget_bytes", tiling.vmem_budget_bytes)(capacity)
    row_tile, tile = tiling.choose_tiles(m, v, d, dtype, budget)

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.SingleDeviceSharding(device))

    def fn(h, t, ids, w):
        return jax.value_and_grad(lambda h, t: ops.weighted_loss_sum(h, t, ids, w),
                                  argnums=(0, 1))(h, t)

    args = (spec((m, d), dtype), spec((v, d), dtype), spec((m, NUM_IDS), jnp.int32),
            spec((m,), jnp.float32))
    facts = dict(tiles=[row_tile, tile])
    try:
        report = tpu_aot.compile_report(fn, args, target=device if known else None)
    except Exception as error:  # noqa: BLE001 - the compiler's verdict is the result
        text = str(error)
        found = re.search(r"Scoped allocation with size \S+ and limit \S+", text)
        return dict(facts, compiles=False, error=found.group(0) if found else text[:300])
    kernels = [k for k in report.kernels if "cutbce" in k.name]
    return dict(facts, compiles=True, passes=len(kernels), temp_mib=report.temp_bytes / MiB,
                vmem_mib=max(k.scoped_vmem_bytes for k in kernels) / MiB,
                limit_mib=max(k.vmem_limit_bytes or DEFAULT_SCOPED_VMEM for k in kernels) / MiB)


def _run_child(case, cache, repo, cached_only=False):
    key = hashlib.sha1(json.dumps([case, source_digest(repo)], sort_keys=True).encode())
    path = os.path.join(cache, key.hexdigest()[:16] + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if cached_only:
        return dict(compiles=None)
    env = dict(os.environ, KERAS_BACKEND="jax", TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=os.path.abspath(repo))
    env["JAX_PLATFORMS"] = ""  # JAX's own choice (scripts/quiet_start.pth pins the CPU)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)],
                         capture_output=True, text=True, env=env, timeout=3600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("FACTS ")]
    if not lines:
        raise RuntimeError(f"case {case} failed:\n{out.stderr[-3000:]}")
    os.makedirs(cache, exist_ok=True)
    with open(path, "w") as f:
        f.write(lines[-1][len("FACTS "):])
    return json.loads(lines[-1][len("FACTS "):])


def _key(r):
    return tuple(r[k] for k in ("chip", "target", "rows", "dim", "vocab", "dtype"))


def _cycles(paths):
    """`{case key: cycles per 1024 logits}` of `pallas_cycles` JSONs (the fused path, L = 8)."""
    rows = []
    for path in paths or ():
        with open(path) as f:
            rows += json.load(f)["rows"]
    return {_key(dict(r, target=r.get("target", "known"))): r["kernels"][0]["cycles_per_1024"]
            for r in rows if r["path"] == "fused" and r["ids"] == NUM_IDS}


def _cell(r):
    if r is None:
        return "-", "-", "-", "-"
    if r["compiles"] is None:
        return "not run", "-", "-", "-"
    if not r["compiles"]:
        return "no", f"({r['tiles'][0]}, {r['tiles'][1]})", r["error"], "-"
    return ("yes", f"({r['tiles'][0]}, {r['tiles'][1]}) x {r['passes']}",
            f"{r['vmem_mib']:.2f} / {r['limit_mib']:.0f}", f"{r['temp_mib']:.1f}")


def markdown(rows, before, cycles, before_cycles, label, before_label):
    old = {_key(r): r for r in before}
    ran = [r for r in rows if r["compiles"] is not None]
    header = ["chip", "M", "D", "V", "dtype", "compiles", "tiles x passes", "VMEM / limit",
              "temporaries", "cycles / 1024"]
    if before:
        header += ["compiles before", "tiles x passes before", "VMEM / limit before",
                   "temporaries before"]
    if before_cycles:
        header += ["cycles / 1024 before"]
    right = {"M", "D", "V", "VMEM / limit", "temporaries", "cycles / 1024", "VMEM / limit before",
             "temporaries before", "cycles / 1024 before"}
    lines = [
        f"Scoped VMEM of the CutBCE Pallas kernels (`{label}`"
        + (f", before: `{before_label}`" if before else "") + "), compiled deviceless by libtpu "
        "(nothing ran): value and gradients of `weighted_loss_sum`, L = 8, one chip. Tiles: "
        "(row tile, vocabulary tile) x passes (resident row blocks). VMEM: the largest scoped "
        "VMEM of a pass / its limit, MiB. Temporaries: HBM, MiB. Cycles: the fused kernel's "
        "cycles per 1024 logits from its final bundles (`tools/pallas_cycles.py`, V "
        "rounded up to whole tiles; a lower bound, not a timing; \"-\": not measured). "
        "\"unknown\": compiled with the generation unknown (tiles for any); \"not run\": not "
        f"compiled in this run. {sum(bool(r['compiles']) for r in ran)} of {len(ran)} cases "
        f"run compiled ({len(rows) - len(ran)} of {len(rows)} not run).", "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---:" if h in right else "---" for h in header) + " |",
    ]
    for r in rows:
        key = _key(r)
        cells = [chip_label(r), str(r["rows"]), str(r["dim"]), f"{r['vocab']:,}", r["dtype"],
                 *_cell(r), str(cycles.get(key, "-"))]
        if before:
            cells += _cell(old.get(key))
        if before_cycles:
            cells.append(str(before_cycles.get(key, "-")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cases_of(args):
    from tools.pallas_cycles import parse_shapes

    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    return [dict(chip=chip, target=target, rows=m, dim=d, vocab=v, dtype=dtype)
            for target in args.targets.split(",") for chip in args.chips.split(",")
            for (m, d, v) in shapes for dtype in args.dtypes.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default="v5e,v5p,v6e")
    parser.add_argument("--targets", default="known,unknown")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shapes", default="", help='"M,D,V;..." instead of the grid')
    parser.add_argument("--repo", default=ROOT, help="checkout whose keras_cutbce is compiled")
    parser.add_argument("--cache", default=os.path.join("/tmp", "pallas_vmem_cache"))
    parser.add_argument("--json", default=os.path.join(RESULTS, "pallas_vmem.json"))
    parser.add_argument("--label", default=None, help="what the table names the code")
    parser.add_argument("--compare", default=None, metavar="BEFORE_JSON")
    parser.add_argument("--cycles", nargs="*", metavar="PALLAS_CYCLES_JSON")
    parser.add_argument("--before-cycles", nargs="*", metavar="PALLAS_CYCLES_JSON")
    parser.add_argument("--cached-only", action="store_true",
                        help="compile nothing: cases not in --cache are reported as not run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("FACTS " + json.dumps(compile_case(json.loads(args.child))), flush=True)
        return 0
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        print("libtpu is not installed (pip install '.[tpu-compile]'): no TPU compiler.")
        return 2
    rows = []
    for case in cases_of(args):
        rows.append(dict(case, **_run_child(case, args.cache, args.repo, args.cached_only)))
        print(json.dumps(rows[-1]), flush=True)
    label = args.label or commit_label(args.repo)
    with open(args.json, "w") as f:
        json.dump({"label": label, "rows": rows}, f, indent=1)
    before, before_label = [], None
    if args.compare:
        with open(args.compare) as f:
            data = json.load(f)
        before, before_label = data["rows"], data["label"]
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(markdown(rows, before, _cycles(args.cycles), _cycles(args.before_cycles), label,
                         before_label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
