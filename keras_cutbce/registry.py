"""Which function runs each op for each implementation, and the order `auto` tries.

`IMPLEMENTATIONS[op][implementation][backend]` is the import path
(`"module:function"`) of the function that runs `op`; `ANY_BACKEND` marks
one that runs on every backend. Modules are imported when an op first runs,
and the function is looked up on every call (so a patched module attribute is
what runs). Every backend module path is written here and nowhere else.

The ops (on 2-D inputs, ids already int32 with padding `EMPTY_ID`):

- `cut_bce(hidden [M, D], table [V, D], ids [M, L], bias [V] | None, *,
  label_smoothing, pos_weight, chunk_size) -> loss [M] float32`;
- `cut_bce_weighted_sum(hidden, table, ids, bias, row_weights [M], *,
  label_smoothing, pos_weight, chunk_size) -> scalar`: the loss and its
  gradient in one pass over the vocabulary; an implementation without it
  reduces its `cut_bce`;
- `top_k(hidden, table, k, bias, exclude_ids [M, X] | None, *, chunk_size)
  -> (scores [M, k] float32, ids [M, k] int32)`, ties to the lower id;
- `count_above(hidden, table, bias, scores [M], ids [M], exclude_ids [M, X] |
  None, *, chunk_size) -> [M] int32`, per row the items ranked above
  `(score, id)` in `top_k`'s order (a higher logit, or an equal one and a
  lower id), the item itself and the exclusions not counted (with `ids = V`:
  the logits `>= score`).

Retrieval has no ranking for a row any of whose V logits is NaN: `top_k`
gives it NaN scores and ids `EMPTY_ID`, `count_above` -1.

`"sharded"` (JAX) takes an extra `sharding=` keyword; the ops route a table
split along V over a JAX mesh to it under `"auto"` and `"chunked"`.

`AUTO_ORDER[platform]` lists what `implementation="auto"` tries on a device,
first to last: the first implementation that has the op on the active
backend, and whose library (`REQUIRES`) is installed, runs. On torch the
platform is the tensors' device (`"gpu"` for CUDA): CUDA tensors run
`"triton"` (the fused Triton kernels) when Triton is installed.
"""

import importlib
import importlib.util

__all__ = [
    "ANY_BACKEND",
    "AUTO_ORDER",
    "BACKENDS",
    "IMPLEMENTATIONS",
    "NAMES",
    "REQUIRES",
    "auto",
    "backends_of",
    "get",
    "has",
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
        "triton": {"torch": f"{_TORCH}.triton:cut_bce"},
        "sharded": {"jax": f"{_JAX}.sharded:cut_bce"},
    },
    "cut_bce_weighted_sum": {
        "chunked": {
            "jax": f"{_JAX}.chunked:cut_bce_weighted_sum",
            "torch": f"{_TORCH}.chunked:cut_bce_weighted_sum",
            "tensorflow": f"{_TF}.chunked:cut_bce_weighted_sum",
        },
        "pallas": {"jax": f"{_JAX}.pallas:cut_bce_weighted_sum"},
        "triton": {"torch": f"{_TORCH}.triton:cut_bce_weighted_sum"},
    },
    "top_k": {
        "chunked": {
            "jax": f"{_JAX}.retrieval:top_k",
            "torch": f"{_TORCH}.retrieval:top_k",
            "tensorflow": f"{_TF}.retrieval:top_k",
        },
        "sharded": {"jax": f"{_JAX}.sharded:top_k"},
    },
    "count_above": {
        "chunked": {
            "jax": f"{_JAX}.retrieval:count_above",
            "torch": f"{_TORCH}.retrieval:count_above",
            "tensorflow": f"{_TF}.retrieval:count_above",
        },
        "sharded": {"jax": f"{_JAX}.sharded:count_above"},
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


def _path(op, implementation, backend):
    paths = IMPLEMENTATIONS[op].get(implementation, {})
    return paths.get(backend, paths.get(ANY_BACKEND))


def has(op, implementation, backend):
    """Returns True when `implementation` runs `op` on the Keras `backend`.

    Example:

    >>> has("cut_bce", "reference", "torch"), has("cut_bce", "pallas", "torch")
    (True, False)
    """
    return _path(op, implementation, backend) is not None


def backends_of(implementation):
    """Returns the Keras backends on which `implementation` runs some op.

    Example:

    >>> backends_of("pallas"), backends_of("auto")
    (('jax',), ('jax', 'torch', 'tensorflow'))
    """
    if implementation == "auto":
        return BACKENDS
    return tuple(
        backend
        for backend in BACKENDS
        if any(has(op, implementation, backend) for op in IMPLEMENTATIONS)
    )


def get(op, implementation, backend):
    """Returns the function running `op` under `implementation` on `backend`.

    Raises:
        NotImplementedError: when the table has no such entry.
    """
    path = _path(op, implementation, backend)
    if path is None:
        raise NotImplementedError(
            f"CutBCE has no {implementation!r} implementation of {op!r} on the "
            f"{backend!r} backend."
        )
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _installed(implementation):
    library = REQUIRES.get(implementation)
    return library is None or importlib.util.find_spec(library) is not None


def auto(op, backend, platform):
    """Returns the implementation `"auto"` runs for `op` on `backend` and device `platform`.

    Example:

    >>> auto("cut_bce", "jax", "tpu"), auto("top_k", "jax", "tpu"), auto("cut_bce", "jax", "cpu")
    ('pallas', 'chunked', 'chunked')
    """
    for implementation in AUTO_ORDER.get(platform, _DEFAULT_ORDER):
        if has(op, implementation, backend) and _installed(implementation):
            return implementation
    raise NotImplementedError(f"CutBCE has no implementation of {op!r} on {backend!r}.")
