"""Constants and small helpers shared by the public API and every backend (`EMPTY_ID`: no item)."""

import numbers

import numpy as np

__all__ = [
    "EMPTY_ID", "concrete_values", "filled_like", "ids_as_int32", "is_host_array", "on_host_values",
    "on_tpu", "round_up",
]

EMPTY_ID = -1


def round_up(value, multiple):
    return -(-int(value) // multiple) * multiple


def filled_like(x, value):
    """`x`'s shape and dtype, every element `value`, made where `x` is. On torch `ops.full_like` and a
    Python number in `ops.where` copy the number from the host first: a sync on CUDA."""
    from keras import ops

    return ops.zeros_like(x) + value


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
    """`x` as a NumPy array when its values can be read now (not traced), else None."""
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


def on_host_values(x):
    """`x` as NumPy when it is host data or an eager CPU tensor (read without a device sync), else None."""
    if is_host_array(x):
        return np.asarray(x)
    try:  # a JAX array names its devices (a tracer raises)
        devices = x.devices() if callable(getattr(x, "devices", None)) else None
    except Exception:
        return None
    if devices is not None:
        names = [d.platform for d in devices]
    else:
        device = getattr(x, "device", None)
        names = [getattr(device, "type", None) or str(device or "")]
    if not all("cpu" in name.lower() for name in names):
        return None
    return concrete_values(x)


def ids_as_int32(ids, vocab_size):
    """Ids as int32, every id outside `[0, vocab_size)` set to `EMPTY_ID` in its own dtype first (no int64 wrap).

    >>> import numpy as np
    >>> np.asarray(ids_as_int32(np.array([[0, 4, 2**32 + 1, -7]]), 5)).tolist()
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
    return ops.cast(ops.where(inside, ids, filled_like(ids, EMPTY_ID)), "int32")
