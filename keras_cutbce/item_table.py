"""`ItemTable`: a table (or bias) from a tensor, a `keras.Variable` or a layer, read once per call."""

import keras
import numpy as np
from keras import ops

from keras_cutbce import _keras_private
from keras_cutbce.math.positives import item_logits

__all__ = [
    "ItemTable",
    "bind",
    "layer_bias",
    "layer_table",
    "resolve_bias",
    "static_vocab_size",
    "table_config",
    "tables_config",
    "table_variable",
    "tables_from_config",
    "trainable_table_variables",
]

_UNKNOWN = object()


def table_variable(source, argument="embeddings"):
    """The `keras.Variable` of a variable or layer source (a computed `embeddings`: the weight of that name)."""
    if not isinstance(source, keras.layers.Layer):
        return source
    if not source.built:
        raise TypeError(
            f"`{argument}` layer {source.name!r} is not built: build it (or the model "
            "that owns it) before passing it as an item table. "
            f"Received: {argument}={source.name!r} (not built)"
        )
    variable = getattr(source, "embeddings", None)
    if isinstance(variable, keras.Variable):
        return variable
    for weight in source.weights:
        if weight.name == "embeddings":
            return weight
    raise TypeError(
        f"`{argument}` must be a [V, D] tensor, a keras.Variable or a layer with an "
        "`embeddings` variable (e.g. keras.layers.Embedding). "
        f"Received: {argument}={source.name!r} of type {type(source).__name__} without one"
    )


def _untied_reversible(layer):
    return isinstance(layer, keras.layers.ReversibleEmbedding) and not layer.tie_weights


def layer_table(layer, argument="embeddings"):
    """The `[V, D]` table a layer's own projection scores with (`ReversibleEmbedding`; `logit_soft_cap` refused)."""
    cap = getattr(layer, "logit_soft_cap", None)
    if isinstance(layer, keras.layers.ReversibleEmbedding) and cap is not None:
        raise ValueError(
            f"`{argument}` layer {layer.name!r} caps its logits (`logit_soft_cap={cap}`: "
            "`reverse=True` gives `cap * tanh(z / cap)`). CutBCE scores the uncapped logits "
            "`z = hidden @ table.T` tile by tile and cannot apply a cap without them: build "
            "the layer with `logit_soft_cap=None` to train and evaluate it with CutBCE, or "
            "compute the capped loss from the layer's dense logits. "
            f"Received: {argument}.logit_soft_cap={cap!r}"
        )
    if _untied_reversible(layer):
        return ops.transpose(layer.reverse_embeddings)
    return layer.embeddings


def layer_bias(source):
    """The bias variable `[V]` an `ItemEmbedding(use_bias=True)` owns, else None."""
    from keras_cutbce.item_embedding import ItemEmbedding

    if isinstance(source, ItemTable):
        source = source.source
    if isinstance(source, ItemEmbedding) and source.use_bias:
        return source.bias
    return None


def resolve_bias(embeddings, bias):
    """The bias a call uses: `bias` or the table layer's own (`ValueError` if both differ)."""
    own = layer_bias(embeddings)
    if own is None or bias is None:
        return own if bias is None else bias
    given = bias.source if isinstance(bias, ItemTable) else bias
    if isinstance(given, str):  # a path from a config: the layer's own bias, once bound
        found = _keras_private.find_model_table(given)
        given = given if found is None else found
    if given is own:
        return bias
    layer = embeddings.source if isinstance(embeddings, ItemTable) else embeddings
    raise ValueError(
        f"The item table layer {layer.name!r} owns a bias (use_bias=True), and "
        "`bias` was given too: pass one of them (the layer's bias is read "
        "with its table). Received: bias="
        f"{getattr(given, 'path', None) or type(given).__name__}"
    )


def static_vocab_size(source):
    """V of a table source when known without reading it, else None."""
    if isinstance(source, ItemTable):
        if source.layout is not None:
            return source.layout.vocab
        source = source.value
    if isinstance(source, keras.layers.Embedding):
        return int(source.input_dim)
    if isinstance(source, keras.layers.Layer):
        if not source.built:
            return None
        source = table_variable(source)
    shape = getattr(source, "shape", None)
    if shape is None or len(shape) != 2:
        return None
    try:
        return int(shape[0])
    except TypeError:
        return None


def trainable_table_variables(source):
    """The trainable variables a table source reads (none for a frozen layer or a constant)."""
    if isinstance(source, keras.layers.Layer):
        return list(source.trainable_weights)
    if isinstance(source, keras.Variable) and source.trainable:
        return [source]
    return []


