"""CutBCE vs dense Keras BCE on CPU: forward+backward time and peak extra memory.

For every backend (jax, torch, tensorflow) and shape (M, D, V), times, side by
side in one run, each in its own subprocess:

- `dense`: `keras.losses.binary_crossentropy(multi_hot, h @ E.T + b,
  from_logits=True)` and its gradients for h, E, b (jit / tf.function);
- `cutbce`: `sum(cut_binary_crossentropy(..., implementation="chunked"))`,
  same gradients (the per-position op: exact for any cotangent, so its
  backward recomputes the logits);
- `cutbce_loss`: what `CutBCELoss` runs, `weighted_loss_sum` (the reduced
  loss; backends with a fused kernel compute the gradients in the same pass
  over the vocabulary as the loss);
- the floor: `matmuls` (the three products `h @ E.T`, `dZ @ E`, `dZ.T @ h` of
  the same shapes, on the backend) plus `elementwise` (softplus and sigmoid of
  M x V values in one jit-compiled XLA pass, measured once on JAX);
- `topk_dense` / `topk_cut`: dense `top_k` of the logits vs `cut_top_k`.

Peak extra memory is the process's peak RSS during the timed runs above its
RSS once the inputs exist (Linux `/proc/self/clear_refs` resets the peak
after the warm-up, so what tracing and compilation alone needed is left out;
memory the warm-up left allocated, e.g. allocator pools, still counts). The
JSON also keeps `first_call_peak_extra_mb`, the warm-up call's peak with
tracing and compilation. A run whose RSS passes
`--memory-cap-gb` is killed and reported as out of memory. `--threads`
sets torch's, TensorFlow's and (at 1) XLA's thread counts; "default" (the
default) leaves each backend at its own, as users run it.

`--side-by-side` instead times, per backend and thread setting (`--threads`,
a comma list, default "default,1") in one process, dense BCE, the loss path
and the op (and on JAX a pure-JAX scan-and-checkpoint operator) alternating,
one of each per round, and writes `..._side_by_side.{md,json}` with each
one's wall and CPU ratio over dense: wall time at the default threads is
what users see; CPU time at 1 thread has no waits at thread barriers.

`--memory` writes the memory table `..._memory.{md,json}`: the extra peak
RSS of one forward + backward of the loss path at (1024, 128, 262144), each
backend in its own process.

`--softmax` writes `..._softmax.{md,json}`: `CutSoftmaxLoss` and
`cut_categorical_crossentropy` against dense Keras softmax cross-entropy
(and `F.linear_cross_entropy` on torch), alternating in one process per
backend and shape, plus each one's extra peak RSS in a fresh process.

`--before DIR` (with `--side-by-side` or `--memory`) runs the same worker
processes with the package of the checkout at DIR too, alternating with
this checkout's: the before/after comparison, from two checkouts.

Usage:
    python benchmarks/cutbce_cpu.py            # full table (takes ~15 min)
    python benchmarks/cutbce_cpu.py --side-by-side --before /tmp/cpu-old
    python benchmarks/cutbce_cpu.py --memory --before /tmp/cpu-old --backends torch,tensorflow
    python benchmarks/cutbce_cpu.py --softmax --threads 1 --repeats 3
    python benchmarks/cutbce_cpu.py --quick    # a small shape, to check it runs

Writes `benchmarks/results/cutbce_cpu.{md,json}` (or `--out PREFIX`).
"""

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(4096, 64, 32768), (4096, 64, 131072), (1024, 128, 262144)]
QUICK_SHAPES = [(512, 32, 4096)]
BACKENDS = ["jax", "torch", "tensorflow"]
TOP_K = 10
TARGETS = {32768: 0.5, 131072: 0.25, 262144: 0.4}


sys.path.insert(0, ROOT)  # this checkout's harness, even in a `--before` worker
from benchmarks.common import alternate, commit, emit_row, fmt_spread  # noqa: E402
from benchmarks.common import reset_peak_rss as _reset_peak  # noqa: E402
from benchmarks.common import rss_bytes as _status  # noqa: E402

sys.path.remove(ROOT)  # the timed `keras_cutbce`: PYTHONPATH's (`--before`'s checkout) first
sys.path.append(ROOT)


