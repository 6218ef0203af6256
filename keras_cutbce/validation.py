"""Argument checks and the item-table resolver, written once.

`CutBCELoss`, the ops in `keras_cutbce.ops` and the metrics call these before
any kernel runs, so bad input gets a `ValueError`/`TypeError` naming the
argument, the expected and the received value, shape or dtype.

The item table (and bias) can be given as a tensor, a `keras.Variable` or a
layer holding one as `embeddings` (`keras.layers.Embedding`, with or without
LoRA, `keras.layers.ReversibleEmbedding`):

- `table_variable(source)`: the `keras.Variable` that stores it (for
  saving, and for the sharding of a distributed table);
- `read_table(source)`: its current value (a layer's `embeddings` property,
  so a LoRA layer gives its merged table; a variable's value, which inside a
  `keras.StatelessScope`, as in Keras's JAX train step, is the traced one).
"""

import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_cutbce.common import ids_as_int32
from keras_cutbce.common import is_host_array

IMPLEMENTATIONS = ("auto", "chunked", "pallas", "reference")


# -- shapes and dtypes --------------------------------------------------------


def static_dims(x):
    """Static dimensions of `x` as a tuple of ints, None where unknown."""
    shape = getattr(x, "shape", None)
    shape = tuple(ops.shape(x)) if shape is None else tuple(shape)
    out = []
    for d in shape:
        try:
            out.append(None if d is None else int(d))
        except TypeError:
            out.append(None)
    return tuple(out)


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


def is_float(x):
    """True for a float tensor (bfloat16 included)."""
    return keras.backend.is_float_dtype(_dtype(x))


def is_int(x):
    """True for an integer tensor (signed or unsigned)."""
    return keras.backend.is_int_dtype(_dtype(x))


# -- scalars --------------------------------------------------------------------


