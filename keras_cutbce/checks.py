"""Every argument check, once, each returning the value normalised (the kernels trust it); `loss_inputs` for a loss."""

import math
import numbers
from typing import NamedTuple
from typing import Optional

import keras
import numpy as np
from keras import ops

from keras_cutbce import registry
from keras_cutbce.common import concrete_values
from keras_cutbce.common import ids_as_int32
from keras_cutbce.ids import integer_ids
from keras_cutbce.item_table import ItemTable
from keras_cutbce.item_table import resolve_bias

__all__ = [
    "LossInputs",
    "LossOptions",
    "check_chunk_size",
    "check_cutoffs",
    "check_hidden_and_table",
    "check_id_list",
    "check_int",
    "check_k",
    "check_log_q",
    "check_label_smoothing",
    "check_pos_weight",
    "check_probability",
    "check_sample_weight",
    "check_bool",
    "flat_rows",
    "int32_ids",
    "is_float",
    "is_int",
    "loss_inputs",
    "loss_options",
    "negative_ids",
    "read_bias",
    "refuse_multi_hot",
    "static_dims",
]


# -- shapes and dtypes --------------------------------------------------------


def static_dims(x):
    """The shape of `x` as a tuple of ints, None where unknown."""
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
    return keras.backend.is_float_dtype(_dtype(x))


def is_int(x):
    return keras.backend.is_int_dtype(_dtype(x))


# -- scalars --------------------------------------------------------------------


def check_int(value, argument, minimum=1):
    """`value` as a Python int (NumPy integers accepted), `>= minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(
            f"`{argument}` must be an int >= {minimum}. Received: {argument}={value!r}"
        )
    return int(value)


def check_chunk_size(chunk_size):
    if chunk_size is None:
        return None
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, numbers.Integral)
        or chunk_size < 1
    ):
        raise ValueError(
            "`chunk_size` must be None or a positive int. "
            f"Received: chunk_size={chunk_size!r}"
        )
    return int(chunk_size)


def _as_float(value, argument, expected):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{argument}` must be a float {expected}. Received: {argument}={value!r} "
            f"of type {type(value).__name__}"
        )
    return float(value)


def check_label_smoothing(label_smoothing):
    value = _as_float(label_smoothing, "label_smoothing", "in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            "`label_smoothing` must be in [0, 1]. "
            f"Received: label_smoothing={label_smoothing!r}"
        )
    return value


def check_pos_weight(pos_weight):
    value = _as_float(pos_weight, "pos_weight", "> 0")
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(
            f"`pos_weight` must be a finite float > 0. Received: pos_weight={pos_weight!r}"
        )
    return value


class LossOptions(NamedTuple):
    """The checked scalar options of the loss ops."""

    label_smoothing: float
    pos_weight: float
    chunk_size: Optional[int]
    implementation: str
    family: str = "bce"

    @property
    def op(self):
        """The family's per-row op (`registry.IMPLEMENTATIONS`; its fused reduction adds `"_weighted_sum"`)."""
        return "cut_softmax" if self.family == "softmax" else "cut_bce"

    @property
    def keywords(self):
        """The op's keyword arguments."""
        keywords = {"chunk_size": self.chunk_size, "label_smoothing": self.label_smoothing}
        if self.family == "bce":
            keywords["pos_weight"] = self.pos_weight
        return keywords


def loss_options(label_smoothing=0.0, pos_weight=1.0, chunk_size=None, implementation="auto",
                 family="bce"):
    """The loss ops' scalar options checked, as a `LossOptions` (`family`: `"bce"` or `"softmax"`)."""
    implementation = registry.check_implementation(implementation)
    softmax = ("auto", *registry.IMPLEMENTATIONS["cut_softmax"])
    if family == "softmax" and implementation not in softmax:
        raise NotImplementedError(
            f"The softmax cross-entropy has no {implementation!r} implementation yet: use one "
            f"of {softmax}. Received: implementation={implementation!r}"
        )
    return LossOptions(
        label_smoothing=check_label_smoothing(label_smoothing),
        pos_weight=check_pos_weight(pos_weight),
        chunk_size=check_chunk_size(chunk_size),
        implementation=implementation,
        family=family,
    )


def check_k(k, vocab_size):
    upper = "V" if vocab_size is None else vocab_size
    if (
        isinstance(k, bool)
        or not isinstance(k, numbers.Integral)
        or k < 1
        or (vocab_size is not None and k > vocab_size)
    ):
        raise ValueError(f"`k` must be an int in [1, V] = [1, {upper}]. Received: k={k!r}")
    return int(k)


def check_cutoffs(k):
    """An int or a non-empty sequence of ints >= 1 as a sorted tuple of distinct ints."""
    ks = (k,) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k
    try:
        ks = tuple(ks)
    except TypeError:
        ks = ()
    if not ks or any(
        isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1 for x in ks
    ):
        raise ValueError(f"`k` must be a positive int or a sequence of them. Received: k={k!r}")
    return tuple(sorted({int(x) for x in ks}))


