"""Constants and small helpers shared by the public API and every backend.

- `EMPTY_ID`: the id of "no item" (padding targets, empty top-k slots).
- `round_up`, `on_tpu`, `static_dims`: tiling arithmetic, the device test, static shapes.
- `is_host_array`, `concrete_values`: data on the host, and the values of
  data that can be read now (not traced).
- `ids_as_int32`: the one rule for integer ids of any width. Ids outside
  `[0, V)` are padding by contract, so they become `EMPTY_ID` *in their own
  dtype*, before the cast to int32 the kernels use. A plain cast would wrap
  an int64 id such as `2**32 + 16` to the valid item 16.
"""

import numbers

import numpy as np

__all__ = ["EMPTY_ID", "concrete_values", "ids_as_int32", "is_host_array", "on_tpu", "round_up", "static_dims"]

EMPTY_ID = -1


def round_up(value, multiple):
    """Rounds `value` up to a multiple of `multiple`.

    Example:

    >>> round_up(130, 128)
    256
    """
    return -(-int(value) // multiple) * multiple


def on_tpu():
    """Returns True when JAX's default device is a TPU (False without JAX devices)."""
    try:
        import jax

        return jax.devices()[0].platform == "tpu"
    except (ImportError, RuntimeError):
        return False


def is_host_array(ids):
    """Returns True for NumPy arrays and scalars, Python ints, lists and tuples."""
    return isinstance(ids, (np.ndarray, np.generic, list, tuple, int))


def concrete_values(x):
    """Returns `x` as a NumPy array when its values can be read now, else None.

    Host data and eager tensors can; tensors traced inside a compiled step
    (a JAX tracer, a TensorFlow graph tensor, a `KerasTensor`, a torch
    tensor on the "meta" device of Keras's symbolic build) cannot.

    Example:

    >>> concrete_values([[0, 1]]).tolist()
    [[0, 1]]
    """
    if is_host_array(x):
        return np.asarray(x)
    import keras

    if isinstance(x, keras.KerasTensor):
        return None
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if isinstance(x, jax.core.Tracer):
            return None
    elif backend == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly() or tf.is_symbolic_tensor(x):
            return None
    elif getattr(getattr(x, "device", None), "type", None) == "meta":
        return None
    try:
        return np.asarray(keras.ops.convert_to_numpy(x))
    except Exception:  # any other traced tensor: its values are not known yet
        return None


def ids_as_int32(ids, vocab_size):
    """Returns integer ids as int32, with every id outside `[0, vocab_size)` set to `EMPTY_ID`.

    NumPy inputs (and lists) are clamped in NumPy, in their own dtype, before
    they become tensors (JAX without x64 would otherwise wrap int64 on
    conversion). Tensors of the active Keras backend (tracers included) are
    clamped with `keras.ops` in their own dtype, then cast.

    Args:
        ids: integer ids of any shape, NumPy or backend tensor.
        vocab_size: V, a Python int or a scalar integer tensor (a dynamic
            V); None when unknown, then only ids outside the int32 range
            become `EMPTY_ID`.

    Returns:
        An int32 tensor of the active backend, same shape.

    Example:

    >>> import numpy as np
    >>> ids = np.array([[0, 4, 2**32 + 1, -7]])
    >>> np.asarray(ids_as_int32(ids, 5)).tolist()
    [[0, 4, -1, -1]]
    """
    from keras import ops

    int32_limit = int(np.iinfo(np.int32).max) + 1
    if is_host_array(ids):
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"`ids` must be integers. Received: ids.dtype={ids.dtype}")
        upper = int(vocab_size) if isinstance(vocab_size, numbers.Integral) else int32_limit
        ids = np.where((ids >= 0) & (ids < upper), ids, EMPTY_ID).astype(np.int32)
        return ops.convert_to_tensor(ids)
    import keras

    dtype = keras.backend.standardize_dtype(ids.dtype)
    if vocab_size is None:
        vocab_size = int32_limit
    inside = ids >= 0
    if not isinstance(vocab_size, numbers.Integral):  # a dynamic V
        inside = ops.logical_and(inside, ids < ops.cast(vocab_size, dtype))
    elif int(vocab_size) <= int(np.iinfo(dtype).max):  # else no id of this dtype reaches V
        inside = ops.logical_and(inside, ids < int(vocab_size))
    return ops.cast(ops.where(inside, ids, ops.full_like(ids, EMPTY_ID)), "int32")


def static_dims(x):
    """Returns the static dimensions of `x` as a tuple of ints, None where unknown.

    Example:

    >>> import numpy as np
    >>> static_dims(np.zeros((2, 3)))
    (2, 3)
    """
    from keras import ops

    shape = getattr(x, "shape", None)
    shape = tuple(ops.shape(x)) if shape is None else tuple(shape)
    out = []
    for d in shape:
        try:
            out.append(None if d is None else int(d))
        except TypeError:
            out.append(None)
    return tuple(out)
