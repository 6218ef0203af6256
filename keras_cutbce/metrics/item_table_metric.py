"""`ItemTableMetric`: the base of the metrics that read an item table."""

import functools

import keras
from keras import ops

from keras_cutbce import _keras_private
from keras_cutbce import checks
from keras_cutbce.common import filled_like
from keras_cutbce.item_table import ItemTable
from keras_cutbce.item_table import bind
from keras_cutbce.item_table import resolve_bias
from keras_cutbce.item_table import tables_config
from keras_cutbce.item_table import tables_from_config
from keras_cutbce.math.positives import distinct_targets

__all__ = ["ItemTableMetric", "accumulate", "key_prefix", "position_weights"]


def position_weights(sample_weight, mask, ones, dtype):
    """Per-position weights `[M]`: `sample_weight` broadcast over `ones`, times the mask."""
    lead_ndim = len(ones.shape)
    weights = ones
    if sample_weight is not None:
        sample_weight = ops.cast(ops.convert_to_tensor(sample_weight), dtype)
        while len(sample_weight.shape) > lead_ndim and sample_weight.shape[-1] == 1:
            sample_weight = ops.squeeze(sample_weight, -1)
        while len(sample_weight.shape) < lead_ndim:
            sample_weight = ops.expand_dims(sample_weight, -1)
        checks.check_sample_weight(checks.static_dims(sample_weight), checks.static_dims(weights))
        weights = weights * sample_weight
    if mask is not None:
        weights = weights * ops.cast(mask, dtype)
    return ops.reshape(weights, (-1,))


def accumulate(variable, weights, values, nan_rows):
    """Adds `sum(weights * values)` to `variable`; NaN if a counted position (`nan_rows`) has no ranking."""
    values = weights * ops.cast(values, variable.dtype)
    values = ops.where(nan_rows, filled_like(values, float("nan")), values)
    variable.assign_add(ops.sum(ops.where(weights != 0, values, ops.zeros_like(values))))


def key_prefix(metric, default_name):
    """Returns the prefix of `metric`'s `result()` keys (see `ItemTableMetric.key_prefix`)."""
    own = "" if metric.name == default_name else f"{metric.name}_"
    logged = _keras_private.compiled_metric_name(metric)
    if logged is None:
        return own
    log_name, output = logged
    if log_name != (f"{output}_{metric.name}" if output else metric.name):
        return f"{log_name}_"  # Keras de-duplicated the name
    return (f"{output}_" if output else "") + own


def _stored_variables(source):
    if isinstance(source, keras.layers.Layer):
        return list(source.weights)
    return [source] if isinstance(source, keras.Variable) else []


class ItemTableMetric(keras.metrics.Metric):
    """A metric that reads an item table (and bias) when it updates, saved as a variable path.

    The table is held untracked (else `reset_state` would zero it). Subclasses
    implement `update_state` with `read_tables()` and `prepare(...)`, and name
    their keys with `key_prefix()`.

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with an
            `embeddings` variable (an `ItemEmbedding`'s bias is used).
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        name: metric name.
        dtype: dtype of the accumulators (default float32).
    """

    default_name = None  # the subclass's default `name`, whose keys carry no prefix

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "update_state" in cls.__dict__:
            cls.update_state = _summed_over_ranks(cls.__dict__["update_state"])

    def __init__(self, embeddings, bias=None, chunk_size=None, name=None, dtype=None):
        super().__init__(name=name, dtype=dtype or "float32")
        if embeddings is None:
            raise ValueError(
                "`embeddings` is required: the item table [V, D]. Received: embeddings=None"
            )
        self.chunk_size = checks.check_chunk_size(chunk_size)
        object.__setattr__(self, "embeddings", embeddings)
        object.__setattr__(self, "bias", bias)

    def _read(self, source, argument):
        source = bind(source, argument)
        if keras.backend.backend() == "jax":
            state = _keras_private.jax_step_state()
            variables = _stored_variables(source)
            if state is not None and any(id(v) in state for v in variables):
                mapping = [(v, state[id(v)]) for v in variables if id(v) in state]
                with keras.StatelessScope(state_mapping=mapping):
                    return ItemTable.read(source, argument)
        return ItemTable.read(source, argument)

    def read_tables(self):
        """Returns `(table, bias)` as this update should see them, as `ItemTable`s (bias None if unset)."""
        table = self._read(self.embeddings, "embeddings")
        bias = resolve_bias(table, self.bias)
        bias = None if bias is None else self._read(bias, "bias")
        return table, bias

    @_keras_private.usable_after_refusal()
    def prepare(self, y_true, y_pred, vocab_size, never=()):
        """`(y_pred, safe [M, L] int32, keep [M, L] bool, mask)`: the valid distinct targets not in `never`."""
        mask = _keras_private.get_keras_mask(y_pred)
        y_pred = ops.convert_to_tensor(y_pred)
        if not checks.is_float(y_pred):
            raise TypeError(
                "`y_pred` must be float hidden states. "
                f"Received: y_pred.dtype={keras.backend.standardize_dtype(y_pred.dtype)}"
            )
        ids = checks.int32_ids(y_true, y_pred, vocab_size, "y_true")
        num_rows = ops.shape(ops.reshape(y_pred, (-1, ops.shape(y_pred)[-1])))[0]
        rows = ops.reshape(ids, (num_rows, ops.shape(ids)[-1]))
        safe, keep = distinct_targets(rows, vocab_size)
        for item in never:
            keep = ops.logical_and(keep, safe != item)
        return y_pred, safe, keep, mask

    def position_weights(self, sample_weight, mask, y_pred):
        """Returns per-position weights `[M]`: `sample_weight` broadcast over positions, times the mask."""
        return position_weights(
            sample_weight, mask, ops.ones_like(y_pred[..., 0], dtype=self.dtype), self.dtype
        )

    def key_prefix(self):
        """The prefix of the `result()` keys: `""` under the default name, else Keras's logged name and `"_"`."""
        return key_prefix(self, self.default_name)

    def reset_state(self):
        for variable in self.variables:
            variable.assign(ops.zeros(variable.shape, dtype=variable.dtype))

    def get_config(self):
        """Returns the config, with the table (and bias) saved as variable paths."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            **tables_config(self.embeddings, self.bias),
            "chunk_size": self.chunk_size,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**tables_from_config(config))



def _summed_over_ranks(update_state):
    """`update_state` that, with a table split over torch.distributed ranks, sums every rank's update.

    Each rank passes its own positions; its variables then hold the values
    of all ranks' positions (one all-reduce per update).
    """

    @functools.wraps(update_state)
    def update(self, *args, **kwargs):
        split = keras.backend.backend() == "torch" and not getattr(self, "_updating", False)
        layout = self.read_tables()[0].layout if split else None
        if layout is None:
            return update_state(self, *args, **kwargs)
        from keras_cutbce.backends.torch import vocab_parallel

        before = vocab_parallel.snapshot(self.variables)
        object.__setattr__(self, "_updating", True)
        try:
            update_state(self, *args, **kwargs)
        finally:
            object.__setattr__(self, "_updating", False)
        vocab_parallel.sum_updates(self.variables, before, layout)

    return update
