"""Every dispatch decision: which function runs an op, for any backend, device, dtype and input.

`IMPLEMENTATIONS[op][implementation][backend]` is the import path
(`"module:function"`) of the function that runs `op`; `ANY_BACKEND` marks
one that runs on every backend. Modules are imported when an op first runs,
and the function is looked up on every call (so a patched module attribute is
what runs). Every backend module path is written here and nowhere else.

The kernel contract (every implementation, on 2-D inputs the public ops have
checked: ids int32 with padding `EMPTY_ID`; the kernels trust their inputs):

- `cut_bce(hidden [M, D], table [V, D], ids [M, L], bias [V] | None, *,
  label_smoothing, pos_weight, chunk_size) -> loss [M] float32` (torch's
  chunked loop: float64 when an input is float64, for `gradcheck`; the public
  ops return float32 on every backend);
- `cut_bce_weighted_sum(hidden, table, ids, bias, row_weights [M], *,
  label_smoothing, pos_weight, chunk_size) -> scalar`: the loss and its
  gradient in one pass over the vocabulary; an implementation without it
  reduces its `cut_bce`;
- `cut_softmax(hidden, table, ids, bias, *, label_smoothing, chunk_size)` and
  `cut_softmax_weighted_sum(...)`: the same for the softmax cross-entropy;
- `cut_sampled_softmax(hidden, table, ids, bias, negatives [S], *, log_q [V] |
  None, negative_log_q [S] | None, remove_accidental_hits, temperature) -> loss
  [M] float32`: the softmax over each row's targets and the shared negatives
  (`keras_cutbce.math.sampled`); `"gather"` reads only those rows, on every
  backend, and takes no `chunk_size`;
- `top_k(hidden, table, k, bias, exclude_ids [M, X] | None, *, chunk_size)
  -> (scores [M, k] float32, ids [M, k] int32)`, sorted descending, ties to
  the lower id; a slot no item can fill gets `-inf` and `EMPTY_ID`; exclusions
  outside `[0, V)` are ignored (compared before any int32 cast);
- `count_above(hidden, table, bias, scores [M], ids [M], exclude_ids [M, X] |
  None, *, chunk_size) -> [M] int32`, per row the items ranked above
  `(score, id)` in `top_k`'s order (a higher logit, or an equal one and a
  lower id), the item itself and the exclusions not counted (with `ids = V`:
  the logits `>= score`).

A logit of `-inf` (an item masked by a `-inf` bias) in `cut_softmax`: the item
has probability 0 and, without label smoothing, no gradient; a valid target at
`-inf` gives the loss `+inf`, and so does any label smoothing (`a / V` on every
item), as Keras's dense loss does; a padding id adds nothing, whatever the
logit of the item it falls on. A row whose every logit is `-inf` is not
defined. In `cut_bce` without label smoothing: the item's term is 0, a target
at `-inf` gives `+inf` (the dense reference gives NaN, as Keras's dense BCE
does at any `-inf` logit); with label smoothing the loss at `-inf` is not
defined (the true value is `+inf`; the implementations differ).

Retrieval has no ranking for a row any of whose V logits is NaN: `top_k`
gives it NaN scores and ids `EMPTY_ID`, `count_above` -1.

`"sharded"` (JAX) takes an extra `sharding=` keyword; `"vocab_parallel"`
(torch: a table split along V over torch.distributed ranks) an extra
`layout=` (its `VocabLayout`), the shard as `table` and the global ids.

The routing (`dispatch`):

- a table split along V over a JAX mesh runs `"sharded"` under `"auto"` and
  `"chunked"` (read from the table's variable, so a traced value inside a
  compiled step is routed too); a table split over torch.distributed ranks
  (`ItemEmbedding(vocab_parallel=True)`) runs `"vocab_parallel"` whatever
  the implementation asked for (no other runs a shard): its BCE passes on
  the shard are the Triton kernels' where `"auto"` or `"triton"` would run
  them, else (and for softmax, whose shards need the merged statistics
  between the passes) the chunked loop's;
- `"auto"` runs the first implementation of `AUTO_ORDER[platform]` that has
  the op on the backend and whose library (`REQUIRES`) is installed. The
  platform is the one the program is compiled for (on JAX with the TPU
  compiler and no known platform, both are traced and the lowering keeps the
  platform's: `backends.jax.compile_platform`), on torch the device of the
  hidden states (`"gpu"` for CUDA);
- an implementation with a `FITS` entry runs only the inputs that entry
  accepts; the others run `"chunked"` (the Triton kernels: not float64, not
  `D > 256`, not fp32 products at full precision with `D > 128`);
- an implementation with a `DEVICES` entry runs only on the devices that
  entry accepts (the Triton kernels: CUDA GPUs whose compute capability the
  compile suite tests, sm_80, sm_86, sm_89, sm_90 and sm_100, or CPU in the interpreter): elsewhere
  `"auto"` runs `"chunked"` and naming it raises a `ValueError` saying why;
- `chunk_size=None` resolves with `math.tiling.default_tile` for the
  chunked kernels (Pallas, Triton and the sharded path choose their own tiles).
"""

