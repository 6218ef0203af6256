"""CutBCE on a TPU: dense Keras BCE vs chunked XLA vs Pallas kernels.

For each variant, measures the median wall time of one jitted forward +
backward step (loss and gradients for hidden, table and bias under a random
cotangent) and the peak device memory (`jax.devices()[0].memory_stats()
["peak_bytes_in_use"]`). Each variant runs in its own subprocess, so peaks do
not leak from one variant into the next and a variant that runs out of
memory does not stop the others. Prints a markdown table and writes JSON.

Variants:

- `dense`: `keras.losses.binary_crossentropy(multi_hot, h @ E.T + b,
  from_logits=True)`: the `[rows, V]` logits and targets exist.
- `chunked`: `cut_binary_crossentropy(..., implementation="chunked")`, the
  XLA loop over vocabulary tiles.
- `pallas`: `cut_binary_crossentropy(..., implementation="pallas")`, the
  Pallas TPU kernel (`keras_cutbce/backends/jax/pallas/`).

Usage (on a TPU VM, from the repository root):

    python tools/cutbce_tpu.py                       # rows 8192, V 262144, D 128
    python tools/cutbce_tpu.py --rows 32768 --vocab 1048576 --dtype bfloat16
    python tools/cutbce_tpu.py --allow-cpu           # tiny shapes, interpret mode

Without a TPU the script explains itself and exits with status 2, unless
`--allow-cpu` is given: then it runs tiny shapes, the Pallas kernels in the
Pallas TPU interpreter, only to check that the script works (the numbers mean
nothing).

Deviceless (any host with libtpu: `pip install ".[tpu-compile]"`):

    python tools/cutbce_tpu.py --deviceless v6e:2x2
    python tools/cutbce_tpu.py --deviceless v5e:2x2

compiles the same step for one chip of that topology with the real TPU
compiler (nothing runs: no timing) at the CutBCE paper's Yambda scale (876k
items) and at 10^6 and 10^7 items, and reports the compiled HBM of each
variant: arguments + outputs + temporaries, from `memory_analysis()`, and
whether it fits the chip's HBM, beside the paper's -65.7% HBM.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

VARIANTS = ("dense", "chunked", "pallas")
DEVICELESS_VOCABS = (876_000, 1_000_000, 10_000_000)
PAPER_HBM_CHANGE = "-65.7%"  # the CutBCE paper's HBM reduction vs dense BCE (Yambda)
HBM_BYTES = {"TPU v5 lite": 16 * 2**30, "TPU v6 lite": 32 * 2**30, "TPU v5": 95 * 2**30,
             "TPU v4": 32 * 2**30}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `tools.tpu_aot` and this checkout's package
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DEFAULT_JSON = os.path.join(RESULTS, "cutbce_tpu.json")
CPU_CHECK_JSON = os.path.join(RESULTS, "cutbce_tpu_cpu_check.json")
NO_TPU_STATUS = 2


def _env():
    env = dict(os.environ)
    env["KERAS_BACKEND"] = "jax"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def probe_platform():
    """The default JAX platform, asked in a subprocess.

    A TPU can be opened by one process at a time, so the parent never
    initialises JAX itself: each measurement runs in a fresh child.
    """
    code = "import jax; d = jax.devices()[0]; print(d.platform, '|', d.device_kind)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True,
            env=_env(), timeout=300, check=True,
        ).stdout.strip().splitlines()[-1]
    except (subprocess.SubprocessError, IndexError) as error:
        return "unknown", str(error)
    platform, _, kind = out.partition(" | ")
    return platform.strip(), kind.strip()


# ----------------------------------------------------------------------------
# Worker: one variant, in its own process.
# ----------------------------------------------------------------------------


def _make_inputs(args):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(args.seed), 5)
    hidden = (jax.random.normal(keys[0], (args.rows, args.dim)) * 0.5).astype(args.dtype)
    table = (jax.random.normal(keys[1], (args.vocab, args.dim)) * 0.05).astype(args.dtype)
    bias = jax.random.normal(keys[2], (args.vocab,)).astype(args.dtype) * 0.1
    ids = jax.random.randint(keys[3], (args.rows, args.labels), -1, args.vocab)
    cotangent = jax.random.normal(keys[4], (args.rows,), jnp.float32)
    return hidden, table, bias, ids, cotangent


def _loss_fn(variant, ids, vocab):
    import jax.numpy as jnp
    import keras

    from keras_cutbce import ops

    if variant == "dense":
        from keras_cutbce.math.reference import multi_hot

        def dense(h, t, b):
            z = jnp.matmul(h, t.T, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
            return keras.losses.binary_crossentropy(multi_hot(ids, vocab), z, from_logits=True)

        return dense

    def cut(h, t, b):
        return ops.cut_binary_crossentropy(h, t, ids, b, implementation=variant)

    return cut


def _step(loss_fn, cotangent):
    import jax
    import jax.numpy as jnp

    def step(h, t, b):
        def objective(h, t, b):
            loss = loss_fn(h, t, b)
            return jnp.sum(loss * cotangent), loss

        (_, loss), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(h, t, b)
        return jnp.mean(loss), grads

    return step


def run_deviceless_worker(args):
    """Compiles every (vocab, variant) for one chip of `args.deviceless`; prints JSON lines."""
    import jax
    import jax.numpy as jnp

    from tools import tpu_aot

    device = tpu_aot.topology_devices(args.deviceless)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    for vocab in DEVICELESS_VOCABS:
        # Ids and cotangent are arguments too: nothing is constant-folded.
        shapes = (spec((args.rows, args.dim), args.dtype), spec((vocab, args.dim), args.dtype),
                  spec((vocab,), args.dtype), spec((args.rows, args.labels), jnp.int32),
                  spec((args.rows,), jnp.float32))
        for variant in args.variants.split(","):
            result = {"variant": variant, "vocab": vocab, "device": device.device_kind}
            start = time.perf_counter()
            try:
                def step(h, t, b, ids, cotangent, variant=variant, vocab=vocab):
                    return _step(_loss_fn(variant, ids, vocab), cotangent)(h, t, b)

                report = tpu_aot.compile_report(step, shapes, target=device)
                result.update(temp_bytes=report.temp_bytes, argument_bytes=report.argument_bytes,
                              output_bytes=report.output_bytes,
                              kernels=[k.name for k in report.kernels],
                              host_callbacks=report.host_callbacks)
            except Exception as error:  # noqa: BLE001 - e.g. does not fit HBM: reported
                message = f"{type(error).__name__}: {error}"
                result["error"] = message.splitlines()[0][:400]
            result["compile_s"] = round(time.perf_counter() - start, 1)
            print("RESULT " + json.dumps(result), flush=True)


def _kernel_name(name):
    """`cutbce_grad_table` out of `transpose_jvp_cutbce_grad_table__` (JAX's AD prefixes)."""
    found = re.search(r"cutbce_[a-z_]*[a-z]", name)
    return found.group(0) if found else name


def _total(r):
    return r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"]


def _needed(r):
    """`(HBM bytes, "<=" or "")`: compiled, or at least the temporaries XLA said it needs."""
    if "error" not in r:
        return _total(r), ""
    found = re.search(r"HLO temporaries \(([\d.]+)G\)", r["error"])
    return (float(found.group(1)) * 2**30, "<= ") if found else (None, "")


def deviceless_table(args, results):
    kind = next((r["device"] for r in results if "device" in r), "?")
    hbm = HBM_BYTES.get(kind)
    lines = [
        f"Compiled for one {kind} chip of {args.deviceless} from a CPU host (deviceless, "
        f"nothing ran); forward+backward (loss, gradients for hidden, table, bias), "
        f"rows={args.rows}, D={args.dim}, L={args.labels}, {args.dtype}. HBM = arguments + "
        f"outputs + temporaries from `memory_analysis()` (for a program that does not "
        f"fit: at least the temporaries XLA reports it needs)"
        + (f"; the chip has {hbm / 2**30:.0f} GiB." if hbm else "."),
        "",
        "| items V | variant | HBM GiB | temporaries MiB | vs dense | kernels | note |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    for vocab in DEVICELESS_VOCABS:
        rows = [r for r in results if r.get("vocab") == vocab]
        dense = next((r for r in rows if r["variant"] == "dense"), None)
        dense_bytes, at_least = (None, "") if dense is None else _needed(dense)
        for r in rows:
            if "error" in r:
                needed, _ = _needed(r)
                shown = f">= {needed / 2**30:.2f}" if needed else "-"
                lines.append(f"| {vocab:,} | {r['variant']} | {shown} | - | - | - | "
                             f"does not fit: {r['error'][:150]} |")
                continue
            change = "n/a"
            if dense_bytes:
                change = f"{at_least}{100 * (_total(r) / dense_bytes - 1):+.1f}%"
            note = f"does not fit {hbm / 2**30:.0f} GiB" if hbm and _total(r) > hbm else ""
            kernels = ", ".join(sorted({_kernel_name(k) for k in r["kernels"]})) or "XLA only"
            lines.append(
                f"| {vocab:,} | {r['variant']} | {_total(r) / 2**30:.2f} | "
                f"{r['temp_bytes'] / 2**20:.1f} | {change} | {kernels} | {note} |"
            )
    lines.append("")
    lines.append(f"The CutBCE paper reports {PAPER_HBM_CHANGE} HBM against dense BCE on Yambda.")
    return "\n".join(lines)


def run_deviceless(args):
    env = _env()
    env.update(TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env["JAX_PLATFORMS"] = ""  # JAX's own choice (scripts/quiet_start.pth pins the CPU)
    cmd = [sys.executable, os.path.abspath(__file__), "--deviceless-worker", args.deviceless]
    for name in ("rows", "dim", "labels", "dtype", "variants"):
        cmd += [f"--{name}", str(getattr(args, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    if not results:
        print(proc.stderr[-3000:])
        return 1
    table = deviceless_table(args, results)
    print(table)
    name = f"cutbce_tpu_deviceless_{args.deviceless.split(':')[0]}_{args.dtype}"
    path = args.json or os.path.join(RESULTS, name + ".json")
    payload = {"benchmark": "cutbce_tpu_deviceless", "topology": args.deviceless,
               "config": {k: getattr(args, k) for k in ("rows", "dim", "labels", "dtype")},
               "load_average": os.getloadavg(), "results": results, "markdown": table}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
    with open(os.path.splitext(path)[0] + ".md", "w") as handle:
        handle.write(table + "\n")
    print(f"wrote {path}")
    return 0


def run_worker(args):
    """Measures one variant; prints one JSON line."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    hidden, table, bias, ids, cotangent = _make_inputs(args)
    step = jax.jit(_step(_loss_fn(args.worker, ids, args.vocab), cotangent))

    result = {"variant": args.worker, "platform": device.platform, "device": device.device_kind}
    start = time.perf_counter()
    mean_loss, _ = jax.block_until_ready(step(hidden, table, bias))
    result["compile_and_first_s"] = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(hidden, table, bias))
        times.append(time.perf_counter() - start)
    result["median_ms"] = 1e3 * statistics.median(times)
    result["min_ms"] = 1e3 * min(times)
    result["mean_loss"] = float(mean_loss)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    result["peak_bytes"] = None if not stats else stats.get("peak_bytes_in_use")
    if args.worker == "pallas":
        from keras_cutbce.backends.jax.pallas import api

        result["tiles"] = api.choose_tiles(args.rows, args.vocab, args.dim, args.dtype)
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------
# Driver.
# ----------------------------------------------------------------------------


def _worker_command(args, variant):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant]
    for name in ("rows", "vocab", "dim", "labels", "dtype", "repeats", "seed"):
        cmd += [f"--{name}", str(getattr(args, name))]
    return cmd


def run_variant(args, variant):
    try:
        proc = subprocess.run(
            _worker_command(args, variant), capture_output=True, text=True,
            env=_env(), timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    message = " ".join(tail)[-300:]
    if "RESOURCE_EXHAUSTED" in proc.stderr or "Out of memory" in proc.stderr:
        message = "out of memory: " + message
    return {"variant": variant, "error": message or f"exit status {proc.returncode}"}


def _mib(value):
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def markdown_table(args, results):
    lines = [
        f"CutBCE forward+backward, rows={args.rows}, V={args.vocab}, D={args.dim}, "
        f"L={args.labels}, dtype={args.dtype}, median of {args.repeats}",
        "",
        "| variant | median ms | min ms | peak memory MiB | mean loss | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | - | - | - | {r['error']} |")
            continue
        note = f"tiles (rows, vocab) = {tuple(r['tiles'])}" if "tiles" in r else ""
        lines.append(
            f"| {r['variant']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
            f"{_mib(r['peak_bytes'])} | {r['mean_loss']:.6f} | {note} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="positions (B*N); default 8192")
    parser.add_argument("--vocab", type=int, default=None, help="items V; default 262144")
    parser.add_argument("--dim", type=int, default=None, help="hidden size D; default 128")
    parser.add_argument("--labels", type=int, default=8, help="target ids per position")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=None, help="timed steps; default 20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
    parser.add_argument("--json", default=None,
                        help=f"where to write the results; default {DEFAULT_JSON} "
                        f"(or {CPU_CHECK_JSON} off TPU)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run without a TPU: tiny shapes, Pallas in interpret mode")
    parser.add_argument("--deviceless", default=None, metavar="TOPOLOGY",
                        help="compile for one chip of this TPU topology (e.g. v6e:2x2, "
                        "v5e:2x2) without a TPU; needs libtpu")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--deviceless-worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _fill_defaults(args, tiny):
    defaults = dict(rows=256, vocab=2000, dim=64, repeats=3) if tiny else dict(
        rows=8192, vocab=262144, dim=128, repeats=20
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def main(argv=None):
    args = parse_args(argv)
    if args.deviceless or args.deviceless_worker:
        args.rows = args.rows or 4096
        args.dim = args.dim or 64
        if args.deviceless_worker:
            args.deviceless = args.deviceless_worker
            run_deviceless_worker(args)
            return 0
        return run_deviceless(args)
    if args.worker:
        _fill_defaults(args, tiny=True)
        run_worker(args)
        return 0
    platform, kind = probe_platform()
    if platform != "tpu" and not args.allow_cpu:
        print(
            f"No TPU found (JAX's default device is {platform!r}: {kind}). This benchmark "
            "compares the Pallas TPU kernels with dense and chunked XLA on a TPU; run it "
            "on a TPU VM, or pass --allow-cpu to check that it works on tiny shapes "
            "(Pallas in interpret mode; the numbers then mean nothing)."
        )
        return NO_TPU_STATUS
    _fill_defaults(args, tiny=platform != "tpu")
    if args.json is None:
        args.json = DEFAULT_JSON if platform == "tpu" else CPU_CHECK_JSON
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        print(f"Unknown variants {unknown}; choose from {VARIANTS}.")
        return 1
    results = []
    for variant in variants:
        print(f"running {variant} on {platform} ({kind}) ...", flush=True)
        results.append(run_variant(args, variant))
    table = markdown_table(args, results)
    print(table)
    payload = {
        "benchmark": "cutbce_tpu",
        "platform": platform,
        "device": kind,
        "config": {k: getattr(args, k) for k in ("rows", "vocab", "dim", "labels", "dtype",
                                                 "repeats", "seed")},
        "results": results,
        "markdown": table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump(payload, handle, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