def bind(source, argument="embeddings"):
    """Returns `source`, with a variable path (from a config) bound to the running model's variable."""
    if not isinstance(source, str):
        return source
    found = _keras_private.find_model_table(source)
    if found is None:
        raise ValueError(
            f"`{argument}` refers to the variable {source!r}, and no Keras model with "
            "that variable is being compiled, trained or evaluated. Pass the variable "
            f"or layer itself, or compile the model that owns it. Received: {argument}={source!r}"
        )
    return found


class ItemTable:
    """An item table (or bias) read for one call: `value`, `variable` (None: a constant), `source`, `sharding`.

    >>> import numpy as np
    >>> table = ItemTable.read(np.zeros((10, 4), "float32"))
    >>> table.vocab_size, table.variable is None, table.sharding is None
    (10, True, True)
    """

    __slots__ = ("value", "variable", "source", "_sharding", "layout")

    def __init__(self, value, variable=None, source=None, sharding=_UNKNOWN):
        self.value = value
        self.variable = variable
        self.source = value if source is None else source
        self._sharding = sharding
        # A table split over torch.distributed ranks (`ItemEmbedding(vocab_parallel=True)`): its
        # `VocabLayout`; `value` is this rank's rows.
        self.layout = getattr(self.source, "vocab_layout", None)

    @classmethod
    def read(cls, source, argument="embeddings", value=None):
        """The `ItemTable` of `source` now; `value` replaces the read (a JAX step's traced state)."""
        if isinstance(source, ItemTable):
            return source
        source = bind(source, argument)
        variable = table_variable(source, argument)
        if value is None:
            layer = isinstance(source, keras.layers.Layer)
            value = layer_table(source, argument) if layer else source
        stored = variable if isinstance(variable, keras.Variable) else None
        if _untied_reversible(source):
            stored = None  # the value is the transposed `reverse_embeddings`
        return cls(ops.convert_to_tensor(value), stored, source)

    @property
    def vocab_size(self):
        if self.layout is not None:
            return self.layout.vocab
        static = self.value.shape[0]
        try:
            return int(static)
        except TypeError:
            return ops.shape(self.value)[0]

    @property
    def sharding(self):
        """The table's `VocabSharding` when split along V over a JAX mesh, else None."""
        if self._sharding is _UNKNOWN:
            self._sharding = _vocab_sharding(self.variable, self.value)
        return self._sharding

    def item_logits(self, hidden, bias, ids):
        """The float32 logits `[M, L]` of `hidden [M, D]` at `ids [M, L]` (`bias`: a value or None).

        A table split over torch.distributed ranks gathers the rows from their ranks (a collective).
        """
        if self.layout is None:
            return item_logits(hidden, self.value, bias, ids)
        from keras_cutbce.backends.torch import vocab_parallel

        return vocab_parallel.item_logits(hidden, self.value, bias, ids, self.layout)

    def unsharded(self):
        """Returns this table's value as an `ItemTable` read as not sharded."""
        return ItemTable(self.value, self.variable, self.source, sharding=None)

    def trainable_variables(self):
        """Returns the trainable variables this table reads (see `trainable_table_variables`)."""
        return trainable_table_variables(self.source)


def _vocab_sharding(*candidates):
    if keras.backend.backend() != "jax":
        return None
    from keras_cutbce.backends.jax import sharded

    for candidate in candidates:
        if candidate is not None:
            found = sharded.vocab_sharding_of(candidate)
            if found is not None:
                return found
    return None


# -- saving: tables as variable paths, constants as arrays ----------------------------


def table_config(source, argument):
    """`source` as a config value: its variable's path, or a constant as an array."""
    if source is None or isinstance(source, str):
        return source
    if isinstance(source, (keras.Variable, keras.layers.Layer)):
        path = getattr(table_variable(source, argument), "path", None)
        if path is not None:
            return path
    return keras.saving.serialize_keras_object(np.asarray(ops.convert_to_numpy(source)))


def tables_config(embeddings, bias):
    """`{"embeddings": ..., "bias": ...}` as config values (an owned bias as its own path)."""
    return {
        "embeddings": table_config(embeddings, "embeddings"),
        "bias": table_config(resolve_bias(embeddings, bias), "bias"),
    }


def tables_from_config(config, keys=("embeddings", "bias")):
    """`config` with its paths bound to the loaded model's variables and constants as arrays."""
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