def _inputs(shape, seed=0):
    import numpy as np

    rows, dim, vocab = shape
    rng = np.random.default_rng(seed)
    hidden = (rng.normal(size=(rows, dim)) / np.sqrt(dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    bias = (rng.normal(size=(vocab,)) * 0.1).astype("float32")
    ids = rng.integers(0, vocab, size=(rows, 8)).astype("int32")
    return hidden, table, bias, ids


def _multi_hot_numpy(ids, vocab):
    """Float32 `[rows, V]` multi-hot built by a scatter (no `[rows, L, V]` one-hot)."""
    import numpy as np

    targets = np.zeros((ids.shape[0], vocab), "float32")
    targets[np.arange(ids.shape[0])[:, None], ids] = 1.0
    return targets


def _value_and_grad_fn(backend, loss_fn):
    """A compiled function `(h, E, b, *constants) -> (loss, grads of h, E, b)`.

    Large constants (the dense targets) are arguments, not closures: a jitted
    closure would embed them in the program.
    """
    if backend == "jax":
        import jax

        return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step(h, t, b, *constants):
            with tf.GradientTape() as tape:
                tape.watch([h, t, b])
                value = loss_fn(h, t, b, *constants)
            return value, tape.gradient(value, [h, t, b])

        return step
    import torch

    def step(h, t, b, *constants):
        h, t, b = (x.detach().requires_grad_(True) for x in (h, t, b))
        value = loss_fn(h, t, b, *constants)
        return value, torch.autograd.grad(value, (h, t, b))

    return step


def _leaves(result):
    """The tensors of a nested tuple/list result.

    (Not `keras.tree.flatten`: on torch its recursive helper closures form a
    reference cycle that keeps the result, e.g. a 128 MB table gradient,
    alive until the garbage collector runs, inflating the next run's peak.)
    """
    if isinstance(result, (tuple, list)):
        return [leaf for item in result for leaf in _leaves(item)]
    return [] if result is None else [result]


def _block(result):
    """Waits until every tensor of `result` is computed, without copying it to the host.

    (Not `.numpy()` on a TensorFlow tensor: that copies it, e.g. a 128 MB
    table gradient, into a new NumPy array, which the memory figures would
    count. One element is read instead.)
    """
    import keras

    for x in _leaves(result):
        if hasattr(x, "block_until_ready"):
            x.block_until_ready()
        elif hasattr(x, "detach"):  # torch: CPU ops have run when they return
            x.detach()
        elif hasattr(x, "numpy"):  # TensorFlow
            import tensorflow as tf

            tf.reshape(x, [-1])[:1].numpy()
        else:
            keras.ops.convert_to_numpy(x)


def _variant_fn(backend, variant, shape):
    """Returns `(run, inputs)` for one variant; `run(*inputs)` does the timed work."""
    import keras
    from keras import ops

    from keras_cutbce import cut_binary_crossentropy
    from keras_cutbce.ops import cut_top_k

    hidden, table, bias, ids = (ops.convert_to_tensor(x) for x in _inputs(shape))
    rows, dim, vocab = shape
    if variant == "dense":
        targets = ops.convert_to_tensor(_multi_hot_numpy(_inputs(shape)[3], vocab))

        def loss(h, t, b, targets):
            logits = ops.matmul(h, ops.transpose(t)) + b
            return ops.sum(keras.losses.binary_crossentropy(targets, logits, from_logits=True))

        return _value_and_grad_fn(backend, loss), (hidden, table, bias, targets)
    if variant == "cutbce":

        def loss(h, t, b):
            return ops.sum(cut_binary_crossentropy(h, t, ids, b, implementation="chunked"))

        return _value_and_grad_fn(backend, loss), (hidden, table, bias)
    if variant == "cutbce_loss":
        from keras_cutbce.ops import weighted_loss_sum

        weights = ops.ones((rows,), "float32")

        def loss(h, t, b):
            return weighted_loss_sum(h, t, ids, weights, b, implementation="chunked")

        return _value_and_grad_fn(backend, loss), (hidden, table, bias)
    if variant == "matmuls":
        grad_logits = ops.convert_to_tensor(
            __import__("numpy").random.default_rng(1).normal(size=(rows, vocab)).astype("float32")
        )

        def three(h, t, dz):
            return (ops.matmul(h, ops.transpose(t)), ops.matmul(dz, t), ops.matmul(ops.transpose(dz), h))

        if backend == "jax":
            import jax

            three = jax.jit(three)
        elif backend == "tensorflow":
            import tensorflow as tf

            three = tf.function(three)
        return three, (hidden, table, grad_logits)
    if variant == "elementwise":
        import jax
        import jax.numpy as jnp

        z = jnp.asarray(__import__("numpy").random.default_rng(1).normal(size=(rows, vocab)).astype("float32"))

        @jax.jit
        def softplus_and_sigmoid(z):
            e = jnp.exp(-jnp.abs(z))
            return jnp.maximum(z, 0) + jnp.log1p(e), jnp.where(z >= 0, 1.0, e) / (1.0 + e)

        return softplus_and_sigmoid, (z,)
    if variant == "topk_dense":

        def dense_top_k(h, t, b):
            return ops.top_k(ops.matmul(h, ops.transpose(t)) + b, TOP_K)

        if backend == "jax":
            import jax

            dense_top_k = jax.jit(dense_top_k)
        elif backend == "tensorflow":
            import tensorflow as tf

            dense_top_k = tf.function(dense_top_k)
        return dense_top_k, (hidden, table, bias)
    if variant == "topk_cut":
        run = lambda h, t, b: cut_top_k(h, t, TOP_K, bias=b)  # noqa: E731
        if backend == "jax":
            import jax

            run = jax.jit(run)
        elif backend == "tensorflow":
            import tensorflow as tf

            run = tf.function(run)
        return run, (hidden, table, bias)
    raise ValueError(f"unknown variant {variant!r}")


def _threads(value):
    """`--threads` as an int, or None for the backend's own default ("default")."""
    return None if value in (None, "default") else int(value)


def _set_threads(backend, threads):
    """Sets the backend's thread counts in this process (None: leave the defaults).

    Returns the intra-op thread count the backend uses (None where it
    cannot tell).
    """
    if backend == "torch":
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        return torch.get_num_threads()
    if backend == "tensorflow" and threads is not None:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    return threads


def _thread_env(env, threads):
    """`env` with XLA's CPU client pinned to one thread when `threads` is 1 (it reads the flags)."""
    env = dict(env)
    if threads == 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                            " intra_op_parallelism_threads=1").strip()
    return env


def worker(args):
    """Runs one (backend, variant, shape) in this process and prints a JSON line."""
    backend = os.environ["KERAS_BACKEND"]
    threads_used = _set_threads(backend, _threads(args.threads))
    shape = tuple(int(x) for x in args.shape.split(","))
    run, inputs = _variant_fn(backend, args.variant, shape)
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    if backend == "torch" and args.variant.startswith("topk"):
        import torch

        with torch.no_grad():
            _block(run(*inputs))
    else:
        _block(run(*inputs))  # warm-up (compiles)
    first = time.perf_counter() - start
    first_peak = _status("VmHWM")
    gc.collect()
    _reset_peak()  # the timed runs' own peak (tracing/compilation excluded)
    times = []
    for _ in range(args.repeats):
        gc.collect()  # untimed: the previous result is gone before the next run
        start = time.perf_counter()
        _block(run(*inputs))
        times.append(time.perf_counter() - start)
    peak = _status("VmHWM")
    emit_row(({
        "median_s": statistics.median(times), "times_s": times, "first_s": first,
        "peak_extra_mb": (peak - before) / 2**20,
        "first_call_peak_extra_mb": (first_peak - before) / 2**20,
        "threads": threads_used,
    }))


# ------------------------------------------------------------ side by side ---

SIDE_BY_SIDE_TARGETS = {"loss": 0.35, "op": 0.5}


def _pure_jax_operator(ids, tile):
    """A pure-JAX chunked BCE: `lax.scan` over vocabulary tiles under `jax.checkpoint`.

    The operator a JAX user writes from the CutBCE/CCE idea without custom
    kernels: per tile the logits, the tile's multi-hot from L compares, the
    stable `softplus(z) - y z` (not exact at saturated positives), and
    autodiff for the backward pass (which recomputes each tile's logits).
    """
    import jax
    import jax.numpy as jnp

    def loss(h, t, b):
        vocab = t.shape[0]

        @jax.checkpoint
        def body(total, start):
            t_tile = jax.lax.dynamic_slice_in_dim(t, start, tile)
            z = h @ t_tile.T + jax.lax.dynamic_slice_in_dim(b, start, tile)
            columns = start + jnp.arange(tile)
            y = jnp.any(ids[:, :, None] == columns, axis=1).astype(z.dtype)
            terms = jnp.maximum(z, 0.0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))
            return total + jnp.sum(terms, axis=1), None

        starts = jnp.arange(0, vocab, tile)
        total, _ = jax.lax.scan(body, jnp.zeros(h.shape[:1], jnp.float32), starts)
        return jnp.sum(total / vocab)

    return loss


