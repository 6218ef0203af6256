"""CutBCE and CutSoftmax vs dense Keras on CPU: forward+backward time and peak extra memory.

Every cell runs in a fresh subprocess of this script (`--cell`); sections write `--out`'s prefix plus their
suffix (`.md` and `.json`, through `benchmarks.common.write_results`):

- the full table (no flag, `full_table`): per backend and shape (M, D, V), each variant (`_bce_cells`) alone in
  a fresh process, its times and extra peak RSS;
- `--side-by-side` (`_side_by_side`): per backend and thread setting, dense, loss and op alternating;
- `--memory` (`_memory`): the extra peak RSS of the loss path at (1024, 128, 262144), `--rounds` processes;
- `--softmax` (`_softmax`): the softmax losses against dense Keras and torch's peers (`_softmax_cells`);
- `--section load` (`_load`): torch's CutSoftmax and CutBCE steps at 10^6 items, quiet and beside `--busy`
  spinning processes (about 5 minutes).

Extra peak memory: the peak RSS of the timed runs above the RSS once the inputs exist (`peak_extra_mb`; the
JSON keeps the warm-up's too). A cell whose RSS passes `--memory-cap-gb` stops itself (out of memory).
`--threads` sets torch's, TensorFlow's and (at 1) XLA's threads; "default" leaves each backend's own.

Usage:
    python benchmarks/cutbce_cpu.py            # full table (about 25 min)
    python benchmarks/cutbce_cpu.py --quick    # a small shape, to check it runs
    python benchmarks/cutbce_cpu.py --side-by-side --threads 1
    python benchmarks/cutbce_cpu.py --memory --rounds 3 --repeats 2
    python benchmarks/cutbce_cpu.py --softmax --threads 1 --repeats 3
    python benchmarks/cutbce_cpu.py --section load --repeats 3 --busy 3
"""

import argparse
import functools
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)
BACKENDS = ["jax", "torch", "tensorflow"]
SHAPES = [(4096, 64, 32768), (4096, 64, 131072), (1024, 128, 262144)]
QUICK_SHAPES = [(512, 32, 4096)]
FULL_VARIANTS = "dense,loss,op,matmuls,elementwise,topk_dense,topk_cut"
TOP_K = 10
SIDE_BY_SIDE_SHAPE = (4096, 64, 32768)
SIDE_BY_SIDE_TARGETS = {"loss": "<= 0.35", "op": "<= 0.5"}
MEMORY_SHAPE = (1024, 128, 262144)
MEMORY_TARGET_MB = 300
SOFTMAX_SHAPES = [(4096, 64, 32768), MEMORY_SHAPE]
SOFTMAX_GOALS = "<= 0.5x dense time; < 300 MB extra peak at (1024, 128, 262144); no slower than F.lce chunked nor CCE"
LOAD_SHAPE = (640, 64, 10**6)  # batch 32 x 20 positions, issue 52's step

sys.path.insert(0, ROOT)
from benchmarks.common import alternate, emit_row, fmt_spread, machine_info, markdown_table  # noqa: E402
from benchmarks.common import peak_extra_mb, rss_bytes, run_cell, set_threads  # noqa: E402
from benchmarks.common import thread_env, write_results  # noqa: E402


# ------------------------------------------------------------------ cells ---
# What a `--cell` subprocess runs: the inputs, the timed functions, the measures.