def check_id_list(ids, argument):
    """Returns None, an int or a sequence of ints as a tuple of Python ints."""
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
            f"`{argument}` must be None or a list of int item ids. Received: {argument}={ids!r}"
        )
    return tuple(int(x) for x in values)


def check_probability(value, argument):
    """Returns `value` as a float strictly inside `(0, 1)`."""
    number = _as_float(value, argument, "in (0, 1)")
    if not 0.0 < number < 1.0:
        raise ValueError(
            f"`{argument}` must be a probability in (0, 1). Received: {argument}={value!r}"
        )
    return number


# -- tensors ----------------------------------------------------------------------


def check_hidden_and_table(hidden, table, bias):
    """Raises unless `hidden [..., D]`, `table [V, D]` (V >= 1) and `bias [V]` are floats that fit."""
    h_dims, t_dims = static_dims(hidden), static_dims(table)
    if len(h_dims) < 2:
        raise ValueError(
            f"`hidden` must have rank >= 2, shape [..., D]. Received: hidden.shape={h_dims}"
        )
    if not is_float(hidden):
        raise TypeError(
            f"`hidden` must be a float tensor. Received: hidden.dtype={_dtype(hidden)}"
        )
    if len(t_dims) != 2:
        raise ValueError(
            f"`embeddings` must have shape [V, D]. Received: embeddings.shape={t_dims}"
        )
    if t_dims[0] == 0:
        raise ValueError(
            "`embeddings` must hold at least one item (V >= 1). "
            f"Received: embeddings.shape={t_dims}"
        )
    if not is_float(table):
        raise TypeError(
            f"`embeddings` must be a float table. Received: embeddings.dtype={_dtype(table)}"
        )
    if None not in (h_dims[-1], t_dims[1]) and h_dims[-1] != t_dims[1]:
        raise ValueError(
            "`hidden` and `embeddings` must share the last dimension D: expected "
            f"hidden [..., {t_dims[1]}] for embeddings {t_dims}. "
            f"Received: hidden.shape={h_dims}"
        )
    if bias is not None:
        b_dims = static_dims(bias)
        if len(b_dims) != 1 or (None not in (b_dims[0], t_dims[0]) and b_dims[0] != t_dims[0]):
            raise ValueError(
                f"`bias` must have shape [V] = [{t_dims[0]}] to match `embeddings` "
                f"{t_dims}. Received: bias.shape={b_dims}"
            )
        if not is_float(bias):
            raise TypeError(f"`bias` must be float. Received: bias.dtype={_dtype(bias)}")


def refuse_multi_hot(ids, vocab_size, argument, lead_ndim):
    """Raises on multi-hot labels `[..., V]` given as ids (V >= 2 entries, all 0 or 1; traced: the shape alone)."""
    dims = tuple(ids.shape)
    if not isinstance(vocab_size, int) or vocab_size < 2 or len(dims) != lead_ndim + 1:
        return
    if dims[-1] is None or int(dims[-1]) != vocab_size:
        return
    values = concrete_values(ids)
    if values is not None and not np.isin(values, (0, 1)).all():
        return
    seen = "its values are all 0 or 1" if values is not None else (
        "inside a compiled step its values cannot be read, so the shape decides (for V item "
        "ids a position, pad each list with one -1 so that L != V)"
    )
    shape = tuple(None if d is None else int(d) for d in dims)
    raise ValueError(
        f"`{argument}` looks like multi-hot labels [..., V] (the dense binary cross-entropy "
        f"form): its last axis has V = {vocab_size} entries and {seen}. CutBCE takes the "
        "integer ids of each position's items [..., L], padded with -1, and would read 0/1 "
        "labels as the ids 0 and 1: convert them with `keras_cutbce.multi_hot_to_ids(labels)`. "
        f"Received: {argument}.shape={shape}"
    )


def _check_id_shape(i_dims, h_dims, argument, one_per_position=True):
    lead = h_dims[:-1]
    axis = "L" if one_per_position else "X"
    shape = i_dims + (1,) if one_per_position and len(i_dims) == len(lead) else i_dims
    if len(shape) != len(lead) + 1 or any(
        a is not None and b is not None and a != b for a, b in zip(shape[:-1], lead)
    ):
        hint = ""
        if not one_per_position and len(i_dims) == len(lead):
            hint = (
                " Give the ids of a position their own axis: `exclude_ids[..., None]` "
                "excludes one id a position; to exclude each user's history, pass "
                "`keras_cutbce.seen_items(sequences)` (position t excludes the items up to "
                "t) or the history `[B, X]` broadcast to `[B, T, X]`."
            )
        raise ValueError(
            f"`{argument}` must have shape [..., {axis}] with the leading dimensions of "
            f"`hidden` {h_dims}, i.e. {lead + (axis,)}.{hint} "
            f"Received: {argument}.shape={i_dims}"
        )
    return shape