def _side_by_side_fns(backend, shape):
    """`name -> (run, inputs)`: dense, the loss and op, on JAX the pure-JAX op; and the tile."""
    from keras import ops

    from keras_cutbce import cut_binary_crossentropy
    from keras_cutbce.ops import weighted_loss_sum
    from keras_cutbce.math.tiling import default_chunk_size, max_tile, tile_budget_bytes

    fns = {"dense": _variant_fn(backend, "dense", shape)}
    hidden, table, bias, ids = (ops.convert_to_tensor(x) for x in _inputs(shape))
    rows, _, vocab = shape
    weights = ops.ones((rows,), "float32")
    # The tile the public API picks for these shapes (`chunk_size=None`).
    budget = tile_budget_bytes(backend, "cpu", table_bytes=4 * vocab * shape[1])
    tile = default_chunk_size(rows, vocab, budget, max_tile(backend, "cpu"))

    def loss(h, t, b):
        return weighted_loss_sum(h, t, ids, weights, b, implementation="chunked")

    def op(h, t, b):
        return ops.sum(cut_binary_crossentropy(h, t, ids, b, implementation="chunked"))

    inputs = (hidden, table, bias)
    fns["loss"] = (_value_and_grad_fn(backend, loss), inputs)
    fns["op"] = (_value_and_grad_fn(backend, op), inputs)
    if backend == "jax" and vocab % tile == 0:
        fns["pure_jax"] = (_value_and_grad_fn(backend, _pure_jax_operator(ids, tile)), inputs)
    return fns, tile


