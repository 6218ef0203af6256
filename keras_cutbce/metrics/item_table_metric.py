"""`ItemTableMetric`: the base of the metrics that read an item table."""

import keras
from keras import ops

from keras_cutbce import _keras_private
from keras_cutbce import checks
from keras_cutbce.item_table import ItemTable
from keras_cutbce.item_table import bind
from keras_cutbce.item_table import resolve_bias
from keras_cutbce.item_table import tables_config
from keras_cutbce.item_table import tables_from_config
from keras_cutbce.math.positives import distinct_targets

__all__ = ["ItemTableMetric", "accumulate", "key_prefix", "position_weights"]


def position_weights(sample_weight, mask, ones, dtype):
    """Returns per-position weights `[M]`: `sample_weight` broadcast over `ones`, times the mask.

    `ones` is a tensor of ones shaped like the positions (`y_pred.shape[:-1]`).
    """
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
    """Adds `sum(weights * values)` over positions to `variable`, NaN if a counted one has no ranking.

    A position counts when its weight is not 0; `nan_rows [M]` marks the
    positions with a NaN logit (a diverged model), which make the sum NaN.
    """
    values = ops.where(nan_rows, float("nan"), weights * ops.cast(values, variable.dtype))
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
    """The variables a table source reads: a layer's weights, or the variable itself."""
    if isinstance(source, keras.layers.Layer):
        return list(source.weights)
    return [source] if isinstance(source, keras.Variable) else []


class ItemTableMetric(keras.metrics.Metric):
    """A metric that reads an item table (and bias) when it updates.

    Holds the table untracked (a `keras.Variable` set as an attribute would
    become one of the metric's own variables: reset to zero by `reset_state`),
    resets its own variables to zero, and saves the table as a variable path
    that re-binds to the loaded model's variable.

    Subclasses implement `update_state` with `self.read_tables()` and
    `self.prepare(y_true, y_pred)`, and name their `result()` keys with
    `self.key_prefix()`.

    Args:
        embeddings: item table, a `keras.Variable` `[V, D]` or a layer with
            an `embeddings` variable (`keras.layers.Embedding`; an
            `ItemEmbedding` with `use_bias=True` gives its bias too).
        bias: optional `keras.Variable` `[V]`, for a table without its own.
        chunk_size: vocabulary tile width, `None` for the default rule.
        name: metric name.
        dtype: dtype of the accumulators (default float32).
    """

    default_name = None  # the subclass's default `name`, whose keys carry no prefix

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
        """Returns the `ItemTable` of a table source as this update sees it.

        Inside Keras's JAX train and test steps, the value is the step's traced
        state of the table's variables, not the variables' concrete values.
        """
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

    def prepare(self, y_true, y_pred, vocab_size, never=()):
        """Returns checked inputs: `(hidden [..., D], valid distinct targets, mask)`.

        Returns `(y_pred, safe [M, L] int32, keep [M, L] bool, mask)`: each
        row's targets de-duplicated (`keras_cutbce.math.positives`), ids
        outside `[0, V)` (any integer width) and the ids in `never` dropped.
        """
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
        """Returns the prefix of this metric's `result()` keys, so that metrics log apart.

        `""` under the default name, `"{name}_"` under another. Compiled into
        a model, the keys follow Keras's names for its own metrics: a second
        metric of one name in the model is logged under Keras's `{name}_1`
        (`hit@10`, then `top_k_retrieval_1_hit@10`), and a multi-output
        model prefixes the output's name (`"{output}_hit@10"`), on every
        backend.
        """
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