def check_int(value, argument, minimum=1):
    """`value` as a Python int (NumPy integers accepted), `>= minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(
            f"`{argument}` must be an int >= {minimum}; received {value!r}."
        )
    return int(value)


def check_chunk_size(chunk_size):
    """None or a positive int (NumPy integers accepted)."""
    if chunk_size is None:
        return None
    try:
        return check_int(chunk_size, "chunk_size")
    except ValueError:
        raise ValueError(
            f"`chunk_size` must be None or a positive int; received {chunk_size!r}."
        ) from None


def _as_float(value, argument, expected):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{argument}` must be a float {expected}; received {value!r} of type "
            f"{type(value).__name__}."
        )
    return float(value)


def check_label_smoothing(label_smoothing):
    """A float in `[0, 1]`."""
    value = _as_float(label_smoothing, "label_smoothing", "in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"`label_smoothing` must be in [0, 1]; received {label_smoothing!r}."
        )
    return value


def check_pos_weight(pos_weight):
    """A finite float `> 0`."""
    value = _as_float(pos_weight, "pos_weight", "> 0")
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(
            f"`pos_weight` must be a finite float > 0; received {pos_weight!r}."
        )
    return value


def check_implementation(implementation):
    """One of `IMPLEMENTATIONS`; `"pallas"` only on the JAX backend."""
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"`implementation` must be one of {IMPLEMENTATIONS}; received "
            f"{implementation!r}."
        )
    if implementation == "pallas" and keras.backend.backend() != "jax":
        raise ValueError(
            "`implementation='pallas'` needs the JAX backend; the Keras backend is "
            f"{keras.backend.backend()!r}."
        )
    return implementation


def check_k(k, vocab_size):
    """An int in `[1, V]` (NumPy integers accepted)."""
    upper = "V" if vocab_size is None else vocab_size
    if (
        isinstance(k, bool)
        or not isinstance(k, numbers.Integral)
        or k < 1
        or (vocab_size is not None and k > vocab_size)
    ):
        raise ValueError(f"`k` must be an int in [1, V] = [1, {upper}]; received {k!r}.")
    return int(k)


def check_cutoffs(k):
    """An int or a non-empty sequence of ints >= 1, as a sorted tuple of distinct ints."""
    ks = (k,) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k
    try:
        ks = tuple(ks)
    except TypeError:
        ks = ()
    if not ks or any(
        isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1 for x in ks
    ):
        raise ValueError(f"`k` must be a positive int or a sequence of them; received {k!r}.")
    return tuple(sorted({int(x) for x in ks}))


def check_id_list(ids, argument):
    """None, an int or a sequence of ints, as a tuple of Python ints."""
    if ids is None:
        return ()
    if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
        ids = (ids,)
    try:
        values = tuple(ids)
    except TypeError:
        values = None
    if values is None or any(
        isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in values
    ):
        raise TypeError(
            f"`{argument}` must be None or a list of int item ids; received {ids!r}."
        )
    return tuple(int(x) for x in values)


def check_probability(value, argument):
    """A float strictly inside `(0, 1)`."""
    number = _as_float(value, argument, "in (0, 1)")
    if not 0.0 < number < 1.0:
        raise ValueError(
            f"`{argument}` must be a probability in (0, 1); received {value!r}."
        )
    return number


# -- tensors ----------------------------------------------------------------------


def check_hidden_and_table(hidden, table, bias):
    """`hidden [..., D]` float, `table [V, D]` float with V >= 1, `bias [V]` float."""
    h_dims, t_dims = static_dims(hidden), static_dims(table)
    if len(h_dims) < 2:
        raise ValueError(
            f"`hidden` must have rank >= 2, shape [..., D]; received shape {h_dims}."
        )
    if not is_float(hidden):
        raise TypeError(f"`hidden` must be a float tensor; received dtype {hidden.dtype}.")
    if len(t_dims) != 2:
        raise ValueError(f"`embeddings` must have shape [V, D]; received shape {t_dims}.")
    if t_dims[0] == 0:
        raise ValueError(
            "`embeddings` must hold at least one item (V >= 1); received shape "
            f"{t_dims}."
        )
    if not is_float(table):
        raise TypeError(f"`embeddings` must be a float table; received dtype {table.dtype}.")
    if None not in (h_dims[-1], t_dims[1]) and h_dims[-1] != t_dims[1]:
        raise ValueError(
            "`hidden` and `embeddings` must share the last dimension D: expected "
            f"hidden [..., {t_dims[1]}] for embeddings {t_dims}; received hidden "
            f"shape {h_dims}."
        )
    if bias is not None:
        b_dims = static_dims(bias)
        if len(b_dims) != 1 or (None not in (b_dims[0], t_dims[0]) and b_dims[0] != t_dims[0]):
            raise ValueError(
                f"`bias` must have shape [V] = [{t_dims[0]}] to match `embeddings` "
                f"{t_dims}; received shape {b_dims}."
            )
        if not is_float(bias):
            raise TypeError(f"`bias` must be float; received dtype {bias.dtype}.")


def check_ids(ids, hidden, argument):
    """Integer ids `[..., L]` (or `[...]`, one a position) for `hidden [..., D]`.

    Returns the ids with the `L` axis.
    """
    if not is_int(ids):
        raise TypeError(
            f"`{argument}` must be an integer tensor of item ids (ids outside "
            f"[0, V) are padding); received dtype {ids.dtype}. Float ids are "
            "exact only below 2**24: keep them integral."
        )
    h_dims, i_dims = static_dims(hidden), static_dims(ids)
    lead = h_dims[:-1]
    if len(i_dims) == len(lead):  # one id per position
        ids = ops.expand_dims(ids, -1)
        i_dims = i_dims + (1,)
    if len(i_dims) != len(lead) + 1 or any(
        a is not None and b is not None and a != b for a, b in zip(i_dims[:-1], lead)
    ):
        raise ValueError(
            f"`{argument}` must have shape [..., L] with the leading dimensions of "
            f"`hidden` {h_dims}, i.e. {lead + ('L',)}; received shape {i_dims}."
        )
    return ids


def vocab_size_of(table):
    """V of a `[V, D]` table: a Python int when static, else a scalar tensor."""
    static = static_dims(table)[0]
    return static if static is not None else ops.shape(table)[0]


def checked_ids(ids, hidden, vocab_size, argument):
    """Checked ids `[..., L]` as int32, every id outside `[0, V)` set to `EMPTY_ID`.

    Host (NumPy) integer ids are range-checked in their own dtype before they
    become tensors, so an int64 id >= 2**31 never wraps to a valid id (see
    `keras_cutbce.common.ids_as_int32`).
    """
    if is_host_array(ids) and np.asarray(ids).dtype.kind in "iu":
        ids = ids_as_int32(ids, vocab_size)
    else:
        ids = ids_as_int32(check_ids(ops.convert_to_tensor(ids), hidden, argument), vocab_size)
    return check_ids(ids, hidden, argument)


def count_out_of_range_ids(ids, embeddings):
    """Counts the ids outside `[0, V)`, which the loss and metrics treat as padding.

    A debug check for target ids before training: by design every id outside
    `[0, V)` is padding (ignored), so an off-by-one (1-based ids `1..V` with a
    table of V rows) loses item V silently. Your padding id (e.g. -1) is
    listed too; any other entry is a real item the loss would ignore.

    Args:
        ids: integer ids of any shape (NumPy, a list, or a tensor of the
            active backend).
        embeddings: the item table (a layer, `keras.Variable`, array or
            tensor `[V, D]`) or V itself, an int.

    Returns:
        A dict `{id: count}` of every distinct id outside `[0, V)`, sorted by
        id (empty when all ids are items).

    Example:

    >>> count_out_of_range_ids([[1, 2, 3], [3, -1, 0]], 3)  # V = 3
    {-1: 1, 3: 2}
    """
    if isinstance(embeddings, numbers.Integral) and not isinstance(embeddings, bool):
        vocab_size = check_int(embeddings, "embeddings", minimum=1)
    else:
        vocab_size = static_dims(read_table(table_source(embeddings, "embeddings")))[0]
    values = ids if is_host_array(ids) else ops.convert_to_numpy(ids)
    values = np.asarray(values)
    if values.dtype.kind not in "iu":
        raise TypeError(
            f"`ids` must be integer item ids; received dtype {values.dtype}."
        )
    outside = values[(values < 0) | (values >= vocab_size)]
    found, counts = np.unique(outside, return_counts=True)
    return {int(i): int(c) for i, c in zip(found, counts)}


def check_sample_weight(weight_dims, loss_dims, received=None):
    """Raises unless `sample_weight` dims broadcast onto the per-position loss dims.

    `weight_dims` are the dims after Keras's rank adjustment (a trailing
    size-1 axis squeezed, or the weight expanded over trailing positions).
    Unknown (None) dims are not checked. `received` is the shape the caller
    gave, for the message (default `weight_dims`).
    """
    ok = len(weight_dims) <= len(loss_dims)
    if ok:
        for w, d in zip(reversed(weight_dims), reversed(loss_dims)):
            if None not in (w, d) and w not in (1, d):
                ok = False
                break
    if not ok:
        raise ValueError(
            "`sample_weight` must broadcast to the per-position loss of shape "
            f"{loss_dims} (y_pred.shape[:-1]); it may be a scalar, one weight per "
            "example or per position, with an optional trailing axis of size 1. "
            f"Received sample_weight of shape {weight_dims if received is None else received}."
        )


# -- the item table ---------------------------------------------------------------


def table_variable(source, argument="embeddings"):
    """The `keras.Variable` storing a table given as a variable or a layer.

    A layer's table is its `embeddings` attribute when that is a variable,
    else (LoRA, quantized layers, where `embeddings` is computed) its weight
    named `embeddings`. Tensors and None are returned as they are.
    """
    if not isinstance(source, keras.layers.Layer):
        return source
    if not source.built:
        raise TypeError(
            f"`{argument}` layer {source.name!r} is not built: build it (or the model "
            "that owns it) before passing it as an item table."
        )
    variable = getattr(source, "embeddings", None)
    if isinstance(variable, keras.Variable):
        return variable
    for weight in source.weights:
        if weight.name == "embeddings":
            return weight
    raise TypeError(
        f"`{argument}` must be a [V, D] tensor, a keras.Variable or a layer with an "
        f"`embeddings` variable (e.g. keras.layers.Embedding); received layer "
        f"{source.name!r} of type {type(source).__name__} without one."
    )


def read_table(source, argument="embeddings"):
    """The current value of a table given as a tensor, a variable or a layer."""
    if isinstance(source, keras.layers.Layer):
        table_variable(source, argument)  # checks that it is built and has one
        return ops.convert_to_tensor(source.embeddings)
    return ops.convert_to_tensor(source)


# -- saving: tables as variable paths, constants as arrays ----------------------------


def table_config(source, argument):
    """`source` as a config value: its variable's path, or the constant itself.

    A table held in a `keras.Variable` (or a layer) is saved as the variable's
    path, which re-binds to the loaded model's variable (its value is in the
    model's weights). A constant table (a NumPy array or a tensor, which no
    optimizer trains) is saved in the config as an array, so `model.save`
    works for it too; a large constant table is better held in a
    non-trainable `keras.Variable` of the model (saved with the weights).
    None and paths pass through.
    """
    if source is None or isinstance(source, str):
        return source
    if isinstance(source, (keras.Variable, keras.layers.Layer)):
        path = getattr(table_variable(source, argument), "path", None)
        if path is not None:
            return path
    return keras.saving.serialize_keras_object(np.asarray(ops.convert_to_numpy(source)))


def tables_from_config(config, keys=("embeddings", "bias")):
    """`config` with its tables restored: paths bound to the loaded model's variables
    where one is found, constants as NumPy arrays."""
    from keras_cutbce import _keras_private

    config = dict(config)
    for key in keys:
        value = config.get(key)
        if isinstance(value, str):
            found = _keras_private.find_model_table(value)
            if found is not None:
                config[key] = found
        elif isinstance(value, dict):
            config[key] = keras.saving.deserialize_keras_object(value)
    return config


def trainable_table_variables(source):
    """The trainable variables a table source reads (none for a frozen table or a constant).

    A layer's trainable weights (none when `layer.trainable` is False; a
    LoRA layer's factors), a variable created with `trainable=True`, and
    nothing for a tensor, an array or None.
    """
    if isinstance(source, keras.layers.Layer):
        return list(source.trainable_weights)
    if isinstance(source, keras.Variable) and source.trainable:
        return [source]
    return []


def table_source(source, argument):
    """`source`, with a variable path (from a config) bound to the running model's variable."""
    if not isinstance(source, str):
        return source
    from keras_cutbce import _keras_private

    found = _keras_private.find_model_table(source)
    if found is None:
        raise ValueError(
            f"`{argument}` refers to the variable {source!r}, and no Keras model with "
            "that variable is being compiled, trained or evaluated. Pass the variable "
            "or layer itself, or compile the model that owns it."
        )
    return found
