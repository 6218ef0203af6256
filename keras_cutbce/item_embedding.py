"""`ItemEmbedding`: an item table layer that can own a per-item bias, and be split over torch.distributed ranks."""

import keras
from keras import ops

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
        vocab_parallel: torch only: split the table along V over the ranks of
            an initialised `torch.distributed` process group of R ranks: rank
            r holds rows `[r*S, min(V, (r+1)*S))`, `S = ceil(V / R)`, as its
            `embeddings` `[rows, D]` (and its bias slice); the lookup, every
            loss, op and metric give one process's numbers (docs/cutbce.md,
            "A catalogue split over ranks"). On JAX, split the table along V
            over a mesh instead (`keras.distribution.ModelParallel`).
        process_group: the `torch.distributed` group to split over (default:
            the world), with `vocab_parallel=True` only.
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
        vocab_parallel=False,
        process_group=None,
        **kwargs,
    ):
        if not isinstance(use_bias, bool):
            raise TypeError(f"`use_bias` must be a bool. Received: use_bias={use_bias!r}")
        super().__init__(input_dim, output_dim, **kwargs)
        self.vocab_parallel = _check_vocab_parallel(vocab_parallel, process_group, self)
        # The rows this rank holds (`VocabLayout`), or None: the whole table.
        self.vocab_layout = None
        if self.vocab_parallel:
            from keras_cutbce.backends.torch import vocab_parallel as torch_vocab_parallel

            self.vocab_layout = torch_vocab_parallel.layout_for(self.input_dim, process_group)
        self.use_bias = use_bias
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.bias = None

    def build(self, input_shape=None):
        if self.built:
            return
        if self.vocab_layout is not None:
            self._build_shard()
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

    def _build_shard(self):
        rows = self.vocab_layout.rows
        self._embeddings = self.add_weight(
            shape=(rows, self.output_dim), initializer=self.embeddings_initializer,
            name="embeddings", regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint, trainable=True,
        )
        if self.use_bias:
            self.bias = self.add_weight(
                shape=(rows,), initializer=self.bias_initializer, name="bias",
                regularizer=self.bias_regularizer, constraint=self.bias_constraint, trainable=True,
            )
        for weight in self.weights:  # each rank holds its rows: the ERASE step never averages them
            weight.split_over_ranks = True
        self.built = True

    def call(self, inputs):
        if self.vocab_layout is None:
            return super().call(inputs)
        from keras_cutbce.backends.torch import vocab_parallel as torch_vocab_parallel

        table = ops.convert_to_tensor(self.embeddings)
        rows = torch_vocab_parallel.lookup(table, ops.convert_to_tensor(inputs), self.vocab_layout)
        return ops.cast(rows, self.compute_dtype)

    def save_own_variables(self, store):
        """Saves the whole `[V, D]` table (and bias): a split table is gathered from every rank (a collective)."""
        if self.vocab_layout is None:
            return super().save_own_variables(store)
        from keras_cutbce.backends.torch import vocab_parallel as torch_vocab_parallel

        for index, variable in enumerate(self.weights):
            store[str(index)] = torch_vocab_parallel.gather_table(variable.value, self.vocab_layout)

    def load_own_variables(self, store):
        """Loads a whole table (saved in one process or under any number of ranks); a split table keeps its rows."""
        if self.vocab_layout is None:
            return super().load_own_variables(store)
        start, stop = self.vocab_layout.start, self.vocab_layout.stop
        for index, variable in enumerate(self.weights):
            variable.assign(store[str(index)][start:stop])

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
        if self.vocab_parallel:
            config["vocab_parallel"] = True
        return config

    @classmethod
    def from_config(cls, config):
        """A saved split table splits over the loading run's world group, or loads whole without one."""
        config = dict(config)
        if config.get("vocab_parallel") and not _process_group_ready():
            config["vocab_parallel"] = False
        return cls(**config)


def _process_group_ready():
    if keras.backend.backend() != "torch":
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _check_vocab_parallel(vocab_parallel, process_group, layer):
    if not isinstance(vocab_parallel, bool):
        raise TypeError(f"`vocab_parallel` must be a bool. Received: vocab_parallel={vocab_parallel!r}")
    if process_group is not None and not vocab_parallel:
        raise ValueError("`process_group` splits a `vocab_parallel=True` table. Received: "
                         "process_group with vocab_parallel=False")
    if not vocab_parallel:
        return False
    backend = keras.backend.backend()
    if backend == "jax":
        raise ValueError(
            "`vocab_parallel=True` is the torch way to split the item table over devices. On JAX "
            "split the table along V over a mesh: `keras.distribution.ModelParallel` with a "
            "layout map giving the table `(\"model\", None)` (or `jax.device_put` with a "
            "`NamedSharding`); every loss, op and metric then runs the vocab-sharded path "
            "(docs/cutbce.md). Received: vocab_parallel=True on the 'jax' backend"
        )
    if backend != "torch":
        raise ValueError(
            "`vocab_parallel=True` splits the item table over torch.distributed ranks and needs "
            f"the torch backend. Received: vocab_parallel=True on the {backend!r} backend"
        )
    for name in ("lora_rank", "quantization_mode"):
        if getattr(layer, name, None):
            raise ValueError(f"`vocab_parallel=True` takes no `{name}`. Received: "
                             f"{name}={getattr(layer, name)!r}")
    return True