import importlib
import importlib.util
import sys

import keras

from keras_cutbce.item_table import ItemTable
from keras_cutbce.math.tiling import default_tile

__all__ = [
    "ANY_BACKEND",
    "AUTO_ORDER",
    "BACKENDS",
    "DEVICES",
    "FITS",
    "IMPLEMENTATIONS",
    "NAMES",
    "REQUIRES",
    "auto",
    "backends_of",
    "check_implementation",
    "dispatch",
    "get",
    "has",
    "run_loss",
    "select_implementation",
]

ANY_BACKEND = "*"

# The Keras backends with kernels.
BACKENDS = ("jax", "torch", "tensorflow")

# The values of `implementation=` a user may pass.
NAMES = ("auto", "chunked", "pallas", "reference", "triton")

_JAX = "keras_cutbce.backends.jax"
_TORCH = "keras_cutbce.backends.torch"
_TF = "keras_cutbce.backends.tensorflow"

IMPLEMENTATIONS = {
    "cut_bce": {
        "reference": {ANY_BACKEND: "keras_cutbce.math.reference:cut_bce"},
        "chunked": {
            "jax": f"{_JAX}.chunked:cut_bce",
            "torch": f"{_TORCH}.chunked:cut_bce",
            "tensorflow": f"{_TF}.chunked:cut_bce",
        },
        "pallas": {"jax": f"{_JAX}.pallas:cut_bce"},
        "triton": {"torch": f"{_TORCH}.triton.launch:cut_bce"},
        "sharded": {"jax": f"{_JAX}.sharded:cut_bce"},
        "vocab_parallel": {"torch": f"{_TORCH}.vocab_parallel:cut_bce"},
    },
    "cut_bce_weighted_sum": {
        "chunked": {
            "jax": f"{_JAX}.chunked:cut_bce_weighted_sum",
            "torch": f"{_TORCH}.chunked:cut_bce_weighted_sum",
            "tensorflow": f"{_TF}.chunked:cut_bce_weighted_sum",
        },
        "pallas": {"jax": f"{_JAX}.pallas:cut_bce_weighted_sum"},
        "triton": {"torch": f"{_TORCH}.triton.launch:cut_bce_weighted_sum"},
    },
    "cut_softmax": {
        "reference": {ANY_BACKEND: "keras_cutbce.math.reference:cut_softmax"},
        "chunked": {
            "jax": f"{_JAX}.chunked:cut_softmax",
            "torch": f"{_TORCH}.chunked:cut_softmax",
            "tensorflow": f"{_TF}.chunked:cut_softmax",
        },
        "triton": {"torch": f"{_TORCH}.triton.launch:cut_softmax"},
        "pallas": {"jax": f"{_JAX}.pallas:cut_softmax"},
        "sharded": {"jax": f"{_JAX}.sharded:cut_softmax"},
        "vocab_parallel": {"torch": f"{_TORCH}.vocab_parallel:cut_softmax"},
    },
    "cut_softmax_weighted_sum": {
        "chunked": {
            "jax": f"{_JAX}.chunked:cut_softmax_weighted_sum",
            "torch": f"{_TORCH}.chunked:cut_softmax_weighted_sum",
            "tensorflow": f"{_TF}.chunked:cut_softmax_weighted_sum",
        },
        "triton": {"torch": f"{_TORCH}.triton.launch:cut_softmax_weighted_sum"},
        "pallas": {"jax": f"{_JAX}.pallas:cut_softmax_weighted_sum"},
    },
    "cut_sampled_softmax": {
        "gather": {ANY_BACKEND: "keras_cutbce.math.sampled:cut_sampled_softmax"},
        "reference": {ANY_BACKEND: "keras_cutbce.math.reference:cut_sampled_softmax"},
    },
    "top_k": {
        "chunked": {
            "jax": f"{_JAX}.retrieval:top_k",
            "torch": f"{_TORCH}.retrieval:top_k",
            "tensorflow": f"{_TF}.retrieval:top_k",
        },
        "sharded": {"jax": f"{_JAX}.sharded:top_k"},
        "vocab_parallel": {"torch": f"{_TORCH}.vocab_parallel:top_k"},
    },
    "count_above": {
        "chunked": {
            "jax": f"{_JAX}.retrieval:count_above",
            "torch": f"{_TORCH}.retrieval:count_above",
            "tensorflow": f"{_TF}.retrieval:count_above",
        },
        "sharded": {"jax": f"{_JAX}.sharded:count_above"},
        "vocab_parallel": {"torch": f"{_TORCH}.vocab_parallel:count_above"},
    },
}