def _inputs(shape, seed=0):
    import numpy as np
    rows, dim, vocab = shape
    rng = np.random.default_rng(seed)
    hidden = (rng.normal(size=(rows, dim)) / np.sqrt(dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    bias = (rng.normal(size=(vocab,)) * 0.1).astype("float32")
    ids = rng.integers(0, vocab, size=(rows, 8)).astype("int32")
    return hidden, table, bias, ids


def _compiled(backend, fn):
    """`fn` under `jax.jit` / `tf.function`; eager on torch."""
    if backend == "jax":
        import jax
        return jax.jit(fn)
    if backend == "tensorflow":
        import tensorflow as tf
        return tf.function(fn)
    return fn


def _value_and_grad_fn(backend, loss_fn):
    """A compiled `(h, E, b, *constants) -> (loss, grads of h, E, b)`; constants (the dense targets) are
    arguments, not closures, which a jitted function would embed in its program."""
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
        return value, torch.autograd.grad(value, (h, t, b), allow_unused=True)
    return step


def _leaves(result):
    """The tensors of a nested result (not `keras.tree.flatten`, whose closures keep a torch result alive
    in a reference cycle until the garbage collector runs, inflating the next run's peak)."""
    if isinstance(result, (tuple, list)):
        return [leaf for item in result for leaf in _leaves(item)]
    return [] if result is None else [result]


def _block(result):
    """Waits until every tensor of `result` is computed without copying it to the host (on TensorFlow
    one element is read: `.numpy()` would copy a 128 MB gradient, which the memory figures would count)."""
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


def _tile(backend, shape):
    """The vocabulary tile the public API picks for `shape` on CPU (`chunk_size=None`)."""
    from keras_cutbce.math.tiling import default_tile
    rows, dim, vocab = shape
    return default_tile(backend, "cpu", rows, vocab, dim)


def _pure_jax_operator(ids, tile):
    """The chunked BCE a JAX user writes without custom kernels: `lax.scan` over vocabulary tiles under
    `jax.checkpoint`, per tile the logits, the multi-hot from L compares, the stable `softplus(z) - y z`
    (not exact at saturated positives), autodiff for the backward (recomputing each tile's logits)."""
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


def _bce_cells(backend, shape, names, use_bias=True):
    """name -> `(run, inputs)` for the BCE variants in `names`; `run(*inputs)` is the timed call."""
    def vjp(fn):  # without a bias every variant gets `b=None` (its gradient unused)
        return _value_and_grad_fn(backend, fn if use_bias else lambda h, t, b, *c: fn(h, t, None, *c))
    import numpy as np
    import keras
    from keras import ops
    from keras_cutbce import cut_binary_crossentropy
    from keras_cutbce.ops import cut_top_k, weighted_loss_sum
    hidden, table, bias, ids = (ops.convert_to_tensor(x) for x in _inputs(shape))
    rows, dim, vocab = shape
    weights = ops.ones((rows,), "float32")
    inputs = (hidden, table, bias)

    def dense():
        multi_hot = np.zeros((rows, vocab), "float32")
        multi_hot[np.arange(rows)[:, None], _inputs(shape)[3]] = 1.0  # a scatter: no [rows, L, V] one-hot
        targets = ops.convert_to_tensor(multi_hot)
        def loss(h, t, b, targets):
            logits = ops.matmul(h, ops.transpose(t)) + (0.0 if b is None else b)
            return ops.sum(keras.losses.binary_crossentropy(targets, logits, from_logits=True))
        return vjp(loss), (*inputs, targets)
    def loss():
        return vjp(lambda h, t, b: weighted_loss_sum(h, t, ids, weights, b, implementation="chunked")), inputs
    def op():
        return vjp(lambda h, t, b: ops.sum(cut_binary_crossentropy(h, t, ids, b, implementation="chunked"))), inputs
    def pure_jax():
        return _value_and_grad_fn(backend, _pure_jax_operator(ids, _tile(backend, shape))), inputs
    def matmuls():
        grad_logits = ops.convert_to_tensor(np.random.default_rng(1).normal(size=(rows, vocab)).astype("float32"))
        def three(h, t, dz):
            return (ops.matmul(h, ops.transpose(t)), ops.matmul(dz, t), ops.matmul(ops.transpose(dz), h))
        return _compiled(backend, three), (hidden, table, grad_logits)
    def elementwise():  # on JAX whatever the backend: the floor's one XLA pass
        import jax.numpy as jnp
        def softplus_and_sigmoid(z):
            e = jnp.exp(-jnp.abs(z))
            return jnp.maximum(z, 0) + jnp.log1p(e), jnp.where(z >= 0, 1.0, e) / (1.0 + e)
        z = jnp.asarray(np.random.default_rng(1).normal(size=(rows, vocab)).astype("float32"))
        return _compiled("jax", softplus_and_sigmoid), (z,)
    def topk_dense():
        return _compiled(backend, lambda h, t, b: ops.top_k(ops.matmul(h, ops.transpose(t)) + b, TOP_K)), inputs
    def topk_cut():
        return _compiled(backend, lambda h, t, b: cut_top_k(h, t, TOP_K, bias=b)), inputs
    builders = dict(dense=dense, loss=loss, op=op, pure_jax=pure_jax, matmuls=matmuls,
                    elementwise=elementwise, topk_dense=topk_dense, topk_cut=topk_cut)
    return {name: builders[name]() for name in names}


def _softmax_cells(backend, shape, names):
    """name -> `(run, inputs)`: loss + gradients of h, E, b, one target a position."""
    import keras
    from keras import ops
    from keras_cutbce import checks
    from keras_cutbce import cut_categorical_crossentropy
    from keras_cutbce.registry import run_loss
    hidden, table, bias, ids = _inputs(shape)
    ids = ids[:, 0]
    h, t, b, i = (ops.convert_to_tensor(x) for x in (hidden, table, bias, ids))
    options = checks.loss_options(implementation="auto", family="softmax")
    weights = ops.ones((shape[0],), "float32")

    def dense(h, t, b):
        logits = ops.matmul(h, ops.transpose(t)) + b
        return ops.sum(keras.losses.sparse_categorical_crossentropy(i, logits, from_logits=True))
    def loss(h, t, b):  # what `CutSoftmaxLoss` runs (its fused weighted sum)
        return run_loss(options.op, options.implementation, checks.loss_inputs(h, t, i, b),
                        row_weights=weights, **options.keywords)
    def op(h, t, b):
        return ops.sum(cut_categorical_crossentropy(h, t, i, b))
    cells = {"dense": dense, "cut_loss": loss, "cut_op": op}
    cells = {name: (_value_and_grad_fn(backend, fn), (h, t, b)) for name, fn in cells.items()}
    if backend == "torch":
        import torch
        import torch.nn.functional as F
        target = torch.as_tensor(ids).long()
        def peer(loss):
            def run(h, t, b):  # `backward()`: the chunked path's gradients are not `autograd.grad`'s
                h, t, b = (x.detach().requires_grad_(True) for x in (h, t, b))
                value = loss(h, t, b)
                value.backward()
                return value, (h.grad, t.grad, b.grad)
            return run, (h, t, b)
        lce = lambda options: peer(lambda h, t, b: F.linear_cross_entropy(  # noqa: E731
            h, t, target, linear_bias=b, reduction="sum", options=options))
        cells["torch_lce_chunked"], cells["torch_lce"] = lce(torch.nn.LinearCrossEntropyOptions()), lce(None)
        if "cce" in names:  # no bias in its API: gradients of h and E
            from cut_cross_entropy import linear_cross_entropy as cce
            cells["cce"] = peer(lambda h, t, b: cce(h, t, target, reduction="sum", filter_eps=None,
                                                    impl="torch_compile"))
    return {name: cells[name] for name in names if name in cells}


def _step_cells(backend, shape, names):
    """torch: one Adam step over h and E of `registry.run_loss` (what the Keras losses run; softmax 1 target, BCE 4)."""
    import torch
    from keras_cutbce import checks
    from keras_cutbce.registry import run_loss
    hidden, table, _, ids = (torch.as_tensor(x) for x in _inputs(shape))

    def step(family, targets):
        params = [torch.nn.Parameter(hidden.clone()), torch.nn.Parameter(table * 0.1)]
        optimizer, options = torch.optim.Adam(params, 1e-3), checks.loss_options(family=family)
        def run():
            optimizer.zero_grad(set_to_none=True)
            run_loss(options.op, options.implementation, checks.loss_inputs(*params, targets),
                     row_weights=torch.ones(shape[0]), **options.keywords).backward()
            optimizer.step()
        return run, ()
    steps = {"cut_softmax_step": ("softmax", ids[:, 0]), "cut_bce_step": ("bce", ids[:, :4])}
    return {name: step(*steps[name]) for name in names}


def _alone(run, inputs, repeats):
    """One variant alone in this process: its times and its extra peak RSS (MB), after a warm-up call."""
    base, start = rss_bytes("VmRSS"), time.perf_counter()
    _, first = peak_extra_mb(lambda: _block(run(*inputs)), base)  # the warm-up: tracing and compilation
    first_s = time.perf_counter() - start
    # the timed calls' peak above the inputs' RSS (`alternate` collects garbage before each, untimed)
    timed, peak = peak_extra_mb(lambda: alternate({"alone": lambda: run(*inputs)}, repeats, _block, 0)["alone"], base)
    return {"wall": timed["wall"], "times_s": timed["times_s"], "first_s": first_s, "peak_extra_mb": peak,
            "first_call_peak_extra_mb": first}


def _stop_above(cap_bytes):
    """Ends this process (exit 3, "out of memory" on stderr) once its RSS passes `cap_bytes`."""
    def watch():
        while rss_bytes("VmRSS") <= cap_bytes:
            time.sleep(0.05)
        print(f"out of memory (RSS > {cap_bytes / 2**30:.0f} GiB, stopped)", file=sys.stderr, flush=True)
        os._exit(3)
    threading.Thread(target=watch, daemon=True).start()


def cell(args):
    """In this process: `--variants` of one backend and shape, `alone` or `alternating`; prints a `ROW`."""
    backend = os.environ["KERAS_BACKEND"]
    row = {"threads": set_threads(backend, _threads(args.threads))}
    _stop_above(args.memory_cap_gb * 2**30)
    shape = _shape(args.shape)
    names = args.variants.split(",")
    if args.family == "bce":
        row["tile"] = _tile(backend, shape)
        if "pure_jax" in names and (backend != "jax" or shape[2] % row["tile"]):
            names.remove("pure_jax")  # its scan needs whole tiles
    family = dict(bce=functools.partial(_bce_cells, use_bias=not args.no_bias), softmax=_softmax_cells,
                  step=_step_cells)[args.family]
    cells = family(backend, shape, names)
    if args.cell == "alone":
        row.update(_alone(*cells[names[0]], args.repeats))
    else:
        row["cells"] = alternate({n: (lambda run=run, x=x: run(*x)) for n, (run, x) in cells.items()},
                                 args.repeats, block=_block)
    emit_row(row)


def _threads(value):
    """`--threads` as an int, or None for the backend's own default ("default")."""
    return None if value in (None, "default") else int(value)


# --------------------------------------------------------------- sections ---
# The parent process: which cells run where, and their tables.


def _shape(text):
    return tuple(int(x) for x in text.split(","))


def _shapes(args, default):
    return [_shape(s) for s in args.shapes.split(";")] if args.shapes else default


def _run(args, backend, threads, shape, argv):
    """One `--cell` subprocess: its `ROW`, or `{"error"}`."""
    env = thread_env(dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3"), _threads(threads))
    try:
        row = run_cell([SCRIPT, "--threads", str(threads), "--shape", ",".join(map(str, shape)),
                        "--memory-cap-gb", str(args.memory_cap_gb), "--family", args.family,
                        *(["--no-bias"] if args.no_bias else []), *argv], env)
    except RuntimeError as error:
        row = {"error": str(error).strip().splitlines()[-1][:200]}
    print(backend, threads, shape, " ".join(argv), row.get("error", "ok"), flush=True)
    return row


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _ratio(a, b):
    return a / b if a is not None and b else None


def _median(entry, key="wall"):
    return entry[key]["median"] if entry and key in entry else None


def _seconds(entry):
    """A cell's wall seconds, median (min-max); its error; or "-" when it did not run."""
    return fmt_spread(entry["wall"]) if entry and "wall" in entry else (entry or {}).get("error", "-")


def full_table(args):
    """Per backend and shape, each variant alone in a fresh process: its times and extra peak RSS."""
    shapes = _shapes(args, QUICK_SHAPES if args.quick else SHAPES)
    args.repeats = 2 if args.quick else args.repeats
    rows, table = _compare(args, args.variants or FULL_VARIANTS, shapes, [args.threads or "default"], shapes,
                           timed=False)
    what = (
        "Forward + gradients of h, E, b (top-k: forward only), float32. Each variant alone in a fresh process: "
        f"{args.repeats} timed calls after a warm-up call, wall seconds, median (min-max), and over the same "
        "shape's dense. dense = Keras BCE on the logits; loss = `weighted_loss_sum` (what `CutBCELoss` runs), "
        "op = `sum(cut_binary_crossentropy)`, both `implementation=\"chunked\"`; the floor = matmuls (`h @ E.T`, "
        "`dZ @ E`, `dZ.T @ h`) + elementwise (softplus and sigmoid of M x V values, one jit-compiled pass, JAX). "
        "Extra MB: peak RSS of the timed calls above the RSS once the inputs exist; first call MB: the "
        "warm-up's, with tracing and compilation.")
    write_results(args.out, "CutBCE vs dense Keras BCE, forward+backward, float32, CPU", what, None,
                  machine_info(threads=args.threads or "default"), table, {"repeats": args.repeats, "rows": rows})


LABELS = {
    "dense": "dense Keras", "loss": "loss (`weighted_loss_sum`)", "op": "op (`cut_binary_crossentropy`)",
    "pure_jax": "pure-JAX op (reference)", "cut_loss": "`CutSoftmaxLoss` path (`loss_sum`, auto)", "cut_op":
    "`cut_categorical_crossentropy` (auto)", "cut_softmax_step": "`CutSoftmaxLoss` step", "cut_bce_step":
    "`CutBCELoss` step (4 targets)", "cce": "Apple's `cut-cross-entropy` 25.1.1, `impl=\"torch_compile\"`, no bias",
    "torch_lce_chunked": "`F.linear_cross_entropy`, chunked options", "torch_lce": "`F.linear_cross_entropy`, reference",
    "matmuls": "matmuls (floor)", "elementwise": "elementwise (floor, JAX)", "topk_dense": "top-k of dense logits",
    "topk_cut": "`cut_top_k`",
}
SOFTMAX_VARIANTS = "dense,cut_loss,cut_op,torch_lce_chunked,torch_lce,cce"


def _compare(args, variants, shapes, settings, memory_shapes, timed=True):
    """Per backend, shape, threads and round: the variants alternating (`timed`); at `memory_shapes` each alone."""
    rows, lines = [], []
    for backend in args.backends.split(","):
        for shape in shapes:
            for threads in settings:
                for round_ in range(args.rounds):
                    where = dict(backend=backend, shape=", ".join(map(str, shape)), threads=threads, round=round_)
                    timing = _run(args, backend, threads, shape, ["--cell", "alternating", "--variants", variants,
                                                                  "--repeats", str(args.repeats)]) if timed else {}
                    cells = timing.get("cells") or {name: {} for name in variants.split(",")}
                    for name, entry in cells.items():
                        if shape in memory_shapes:
                            alone = _run(args, backend, threads, shape, ["--cell", "alone", "--variants", name,
                                                                         "--repeats", str(1 if timed else args.repeats)])
                            entry.update({k: alone[k] for k in alone if not timed or k in (
                                "peak_extra_mb", "first_call_peak_extra_mb", "error")})
                        rows.append(dict(where, variant=name, **{"tile": timing.get("tile"), **entry}))
                        over = lambda other, key: _fmt(_ratio(_median(entry, key), _median(cells.get(other), key)), ".2f")  # noqa: E731,B023
                        lines.append(dict(
                            where, variant=LABELS[name], tile=timing.get("tile") or entry.get("tile", "-"),
                            wall=_seconds(entry), cpu=fmt_spread(entry["cpu"]) if "cpu" in entry else "-",
                            wall_dense=over("dense", "wall"), cpu_dense=over("dense", "cpu"), wall_cce=over("cce", "wall"),
                            cpu_lce=over("torch_lce_chunked", "cpu"), wall_bce=over("cut_bce_step", "wall"),
                            cpu_bce=over("cut_bce_step", "cpu"), mb=_fmt(entry.get("peak_extra_mb"), ".0f"),
                            first_mb=_fmt(entry.get("first_call_peak_extra_mb"), ".0f"),
                            target=(SIDE_BY_SIDE_TARGETS.get(name, "") if args.family == "bce" and timed
                                    else f"< {MEMORY_TARGET_MB} MB" if args.memory else ""),
                            error=timing.get("error") or entry.get("error", "")))
    columns = ["backend", "shape", "threads", "round", "tile", "variant", "wall", "cpu", "wall_dense", "cpu_dense",
               "wall_cce", "cpu_lce", "wall_bce", "cpu_bce", "mb", "first_mb", "target", "error"]
    headers = ["backend", "M, D, V", "threads", "round", "tile", "variant", "wall s, median (min-max)",
               "CPU s, median (min-max)", "wall / dense", "CPU / dense", "wall / CCE", "CPU / F.lce chunked",
               "wall / CutBCE step", "CPU / CutBCE step", "extra peak MB", "first call MB", "target", "error"]
    keep = [i for i, c in enumerate(columns) if any(line[c] not in ("-", "", None) for line in lines)]
    return rows, markdown_table(lines, [columns[i] for i in keep], [headers[i] for i in keep])


TIMING = (
    "Each backend, shape and thread setting in one process: every variant once per round, {repeats} rounds "
    "after a warm-up round (jit / tf.function on JAX / TensorFlow, eager on torch); wall and CPU seconds of a "
    "call (CPU: all the process's threads, steadier than wall time on a loaded machine), median (min-max), "
    "and their medians over the same process's dense. Threads \"default\" leaves torch, TensorFlow and XLA at "
    "their own counts (wall time is what users see); 1 pins all three to one thread. ")


def _side_by_side(args):
    """Per backend and thread setting, one process: dense, loss, op (pure-JAX op) alternating."""
    rows, table = _compare(args, args.variants or "dense,loss,op,pure_jax", _shapes(args, [SIDE_BY_SIDE_SHAPE]),
                           [t.strip() for t in (args.threads or "default,1").split(",")], [])
    what = ("Forward + gradients of h, E" + (" (no bias)" if args.no_bias else ", b") + ", float32. " + TIMING.format(repeats=args.repeats) + "dense = Keras BCE "
            "on the logits; loss = `weighted_loss_sum` (what `CutBCELoss` runs), op = `sum(cut_binary_crossentropy)` "
            "(exact for any cotangent), both `implementation=\"chunked\"` at the tile the API picks; pure-JAX op = "
            "`lax.scan` over tiles under `jax.checkpoint` with autodiff (a reference written here, not exact at "
            "saturated positives).")
    write_results(args.out + "_side_by_side" + "_no_bias" * args.no_bias, "CutBCE side by side with dense Keras "
                  "BCE, float32, CPU" + ", no bias" * args.no_bias, what, None,
                  machine_info(threads=args.threads or "default,1"), table, {"repeats": args.repeats, "rows": rows})


def _memory(args):
    """Per backend, `--rounds` fresh processes: the extra peak RSS of the loss path."""
    shape = _shapes(args, [MEMORY_SHAPE])[0]
    rows, table = _compare(args, args.variants or "loss", [shape], [args.threads or "default"], [shape], timed=False)
    what = (
        "Extra peak RSS (MB) of a forward + backward (gradients of h, E, b) of `weighted_loss_sum` (what "
        "`CutBCELoss` runs in `fit`), `implementation=\"chunked\"`, float32, in a fresh process per backend and "
        f"round: the peak RSS of the timed calls (max over {args.repeats}) above the RSS once the inputs exist; "
        "first call: the warm-up's, with tracing and compilation. The `[V, D]` table gradient alone is "
        f"{shape[1] * shape[2] * 4 / 2**20:.0f} MB.")
    write_results(args.out + "_memory", "CutBCE loss path memory, float32, CPU", what, None,
                  machine_info(threads=args.threads or "default"), table, {"repeats": args.repeats, "rows": rows})


def _softmax(args):
    """Per backend and shape, the implementations alternating; at `MEMORY_SHAPE` each alone (extra peak RSS)."""
    rows, table = _compare(args, args.variants or SOFTMAX_VARIANTS, _shapes(args, SOFTMAX_SHAPES),
                           [args.threads or "1"], [MEMORY_SHAPE])
    what = (
        "Softmax cross-entropy over the full vocabulary, one target id a position, float32: loss plus gradients "
        "of hidden, table and bias. " + TIMING.format(repeats=args.repeats) + "CPU / F.lce chunked: over torch's "
        "`F.linear_cross_entropy` with chunking options; CCE: Apple's peer (compiled in the warm-up, no bias in its "
        "API: h and E only; it keeps the `[M, V]` logits). Extra peak MB (at (1024, 128, 262144)): a fresh process "
        "per implementation, the peak RSS of the timed calls above the RSS once the inputs exist; first call MB "
        "includes tracing and compilation. `CutSoftmaxLoss` runs `implementation=\"auto\"`: the chunked "
        "implementation on CPU. Goals: " + SOFTMAX_GOALS + ".")
    write_results(args.out + "_softmax", "Softmax cross-entropy without logits vs dense, CPU", what, None,
                  machine_info(threads=args.threads or "1"), table, {"repeats": args.repeats, "rows": rows})


def _load(args):
    """torch's CutSoftmax and CutBCE steps alternating in one process, quiet, then beside `--busy` spinners."""
    import subprocess
    args.family, args.backends, lines, rows = "step", "torch", [], []
    for busy in (0, args.busy):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        load = lambda: open("/proc/loadavg").read().split()[0]  # noqa: E731
        try:
            before, (part, table) = load(), _compare(args, args.variants or "cut_softmax_step,cut_bce_step",
                                                     _shapes(args, [LOAD_SHAPE]), [args.threads or "default"], [])
        finally:
            [spinner.kill() for spinner in spinners]
        lines.append(f"\n{busy} busy processes (1-minute load average {before} at the start, {load()} at the end):"
                     f"\n\n{table}")
        rows += [dict(row, busy=busy) for row in part]
    what = ("One training step at 10^6 items: `loss_sum` (what `CutSoftmaxLoss` / `CutBCELoss` run, `auto`) "
            "forward + backward + `torch.optim.Adam` over h and E. " + TIMING.format(repeats=args.repeats) +
            "Goal (issue 52): the softmax step within 1.5x of the BCE step, quiet and busy.")
    write_results(args.out + "_load", "torch CutSoftmax vs CutBCE steps under load, CPU", what, None,
                  machine_info(threads=args.threads or "default"), "\n".join(lines),
                  {"repeats": args.repeats, "rows": rows})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape, 2 repeats")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--shapes", help="M,D,V shapes separated by ';' (default: the section's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="processes per backend, shape and thread setting")
    parser.add_argument("--threads", default=None,
                        help='intra-op threads: an int or "default" (the backends\' own); with '
                             '--side-by-side a comma list (default "default,1"), with --softmax default 1')
    parser.add_argument("--variants", help="comma list of the section's variants (default: all)")
    section = parser.add_mutually_exclusive_group()
    section.add_argument("--side-by-side", action="store_true", help="dense, loss and op alternating")
    section.add_argument("--memory", action="store_true", help="extra peak RSS of the loss path")
    section.add_argument("--softmax", action="store_true",
                         help="CutSoftmaxLoss / cut_categorical_crossentropy vs dense (and F.linear_cross_entropy)")
    section.add_argument("--section", choices=("load",), help="load: the CutSoftmax / CutBCE step, quiet and busy")
    parser.add_argument("--no-bias", action="store_true", help="--side-by-side: BCE without a bias")
    parser.add_argument("--busy", type=int, default=3, help="--section load: spinning processes")
    parser.add_argument("--memory-cap-gb", type=float, default=16.0, help="a cell above this RSS stops")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cutbce_cpu"))
    parser.add_argument("--cell", choices=("alone", "alternating"), help=argparse.SUPPRESS)
    parser.add_argument("--family", choices=("bce", "softmax", "step"), default="bce", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.softmax:
        args.family = "softmax"
    (cell if args.cell else _load if args.section else _side_by_side if args.side_by_side else _memory if args.memory
     else _softmax if args.softmax else full_table)(args)


if __name__ == "__main__":
    main()