def side_by_side_worker(args):
    """Times every side-by-side variant in this one process, alternating; prints a `ROW` line."""
    backend = os.environ["KERAS_BACKEND"]
    threads_used = _set_threads(backend, _threads(args.threads))
    shape = tuple(int(x) for x in args.shape.split(","))
    fns, tile = _side_by_side_fns(backend, shape)
    timed = alternate({n: (lambda run=run, x=x: run(*x)) for n, (run, x) in fns.items()},
                      args.repeats, block=_block)
    emit_row({
        "tile": tile, "cells": timed, "commit": commit(),
        "median_s": {name: cell["wall"]["median"] for name, cell in timed.items()},
        "median_cpu_s": {name: cell["cpu"]["median"] for name, cell in timed.items()},
        "loadavg": os.getloadavg(), "threads": threads_used,
    })


def _roots(args):
    """`label -> checkout`: this one ("after"), and `--before`'s first when given."""
    return {"before": os.path.abspath(args.before), "after": ROOT} if args.before else {"after": ROOT}


def _thread_settings(value):
    """`--threads` of `--side-by-side`: a comma list of counts and/or "default"."""
    return [item.strip() for item in str(value).split(",") if item.strip()]


def side_by_side(args):
    """One process per backend, thread setting and checkout: dense, loss, op, alternating."""
    shape = tuple(int(x) for x in (args.shapes or "4096,64,32768").split(";")[0].split(","))
    settings = _thread_settings(args.threads)
    roots = _roots(args)
    results = {"shape": shape, "repeats": args.repeats, "threads": settings, "roots": roots,
               "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "backends": {}}
    for backend in args.backends.split(","):
        for threads in settings:
            for label, root in roots.items():  # the checkouts alternate, backend by backend
                name = backend if label == "after" else f"{backend} ({label})"
                entry = run_variant(backend, "side_by_side", shape, args.repeats, threads,
                                    args.memory_cap_gb * 2**30, root)
                results["backends"].setdefault(name, {})[threads] = entry
                print(name, threads, entry.get("median_s", entry), flush=True)
    results["loadavg_end"] = os.getloadavg()
    lines = _side_by_side_table(results)
    print("\n".join(lines))
    out = args.out + "_side_by_side"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(_side_by_side_header(results, args) + "\n".join(lines) + "\n")


SIDE_BY_SIDE_LABELS = {
    "loss": "loss (`weighted_loss_sum`)", "op": "op (`cut_binary_crossentropy`)",
    "pure_jax": "pure-JAX op (reference)",
}


def _threads_label(threads):
    return "default threads" if threads == "default" else f"{threads} thread" + ("s" if threads != "1" else "")


def _side_by_side_table(results):
    """Markdown rows: per variant, for each thread setting, wall s, wall / dense and CPU / dense."""
    settings = results["threads"]
    head = "| backend | tile | variant |"
    rule = "|---|---|---|"
    for threads in settings:
        label = _threads_label(threads)
        head += f" wall s, {label} | wall / dense, {label} | CPU / dense, {label} |"
        rule += "---|---|---|"
    lines = [head + " target |", rule + "---|"]
    for backend, by_threads in results["backends"].items():
        entries = [by_threads.get(threads, {"error": "not run"}) for threads in settings]
        ok = [e for e in entries if "error" not in e]
        if not ok:
            lines.append(f"| {backend} | - | {entries[0]['error']} |" + " |" * (3 * len(settings) + 1))
            continue
        tile = ok[0]["tile"]
        for key in ["dense"] + list(SIDE_BY_SIDE_LABELS):
            if key not in ok[0]["median_s"]:
                continue
            label = "dense Keras BCE" if key == "dense" else SIDE_BY_SIDE_LABELS[key]
            row = f"| {backend} | {tile} | {label} |"
            for entry in entries:
                if "error" in entry:
                    row += f" {entry['error'][:60]} | | |"
                    continue
                wall, cpu = entry["median_s"], entry["median_cpu_s"]
                row += (f" {wall[key]:.3f} | {wall[key] / wall['dense']:.3f} | "
                        f"{cpu[key] / cpu['dense']:.3f} |")
            target = SIDE_BY_SIDE_TARGETS.get(key)
            lines.append(row + f" {'' if target is None else f'<= {target}'} |")
    return lines


def _side_by_side_header(results, args):
    shape = ", ".join(map(str, results["shape"]))
    load = lambda v: ", ".join(f"{x:.1f}" for x in v)  # noqa: E731
    commits = ", ".join(f"{label} = `{root}` ({commit(root)})" for label, root in results["roots"].items())
    return (
        f"# CutBCE side by side with dense Keras BCE, (M, D, V) = ({shape}), float32, CPU\n\n"
        f"Forward + gradients of h, E, b. Each backend in one process: every variant once per "
        f"round, {results['repeats']} rounds after a warm-up round, medians; ratios over the same "
        f"process's dense BCE, in wall time and in the process's CPU time (all its threads; "
        "steadier than wall time on a loaded machine). loss = `weighted_loss_sum` (what `CutBCELoss` runs), op = "
        f"`sum(cut_binary_crossentropy)` (exact for any cotangent); pure-JAX op = "
        "`lax.scan` over tiles under `jax.checkpoint` with autodiff (a reference written here, "
        f"not exact at saturated positives). {results['cpus']} cores; one process per thread "
        f"setting ({', '.join(results['threads'])}): \"default\" leaves torch, TensorFlow and "
        "XLA at their own thread counts, as users run them (wall time is what they see); "
        "1 pins all three to one thread (CPU-time ratios without waits at thread barriers). "
        "Load average (1, 5, 15 min) at start "
        f"{load(results['loadavg_start'])}, at end {load(results['loadavg_end'])} (a shared, "
        f"loaded machine: ratios are the stable figures, absolute seconds are not). Checkouts: {commits}.\n\n"
        "Command: `python benchmarks/cutbce_cpu.py --side-by-side"
        + (f" --backends {args.backends}" if args.backends != ",".join(BACKENDS) else "")
        + (f" --before {args.before}" if args.before else "")
        + f" --repeats {args.repeats} --threads {','.join(results['threads'])}`\n\n"
    )


def run_variant(backend, variant, shape, repeats, threads, cap_bytes, root=ROOT):
    """Runs `worker` in a subprocess importing the checkout at `root`, killing it if its RSS passes `cap_bytes`."""
    env = _thread_env(dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3"),
                      _threads(threads))
    env["PYTHONPATH"] = root
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant,
           "--shape", ",".join(map(str, shape)), "--repeats", str(repeats), "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    killed = {"oom": False}

    def watch():
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next((int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:")), 0)
            except OSError:
                return
            if rss > cap_bytes:
                killed["oom"] = True
                proc.kill()
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    out, err = proc.communicate()
    if killed["oom"]:
        return {"error": f"out of memory (RSS > {cap_bytes / 2**30:.0f} GiB, killed)"}
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["?"])[-1]
        return {"error": f"failed: {last[:200]}"}
    return json.loads([line for line in out.splitlines() if line.startswith("ROW ")][-1][4:])


MEMORY_SHAPE = (1024, 128, 262144)
MEMORY_TARGET_MB = 300


def memory(args):
    """The memory table: extra peak RSS of one forward + backward of the loss path.

    Per backend, `weighted_loss_sum` (what `fit` runs) at `MEMORY_SHAPE` in a
    fresh process (`worker`, variant `cutbce_loss`): the peak RSS of the
    timed runs above the RSS once the inputs exist, compilation excluded
    (and the first call's, compilation included). With `--before`, the
    same for that checkout's package, in its own processes.
    """
    shape = tuple(int(x) for x in args.shapes.split(",")) if args.shapes else MEMORY_SHAPE
    threads = args.threads or "default"
    roots = _roots(args)
    cap = args.memory_cap_gb * 2**30
    results = {"shape": shape, "repeats": args.repeats, "threads": threads, "roots": roots,
               "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "backends": {}}
    for backend in args.backends.split(","):
        results["backends"][backend] = {}
        for label, root in roots.items():
            entry = run_variant(backend, "cutbce_loss", shape, args.repeats, threads, cap,
                                root)
            results["backends"][backend][label] = entry
            print(backend, label, entry, flush=True)
    results["loadavg_end"] = os.getloadavg()
    head = "| backend |" + "".join(f" {label} MB | {label} first call MB |" for label in roots)
    lines = [head + " target |", "|---|" + "---|---|" * len(roots) + "---|"]
    for backend, by_root in results["backends"].items():
        row = f"| {backend} |"
        for label in roots:
            row += f" {_fmt(by_root[label], 'peak_extra_mb', 0)} |"
            row += f" {_fmt(by_root[label], 'first_call_peak_extra_mb', 0)} |"
        lines.append(row + f" < {MEMORY_TARGET_MB} |")
    print("\n".join(lines))
    out = args.out + "_memory"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    rows, dim, vocab = shape
    commits = ", ".join(f"{label} = `{root}` ({commit(root)})" for label, root in roots.items())
    with open(out + ".md", "w") as f:
        f.write(
            f"# CutBCE loss path memory, (M, D, V) = ({rows}, {dim}, {vocab}), float32, CPU\n\n"
            "Extra peak RSS of one forward + backward (gradients of h, E, b) of "
            "`weighted_loss_sum` (what `CutBCELoss` runs in `fit`), `implementation=\"chunked\"`, "
            "each in a fresh process: the peak RSS of the timed runs above the RSS once the "
            "inputs exist (`/proc/self/clear_refs` resets the peak after the warm-up call); "
            "\"first call\" includes tracing and compilation. The `[V, D]` table gradient alone "
            f"is {vocab * dim * 4 / 2**20:.0f} MB. Checkouts: {commits}. Threads: {threads}; max of {args.repeats} timed runs. Load average "
            f"(1, 5, 15 min) at the end: {', '.join(f'{v:.1f}' for v in results['loadavg_end'])} "
            "(a shared machine).\n\n"
            f"Command: `python benchmarks/cutbce_cpu.py --memory"
            + (f" --before {args.before}" if args.before else "")
            + f" --backends {args.backends} --repeats {args.repeats}`\n\n"
        )
        f.write("\n".join(lines) + "\n")


# ----------------------------------------------------------------- softmax ---

SOFTMAX_SHAPES = [(4096, 64, 32768), (1024, 128, 262144)]
SOFTMAX_GOALS = "<= 0.5x dense time; < 300 MB extra peak at (1024, 128, 262144); no slower than F.linear_cross_entropy"


def _softmax_cells(backend, shape, variants):
    """name -> `(run, inputs)`: loss + gradients of h, E, b, one target a position."""
    import keras
    from keras import ops

    from keras_cutbce import checks
    from keras_cutbce import cut_categorical_crossentropy
    from keras_cutbce import ops as cut_ops

    hidden, table, bias, ids = _inputs(shape)
    ids = ids[:, 0]
    h, t, b, i = (ops.convert_to_tensor(x) for x in (hidden, table, bias, ids))
    options = checks.loss_options(implementation="auto", family="softmax")
    weights = ops.ones((shape[0],), "float32")

    def dense(h, t, b):
        logits = ops.matmul(h, ops.transpose(t)) + b
        return ops.sum(keras.losses.sparse_categorical_crossentropy(i, logits, from_logits=True))

    def loss(h, t, b):  # what `CutSoftmaxLoss` runs (its fused weighted sum)
        return cut_ops.loss_sum(cut_ops.loss_inputs(h, t, i, b), options, weights)

    def op(h, t, b):
        return ops.sum(cut_categorical_crossentropy(h, t, i, b))

    cells = {"dense": dense, "cut_loss": loss, "cut_op": op}
    cells = {name: (_value_and_grad_fn(backend, fn), (h, t, b)) for name, fn in cells.items()}
    if backend == "torch":
        import torch
        import torch.nn.functional as F

        target = torch.as_tensor(ids).long()

        def torch_lce(chunked):
            options = torch.nn.LinearCrossEntropyOptions() if chunked else None

            def run(h, t, b):  # `backward()`: the chunked path's gradients are not `autograd.grad`'s
                h, t, b = (x.detach().requires_grad_(True) for x in (h, t, b))
                value = F.linear_cross_entropy(h, t, target, linear_bias=b, reduction="sum", options=options)
                value.backward()
                return value, (h.grad, t.grad, b.grad)

            return run, (h, t, b)

        cells["torch_lce_chunked"] = torch_lce(True)
        cells["torch_lce"] = torch_lce(False)
    return {name: cell for name, cell in cells.items() if not variants or name in variants}


def softmax_cell(args):
    """In this process: the softmax cells of one backend, alternating (`--softmax-cell time`) or
    one cell's extra peak RSS (`--softmax-cell memory --variant NAME`); prints a `ROW` line."""
    from benchmarks.common import alternate, emit_row

    backend = os.environ["KERAS_BACKEND"]
    threads = _set_threads(backend, _threads(args.threads))
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.softmax_cell == "time":
        cells = _softmax_cells(backend, shape, args.variants and args.variants.split(","))
        timed = alternate({n: (lambda run=run, x=x: run(*x)) for n, (run, x) in cells.items()},
                          args.repeats, block=_block)
        return emit_row({"threads": threads, "loadavg": os.getloadavg(), "cells": timed})
    run, inputs = _softmax_cells(backend, shape, [args.variant])[args.variant]
    before = _status("VmRSS")
    _reset_peak()
    _block(run(*inputs))  # warm-up: tracing and compilation
    first = _status("VmHWM")
    gc.collect()
    _reset_peak()
    peaks = []
    for _ in range(args.repeats):
        gc.collect()
        _block(run(*inputs))
        peaks.append((_status("VmHWM") - before) / 2**20)
    emit_row({"threads": threads, "peak_extra_mb": max(peaks),
              "first_call_peak_extra_mb": (first - before) / 2**20})


SOFTMAX_LABELS = {
    "dense": "dense Keras (`sparse_categorical_crossentropy`, logits from a matmul)",
    "cut_loss": "`CutSoftmaxLoss` path (`loss_sum`, auto)", "cut_op": "`cut_categorical_crossentropy` (auto)",
    "torch_lce_chunked": "`F.linear_cross_entropy`, chunked options", "torch_lce": "`F.linear_cross_entropy`, reference",
}


def _softmax_lines(rows):
    """The softmax table's markdown lines; ratios over the same process's dense and F.lce cells."""
    lines = ["| backend | M, D, V | implementation | wall s, median (min-max) | CPU s, median (min-max) | "
             "wall / dense | CPU / dense | CPU / F.lce chunked | extra peak MB | first call MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    for row in rows:
        same = {r["implementation"]: r for r in rows if (r["backend"], r["shape"]) == (row["backend"], row["shape"])}
        over = lambda other, key: (row[key]["median"] / same[other][key]["median"]  # noqa: E731
                                   if key in row and key in same.get(other, {}) else None)
        spreads = [fmt_spread(row[key]) if key in row else "-" for key in ("wall", "cpu")]
        lines.append(
            f"| {row['backend']} | {', '.join(map(str, row['shape']))} | {SOFTMAX_LABELS[row['implementation']]} | "
            f"{spreads[0]} | {spreads[1]} | {fmt(over('dense', 'wall'))} | "
            f"{fmt(over('dense', 'cpu'))} | {fmt(over('torch_lce_chunked', 'cpu'))} | "
            f"{fmt(row.get('peak_extra_mb'), '.0f')} | {fmt(row.get('first_call_peak_extra_mb'), '.0f')} |")
    return lines


SOFTMAX_WHAT = (
    "Softmax cross-entropy over the full vocabulary, one target id a position, float32, CPU: loss plus "
    "gradients of hidden, table and bias. Per backend and shape one process times every implementation "
    "alternating (one call of each per round, {repeats} rounds after a warm-up round; jit / tf.function on "
    "JAX / TensorFlow, eager on torch): wall and CPU seconds of a call, median (min-max); ratios over the "
    "same process's dense (and, on torch, `F.linear_cross_entropy` with chunking options) medians. Extra "
    "peak MB (at (1024, 128, 262144)): a fresh process per implementation, the peak RSS of one call after "
    "the warm-up above the RSS once the inputs exist (`/proc/self/clear_refs`), as the BCE memory table; "
    "first call MB includes tracing and compilation. `CutSoftmaxLoss` runs `implementation=\"auto\"`: "
    "the chunked implementation on CPU. Threads: {threads} (torch `set_num_threads`, TensorFlow "
    "intra/inter-op, XLA's CPU client single-threaded at 1), on a 2-core machine shared with other jobs "
    "(load average in the machine line: on a loaded machine wall time includes waiting for a core, CPU "
    "time does not). Goals: " + SOFTMAX_GOALS + "."
)


def softmax(args):
    """The softmax table: per backend and shape, one process timing every cell alternating, then one
    fresh process per cell for its extra peak RSS (at `MEMORY_SHAPE`)."""
    from benchmarks.common import machine_info, run_cell, write_results

    shapes = SOFTMAX_SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split(";")]
    threads = args.threads or "1"
    info = machine_info(threads=threads)
    rows = []
    script = os.path.relpath(os.path.abspath(__file__), ROOT)
    for backend in args.backends.split(","):
        env = _thread_env(dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3"), _threads(threads))
        for shape in shapes:
            common = [script, "--shape", ",".join(map(str, shape)), "--threads", threads]
            try:
                timed = run_cell(common + ["--softmax-cell", "time", "--repeats", str(args.repeats)]
                                 + (["--variants", args.variants] if args.variants else []), ROOT, env)
            except RuntimeError as error:
                print(backend, shape, str(error)[-300:], flush=True)
                continue
            for name, cell in timed["cells"].items():
                if shape == MEMORY_SHAPE:
                    try:
                        cell.update(run_cell(common + ["--softmax-cell", "memory", "--variant", name,
                                                       "--repeats", "1"], ROOT, env))
                    except RuntimeError as error:
                        cell["memory_error"] = str(error)[-300:]
                rows.append({"backend": backend, "shape": shape, "implementation": name, **cell})
            print("\n".join(_softmax_lines(rows)[-len(timed["cells"]):]), flush=True)
    info["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    write_results(args.out + "_softmax", "Softmax cross-entropy without logits vs dense, CPU",
                  SOFTMAX_WHAT.format(repeats=args.repeats, threads=threads), None, info,
                  "\n".join(_softmax_lines(rows)), {"repeats": args.repeats, "rows": rows})


def _fmt(entry, key="median_s", digits=3):
    if entry is None:
        return "-"
    if "error" in entry:
        return entry["error"]
    return f"{entry[key]:.{digits}f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape, 2 repeats")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--shapes", help="M,D,V shapes separated by ';' (default: all three)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", default=None,
                        help='intra-op threads: an int or "default" (the backends\' own); with '
                             '--side-by-side a comma list (default "default,1")')
    parser.add_argument("--variants", help="comma list of the table's variants (default: all)")
    parser.add_argument("--memory", action="store_true",
                        help="the memory table: extra peak RSS of the loss path (and --before's)")
    parser.add_argument("--memory-cap-gb", type=float, default=16.0)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cutbce_cpu"))
    parser.add_argument("--side-by-side", action="store_true",
                        help="dense, loss and op alternating in one process per backend (and checkout)")
    parser.add_argument("--before", help="another checkout: --side-by-side and --memory run there too, alternating")
    parser.add_argument("--softmax", action="store_true",
                        help="the softmax table: CutSoftmaxLoss / cut_categorical_crossentropy vs dense "
                             "(and F.linear_cross_entropy on torch), alternating; --threads default 1")
    parser.add_argument("--softmax-cell", choices=("time", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.softmax_cell:
        return softmax_cell(args)
    if args.softmax:
        return softmax(args)
    if args.worker:
        return side_by_side_worker(args) if args.variant == "side_by_side" else worker(args)
    if args.side_by_side:
        if args.threads is None:
            args.threads = "default,1"
        return side_by_side(args)
    if args.memory:
        return memory(args)

    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split(";")]
    repeats = 2 if args.quick else args.repeats
    cap = args.memory_cap_gb * 2**30
    args.threads = args.threads or "default"
    variants = ("dense", "cutbce", "cutbce_loss", "matmuls", "topk_dense", "topk_cut")
    if args.variants:
        variants = tuple(v for v in variants if v in args.variants.split(","))
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "threads": args.threads}, "rows": []}
    lines = [
        "| backend | M, D, V | dense s | CutBCELoss s | loss/dense | target | op s | op/dense | matmuls s | elementwise s | loss/floor | dense extra MB | loss extra MB | loss/dense mem | top-k dense s | cut_top_k s | top-k dense MB | cut_top_k MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    elementwise = {
        shape: run_variant("jax", "elementwise", shape, repeats, args.threads, cap)
        if "matmuls" in variants else None for shape in shapes
    }
    for backend in args.backends.split(","):
        for shape in shapes:
            row = {"backend": backend, "shape": shape, "elementwise": elementwise[shape]}
            for variant in variants:
                reps = max(2, repeats // 2) if variant == "dense" else repeats
                row[variant] = run_variant(backend, variant, shape, reps, args.threads, cap)
                print(backend, shape, variant, row[variant], flush=True)
            dense, op, mm, ew = (row.get(k) for k in ("dense", "cutbce", "matmuls", "elementwise"))
            cut = row.get("cutbce_loss")
            ok = lambda e: e is not None and "error" not in e  # noqa: E731
            row["time_ratio"] = cut["median_s"] / dense["median_s"] if ok(dense) and ok(cut) else None
            row["op_time_ratio"] = op["median_s"] / dense["median_s"] if ok(dense) and ok(op) else None
            row["floor_s"] = mm["median_s"] + ew["median_s"] if ok(mm) and ok(ew) else None
            row["floor_ratio"] = cut["median_s"] / row["floor_s"] if ok(cut) and row["floor_s"] else None
            row["memory_ratio"] = (cut["peak_extra_mb"] / dense["peak_extra_mb"]
                                   if ok(dense) and ok(cut) and dense["peak_extra_mb"] > 0 else None)
            results["rows"].append(row)
            r = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            lines.append(
                f"| {backend} | {shape[0]}, {shape[1]}, {shape[2]} | {_fmt(dense)} | {_fmt(cut)} | "
                f"{r(row['time_ratio'])} | <= {TARGETS.get(shape[2], '-')} | {_fmt(op)} | "
                f"{r(row['op_time_ratio'])} | {_fmt(mm)} | {_fmt(ew)} | "
                f"{r(row['floor_ratio'])} | {_fmt(dense, 'peak_extra_mb', 0)} | {_fmt(cut, 'peak_extra_mb', 0)} | "
                f"{r(row['memory_ratio'])} | {_fmt(row.get('topk_dense'))} | {_fmt(row.get('topk_cut'))} | "
                f"{_fmt(row.get('topk_dense'), 'peak_extra_mb', 0)} | {_fmt(row.get('topk_cut'), 'peak_extra_mb', 0)} |"
            )
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("# CutBCE vs dense Keras BCE, forward+backward, float32, CPU\n\n")
        f.write(f"{os.cpu_count()} cores; threads {args.threads}; medians of {repeats} runs "
                "(dense: half as many) after one warm-up; floor = matmuls + elementwise; "
                "memory = peak RSS of the timed runs above the inputs (the JSON also has the "
                "warm-up's, with tracing and compilation). Load average at the end (1, 5, 15 min): "
                f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}.\n\n")
        f.write(table + "\n")


if __name__ == "__main__":
    main()