AUTO_ORDER = {
    "tpu": ("pallas", "chunked"),
    "gpu": ("triton", "chunked"),
    "cpu": ("chunked",),
}
_DEFAULT_ORDER = ("chunked",)

# The library an implementation needs; `auto` passes over it when it is missing.
REQUIRES = {"triton": "triton"}

# An implementation's check `fits(hidden, table, bias) -> bool`; inputs it refuses run "chunked".
FITS = {"triton": f"{_TORCH}.triton.launch:fits"}

# An implementation's check of the tensors' device `problem(device) -> str | None`: a device it
# refuses runs "chunked" under "auto", and raises a ValueError with its message when named.
DEVICES = {"triton": f"{_TORCH}.triton.launch:device_problem"}


def _path(op, implementation, backend):
    paths = IMPLEMENTATIONS[op].get(implementation, {})
    return paths.get(backend, paths.get(ANY_BACKEND))


def has(op, implementation, backend):
    """Whether `implementation` runs `op` on the Keras `backend`."""
    return _path(op, implementation, backend) is not None


def backends_of(implementation):
    """The Keras backends on which `implementation` runs some op."""
    if implementation == "auto":
        return BACKENDS
    return tuple(
        backend
        for backend in BACKENDS
        if any(has(op, implementation, backend) for op in IMPLEMENTATIONS)
    )


def get(op, implementation, backend):
    """The function running `op` under `implementation` on `backend` (`NotImplementedError` if none)."""
    path = _path(op, implementation, backend)
    if path is None:
        raise NotImplementedError(
            f"CutBCE has no {implementation!r} implementation of {op!r} on the "
            f"{backend!r} backend."
        )
    return _load(path)


def _load(path):
    module, name = path.split(":")
    # An imported module from `sys.modules` (what `torch.compile` traces; `import_module` breaks its graph).
    loaded = sys.modules.get(module)
    return getattr(loaded if loaded is not None else importlib.import_module(module), name)