def int32_ids(ids, hidden, vocab_size, argument, one_per_position=True):
    """Ids checked for `hidden [..., D]`: int32 `[..., L]`, `EMPTY_ID` outside `[0, V)`, multi-hot refused.

    Whole-number float ids are taken where exact (`ids.integer_ids`).

    >>> import numpy as np
    >>> np.asarray(int32_ids(np.array([0, 7, -3]), np.zeros((3, 2)), 5, "target_ids")).tolist()
    [[0], [-1], [-1]]
    """
    ids, host = integer_ids(ids, vocab_size, argument)
    h_dims, i_dims = static_dims(hidden), static_dims(ids)
    refuse_multi_hot(ids, vocab_size, argument, lead_ndim=len(h_dims) - 1)
    with_labels = _check_id_shape(i_dims, h_dims, argument, one_per_position)
    if len(with_labels) != len(i_dims):
        ids = np.expand_dims(ids, -1) if host else ops.expand_dims(ids, -1)
    return ids_as_int32(ids, vocab_size)


def read_bias(table, bias):
    """The bias value of an `ItemTable` (its layer's own, or `bias`), or None."""
    bias = resolve_bias(table, bias)
    return None if bias is None else ItemTable.read(bias, "bias").value


def flat_rows(hidden, ids=None):
    """`(hidden [M, D], ids [M, L] | None)`: the positions as rows."""
    flat_hidden = ops.reshape(hidden, (-1, ops.shape(hidden)[-1]))
    if ids is None:
        return flat_hidden, None
    return flat_hidden, ops.reshape(ids, (ops.shape(flat_hidden)[0], ops.shape(ids)[-1]))


class LossInputs(NamedTuple):
    """A loss's checked tensors as rows (`hidden [M, D]`, int32 `ids [M, L]`) and the positions' shape."""

    hidden: object
    table: ItemTable
    ids: object
    bias: Optional[object]
    lead_shape: tuple


def loss_inputs(hidden, embeddings, target_ids, bias=None):
    """The loss tensors checked and flattened (`LossInputs`); `embeddings` may be an `ItemTable`."""
    hidden = ops.convert_to_tensor(hidden)
    table = ItemTable.read(embeddings)
    bias = read_bias(table, bias)
    check_hidden_and_table(hidden, table.value, bias)
    ids = int32_ids(target_ids, hidden, table.vocab_size, "target_ids")
    flat_hidden, flat_ids = flat_rows(hidden, ids)
    return LossInputs(flat_hidden, table, flat_ids, bias, ops.shape(hidden)[:-1])


def check_sample_weight(weight_dims, loss_dims, received=None):
    """Raises unless `weight_dims` (after Keras's rank adjustment) broadcast onto the loss dims."""
    ok = len(weight_dims) <= len(loss_dims)
    if ok:
        for w, d in zip(reversed(weight_dims), reversed(loss_dims)):
            if None not in (w, d) and w not in (1, d):
                ok = False
                break
    if not ok:
        shown = weight_dims if received is None else received
        raise ValueError(
            "`sample_weight` must broadcast to the per-position loss of shape "
            f"{loss_dims} (y_pred.shape[:-1]); it may be a scalar, one weight per "
            "example or per position, with an optional trailing axis of size 1. "
            f"Received: sample_weight.shape={shown}"
        )


def check_bool(value, argument):
    """Returns `value`, a Python (or NumPy) bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{argument}` must be a bool. Received: {argument}={value!r}")
    return bool(value)


def negative_ids(ids, vocab_size):
    """Negative ids checked: int32 `[S]` shared by every position, `EMPTY_ID` outside `[0, V)`; float ids as in `int32_ids`.

    >>> import numpy as np
    >>> np.asarray(negative_ids(np.array([4, 0, 9]), 5)).tolist()
    [4, 0, -1]
    """
    ids, _ = integer_ids(ids, vocab_size, "negative_ids")
    dims = static_dims(ids)
    if len(dims) != 1:
        raise ValueError(
            "`negative_ids` must have shape [S]: one list of negatives shared by every "
            f"position. Received: negative_ids.shape={dims}"
        )
    return ids_as_int32(ids, vocab_size)


def check_log_q(log_q, table, argument="log_q"):
    """Returns None or `log_q` as a float tensor `[V]` for `table [V, D]`."""
    if log_q is None:
        return None
    log_q = ops.convert_to_tensor(log_q)
    dims, vocab = static_dims(log_q), static_dims(table)[0]
    if len(dims) != 1 or None not in (dims[0], vocab) and dims[0] != vocab:
        raise ValueError(
            f"`{argument}` must have shape [V] = [{vocab}]: the sampler's log-probability of "
            f"every item. Received: {argument}.shape={dims}"
        )
    if not is_float(log_q):
        raise TypeError(f"`{argument}` must be float. Received: {argument}.dtype={_dtype(log_q)}")
    return log_q
