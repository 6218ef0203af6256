"""`OutOfRangeTargets`: the target ids the loss ignores, counted during training."""

import numbers
from typing import Optional

import keras
import numpy as np
from keras import ops

from keras_cutbce import _keras_private
from keras_cutbce import checks
from keras_cutbce.ids import integer_ids
from keras_cutbce.checks import refuse_multi_hot
from keras_cutbce.item_table import bind
from keras_cutbce.item_table import static_vocab_size
from keras_cutbce.item_table import table_config
from keras_cutbce.item_table import tables_from_config
from keras_cutbce.metrics.item_table_metric import key_prefix
from keras_cutbce.metrics.item_table_metric import position_weights

__all__ = ["OutOfRangeTargets"]

DEFAULT_NAME = "out_of_range_targets"


def _refuse_multi_hot(ids, vocab_size, lead_ndim):
    lead_ndim = len(ids.shape) - 1 if lead_ndim is None else lead_ndim
    refuse_multi_hot(ids, vocab_size, "y_true", lead_ndim)


@keras.saving.register_keras_serializable(package="keras_cutbce")
class OutOfRangeTargets(keras.metrics.Metric):
    """Counts the target ids the loss ignores, and the positions and batches left without a target.

    Keys: `out_of_range_ids` (ids outside `[0, V)` other than `padding_id`),
    `positions_without_targets`, `batches_without_targets`, over the positions
    with a non-zero weight and mask. It reads only V; `y_pred` gives its mask
    and shape. Float accumulators (exact below 2**24).

    Args:
        embeddings: the item table (layer, variable, array or tensor) or V.
        padding_id: the id your data pads with, not counted (None: count all).
        name: metric name (another than the default prefixes the keys).
        dtype: dtype of the accumulators (default float32).

    Example:

    >>> import numpy as np
    >>> metric = OutOfRangeTargets(3, padding_id=-1)   # V = 3
    >>> metric.update_state(np.array([[[1, -1], [3, -1]], [[-1, -1], [2, 0]]]))
    >>> {k: int(v) for k, v in metric.result().items()}
    {'out_of_range_ids': 1, 'positions_without_targets': 2, 'batches_without_targets': 0}
    """

    def __init__(
        self,
        embeddings,
        padding_id: Optional[int] = -1,
        name: str = DEFAULT_NAME,
        dtype: Optional[str] = None,
    ):
        super().__init__(name=name, dtype=dtype or "float32")
        if embeddings is None:
            raise ValueError(
                "`embeddings` is required: the item table [V, D] or V. Received: embeddings=None"
            )
        if isinstance(embeddings, numbers.Integral) and not isinstance(embeddings, bool):
            embeddings = checks.check_int(embeddings, "embeddings", minimum=1)
        if padding_id is not None and (
            isinstance(padding_id, bool) or not isinstance(padding_id, numbers.Integral)
        ):
            raise TypeError(
                f"`padding_id` must be an int or None. Received: padding_id={padding_id!r}"
            )
        self.padding_id = None if padding_id is None else int(padding_id)
        object.__setattr__(self, "embeddings", embeddings)  # untracked: not a metric variable
        self.out_of_range_ids = self.add_variable(
            shape=(), initializer="zeros", dtype=self.dtype, name="out_of_range_ids"
        )
        self.positions_without_targets = self.add_variable(
            shape=(), initializer="zeros", dtype=self.dtype, name="positions_without_targets"
        )
        self.batches_without_targets = self.add_variable(
            shape=(), initializer="zeros", dtype=self.dtype, name="batches_without_targets"
        )

    def vocab_size(self):
        """V, the number of items (ids outside `[0, V)` are padding)."""
        if isinstance(self.embeddings, int):
            return self.embeddings
        source = bind(self.embeddings, "embeddings")
        size = static_vocab_size(source)
        if size is None:
            raise ValueError(
                "OutOfRangeTargets needs V, the number of items: give the item table "
                "with a known number of rows (or V as an int). "
                f"Received: embeddings={getattr(source, 'name', source)!r}"
            )
        return size

    @_keras_private.usable_after_refusal()
    def _flags(self, y_true, lead_ndim):
        vocab_size = self.vocab_size()
        ids, host = integer_ids(y_true, vocab_size, "y_true")
        _refuse_multi_hot(ids, vocab_size, lead_ndim)
        if host:
            if lead_ndim is not None and ids.ndim == lead_ndim:
                ids = ids[..., None]
            ids = ids.reshape(-1, ids.shape[-1]) if ids.ndim > 1 else ids.reshape(-1, 1)
            outside = (ids < 0) | (ids >= vocab_size)
            padding = np.zeros_like(outside) if self.padding_id is None else ids == self.padding_id
            return ops.convert_to_tensor(outside), ops.convert_to_tensor(padding)
        if lead_ndim is not None and len(ids.shape) == lead_ndim:
            ids = ops.expand_dims(ids, -1)
        if len(ids.shape) < 2:
            ids = ops.reshape(ids, (-1, 1))
        ids = ops.reshape(ids, (-1, ops.shape(ids)[-1]))
        info = np.iinfo(keras.backend.standardize_dtype(ids.dtype))
        outside = ids < 0
        if vocab_size <= info.max:  # else no id of this dtype reaches V
            outside = ops.logical_or(outside, ids >= vocab_size)
        if self.padding_id is None or not info.min <= self.padding_id <= info.max:
            padding = ops.zeros_like(outside)
        else:
            padding = ids == self.padding_id
        return outside, padding

    def update_state(self, y_true, y_pred=None, sample_weight=None):
        """Accumulates one batch: `y_true` ids, optional `y_pred` (mask and shape), optional `sample_weight`."""
        mask, lead_ndim = None, None
        if y_pred is not None:
            mask = _keras_private.get_keras_mask(y_pred)
            lead_ndim = len(y_pred.shape) - 1
        outside, padding = self._flags(y_true, lead_ndim)
        if y_pred is not None:
            ones = ops.ones_like(ops.convert_to_tensor(y_pred)[..., 0], dtype=self.dtype)
        else:
            ones = ops.ones((ops.shape(outside)[0],), dtype=self.dtype)
        counted = position_weights(sample_weight, mask, ones, self.dtype) > 0  # [M]
        counted_ids = ops.expand_dims(counted, -1)
        valid = ops.logical_and(ops.logical_not(outside), counted_ids)
        ignored = ops.logical_and(ops.logical_and(outside, ops.logical_not(padding)), counted_ids)
        has_target = ops.any(valid, axis=-1)
        dtype = self.dtype
        self.out_of_range_ids.assign_add(ops.sum(ops.cast(ignored, dtype)))
        self.positions_without_targets.assign_add(
            ops.sum(ops.cast(ops.logical_and(counted, ops.logical_not(has_target)), dtype))
        )
        self.batches_without_targets.assign_add(
            ops.cast(ops.logical_not(ops.any(has_target)), dtype)
        )

    def result(self):
        """Returns `{"out_of_range_ids", "positions_without_targets", "batches_without_targets"}`."""
        p = key_prefix(self, DEFAULT_NAME)
        return {
            f"{p}out_of_range_ids": ops.convert_to_tensor(self.out_of_range_ids),
            f"{p}positions_without_targets": ops.convert_to_tensor(self.positions_without_targets),
            f"{p}batches_without_targets": ops.convert_to_tensor(self.batches_without_targets),
        }

    def reset_state(self):
        for variable in self.variables:
            variable.assign(ops.zeros(variable.shape, dtype=variable.dtype))

    def get_config(self):
        embeddings = self.embeddings
        if not isinstance(embeddings, (int, str)):
            size = static_vocab_size(embeddings)
            embeddings = size if size is not None else table_config(embeddings, "embeddings")
        return {
            "name": self.name,
            "dtype": self.dtype,
            "embeddings": embeddings,
            "padding_id": self.padding_id,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**tables_from_config(config, keys=("embeddings",)))