def _installed(implementation):
    library = REQUIRES.get(implementation)
    return library is None or importlib.util.find_spec(library) is not None


def auto(op, backend, platform):
    """The implementation `"auto"` runs for `op` on `backend` and device `platform`.

    >>> auto("cut_bce", "jax", "tpu"), auto("top_k", "jax", "tpu"), auto("cut_bce", "jax", "cpu")
    ('pallas', 'chunked', 'chunked')
    """
    for implementation in AUTO_ORDER.get(platform, _DEFAULT_ORDER):
        if has(op, implementation, backend) and _installed(implementation):
            return implementation
    raise NotImplementedError(f"CutBCE has no implementation of {op!r} on {backend!r}.")


_BACKEND_NAMES = {"jax": "JAX", "torch": "PyTorch", "tensorflow": "TensorFlow"}


def check_implementation(implementation):
    """Returns `implementation`, one of `NAMES` (`"pallas"` on JAX, `"triton"` on torch only)."""
    if not isinstance(implementation, str) or implementation not in NAMES:
        raise ValueError(
            f"`implementation` must be one of {NAMES}. "
            f"Received: implementation={implementation!r}"
        )
    backend = keras.backend.backend()
    runs_on = backends_of(implementation)
    if backend in BACKENDS and backend not in runs_on:
        names = " or ".join(_BACKEND_NAMES.get(b, b) for b in runs_on)
        raise ValueError(
            f"`implementation={implementation!r}` needs the {names} backend. "
            f"Received: the Keras backend {backend!r}"
        )
    return implementation


def _platform(tensor):
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend()
    if backend == "torch":
        return "gpu" if tensor.device.type == "cuda" else tensor.device.type
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


def _static(dim):
    """A dimension as an int, None where unknown (as `checks.static_dims` reads one; checks imports this module)."""
    try:
        return None if dim is None else int(dim)
    except TypeError:
        return None


def _compiled_platform(backend):
    if backend != "jax":
        return None
    from keras_cutbce.backends.jax import compile_platform

    return compile_platform.compiled_platform()


def select_implementation(implementation="auto"):
    """The implementation `"auto"` resolves to on this backend and the host's platform (others as given)."""
    check_implementation(implementation)
    if implementation != "auto":
        return implementation
    backend = keras.backend.backend()
    return auto("cut_bce", backend, _compiled_platform(backend))


def _usable(route, implementation, hidden, table, args):
    """Whether `route`'s `DEVICES` and `FITS` checks take these inputs (a named route's device refusal raises)."""
    problem = _load(DEVICES[route])(hidden.device) if route in DEVICES else None
    if problem and implementation == route:
        raise ValueError(problem)
    return not problem and (route not in FITS or _load(FITS[route])(hidden, table.value, args[1]))


def _route(op, implementation, hidden, table, args, backend):
    """`(route, keywords)`: what runs `op` (None: nothing), and the keywords the route adds."""
    if table.layout is not None:  # a table split over torch.distributed ranks
        if not has(op, "vocab_parallel", backend):
            return None, {}
        keywords = {"layout": table.layout}
        if op == "cut_bce":  # its shard's passes: the Triton kernels' where they would run
            wanted = auto(op, backend, _platform(hidden)) if implementation == "auto" else implementation
            usable = wanted == "triton" and _usable(wanted, implementation, hidden, table, args)
            keywords["dense"] = "triton" if usable else "chunked"
        return "vocab_parallel", keywords
    if implementation in ("auto", "chunked") and table.sharding is not None:
        if not has(op, "sharded", backend):
            return None, {}
        keywords = {"sharding": table.sharding}
        if op in ("cut_bce", "cut_softmax") and implementation == "chunked":
            keywords["kernel"] = "chunked"  # forced: the XLA loop on every shard, TPU included
        return "sharded", keywords
    route = implementation
    if implementation == "auto":
        # On torch the tensors' device decides (CUDA: the Triton kernels).
        compiled = _platform(hidden) if backend == "torch" else _compiled_platform(backend)
        route = auto(op, backend, compiled)
        tpu = auto(op, backend, "tpu")
        if compiled is None and tpu != route:  # JAX: both traced, the lowering keeps one
            return "by_platform", {"routes": (tpu, route)}
    if not _usable(route, implementation, hidden, table, args):
        route = "chunked"
    return (route if has(op, route, backend) else None), {}


