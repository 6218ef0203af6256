"""`ItemEmbedding`: an item table layer that can own a per-item bias."""

import keras

__all__ = ["ItemEmbedding"]


@keras.saving.register_keras_serializable(package="keras_cutbce")
class ItemEmbedding(keras.layers.Embedding):
    """A `keras.layers.Embedding` item table `[V, D]` with an optional trainable per-item bias `[V]`.

    Give the layer itself to the losses, ops and metrics: each reads the table
    and the bias, so both train through the loss on every backend and save with
    the model. The layer must belong to the model being trained.

    Args:
        input_dim: V, the number of items (an int >= 1).
        output_dim: D, the embedding width (an int >= 1).
        use_bias: whether the layer owns a bias `[V]`.
        bias_initializer: initializer of the bias (default zeros).
        bias_regularizer: optional regularizer of the bias.
        bias_constraint: optional constraint of the bias.
        **kwargs: the other arguments of `keras.layers.Embedding`.

    Example:

    >>> import keras
    >>> from keras_cutbce import CutBCELoss, ItemEmbedding
    >>> items = ItemEmbedding(100, 8, use_bias=True, name="items")
    >>> ids = keras.Input((5,), dtype="int32")
    >>> model = keras.Model(ids, keras.layers.Dense(8)(items(ids)))
    >>> model.compile(optimizer="adam", loss=CutBCELoss(items))
    >>> [w.path for w in items.weights]
    ['items/embeddings', 'items/bias']
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        use_bias=False,
        bias_initializer="zeros",
        bias_regularizer=None,
        bias_constraint=None,
        **kwargs,
    ):
        if not isinstance(use_bias, bool):
            raise TypeError(f"`use_bias` must be a bool. Received: use_bias={use_bias!r}")
        super().__init__(input_dim, output_dim, **kwargs)
        self.use_bias = use_bias
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.bias = None

    def build(self, input_shape=None):
        if self.built:
            return
        # Keras's build enables LoRA (`lora_rank=`) last and then takes no new
        # weight: create the table, then the bias, then the LoRA factors.
        rank = self.lora_rank
        self.lora_rank = None
        try:
            super().build(input_shape)
        finally:
            self.lora_rank = rank
        if self.use_bias:
            self.bias = self.add_weight(
                shape=(self.input_dim,),
                initializer=self.bias_initializer,
                name="bias",
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
                trainable=True,
            )
        if rank:
            self.enable_lora(rank, lora_alpha=self.lora_alpha)

    @property
    def variable_serialization_spec(self):
        """Keras's saved variables of the Embedding, then the bias (when `use_bias`)."""
        spec = super().variable_serialization_spec
        if not self.use_bias:
            return spec
        return {mode: list(names) + ["bias"] for mode, names in spec.items()}

    def get_config(self):
        config = super().get_config()
        config.update(
            use_bias=self.use_bias,
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            bias_regularizer=keras.regularizers.serialize(self.bias_regularizer),
            bias_constraint=keras.constraints.serialize(self.bias_constraint),
        )
        return config