def dispatch(op, implementation, hidden, table, *args, chunk_size, **kwargs):
    """Runs `op` on checked 2-D inputs (`table`: an `ItemTable`); None when the choice lacks the op."""
    backend = keras.backend.backend()
    route, keywords = _route(op, implementation, hidden, table, args, backend)
    if route is None:
        return None
    kernel = None if route == "by_platform" else get(op, route, backend)
    tiled = chunk_size is None and route in ("chunked", "vocab_parallel")  # the default tile's inputs
    if tiled:
        rows, dim = (_static(d) for d in hidden.shape)
        vocab = _static(table.value.shape[0])  # a split table: this rank's rows
        platform = _platform(hidden)
    if route == "by_platform":
        from keras_cutbce.backends.jax import compile_platform

        def run(choice):
            return lambda h, t, *a: dispatch(op, choice, h, ItemTable(t, sharding=None), *a,
                                               chunk_size=chunk_size, **kwargs)

        tpu, other = keywords["routes"]
        return compile_platform.by_platform((hidden, table.value) + args, run(tpu), run(other))
    if route in ("reference", "gather"):  # no tiles
        return kernel(hidden, table.value, *args, **kwargs)
    if tiled:
        family = "softmax" if op.startswith("cut_softmax") else "bce"
        chunk_size = default_tile(backend, platform, rows, vocab, dim, family)
    return kernel(hidden, table.value, *args, chunk_size=chunk_size, **keywords, **kwargs)


def run_loss(op, implementation, inputs, *args, row_weights=None, trained=(), **kwargs):
    """The float32 loss `op` of `LossInputs` per position, or `sum(row_weights * loss)` (fused where the op is).

    NaN for a non-finite hidden state, as Keras's dense loss. `trained`: the trainable tables' values
    (JAX: differentiating while one is a constant raises, `table_guard`).
    """
    h = inputs.hidden
    zeros = keras.ops.zeros_like(keras.ops.cast(h[:, 0], "float32"))
    nan_rows = keras.ops.where(keras.ops.all(keras.ops.isfinite(h), axis=-1), zeros, zeros + float("nan"))
    weights = None
    if row_weights is not None:  # constants
        weights = keras.ops.reshape(keras.ops.stop_gradient(keras.ops.cast(row_weights, "float32")),
                                    keras.ops.shape(zeros))
    fused = op + "_weighted_sum"
    choices = [(fused, (weights,))] if weights is not None and fused in IMPLEMENTATIONS else []
    for name, extra in choices + [(op, ())]:  # the fused reduction where the implementation has it
        loss = dispatch(name, implementation, h, inputs.table, inputs.ids, inputs.bias, *extra, *args,
                        **kwargs)
        if loss is not None:
            break
    if loss is None:
        raise NotImplementedError(
            f"{op!r} has no {implementation!r} implementation on this backend. "
            f"Received: implementation={implementation!r}"
        )
    loss = keras.ops.cast(loss, "float32")
    if name == fused:
        loss = loss + keras.ops.sum(nan_rows)
    elif weights is None:
        loss = keras.ops.reshape(loss + nan_rows, inputs.lead_shape)
    else:
        loss = keras.ops.sum(weights * (loss + nan_rows))
    if trained and keras.backend.backend() == "jax":
        from keras_cutbce.backends.jax import table_guard

        loss = table_guard.guard(loss, trained)
    return loss
