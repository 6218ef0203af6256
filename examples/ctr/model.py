"""CTR ranking model with six dense sub-architectures, optionally detached.

Inputs are Criteo-shaped: `dense [B, 13]` floats and `sparse [B, 26]`
hashed ids (one shared embedding table, see `data.py`). Every tower reads
the same feature vector `concat(dense, flatten(embeddings))` and is one of
the classic CTR interaction architectures:

| tower | what it computes |
|---|---|
| `bottom_mlp` | MLP on the dense features (DLRM's bottom MLP) |
| `deep_mlp` | MLP on all features (the "deep" of Wide & Deep) |
| `cross_network` | DCN-v2 cross layers `x0 * (W x + b) + x` |
| `dot_interaction` | pairwise dot products of the feature embeddings (DLRM) |
| `factorization_machine` | FM second-order term `((sum v)^2 - sum v^2) / 2` |
| `wide_linear` | a linear layer on all features (the "wide") |

With `detached=True` each tower is a `keras_erase.DetachBlock` with its own
logistic head and BCE loss (its output is stop-gradiented, so the top MLP's
loss does not reach it) and the model is a `keras_erase.EraseModel`, whose
torch train step starts each tower's backward as soon as its local loss is
known. With `detached=False` it is the same network trained end to end, the
quality baseline.

Example:

```python
model = build_ctr_model(detached=True, dispatch="threaded")
model.compile(optimizer="adam", loss="binary_crossentropy",
              metrics=[NormalizedEntropy(), keras.metrics.AUC(name="auc")])
```
"""

import numpy as np

import keras
from keras import layers, ops

from examples.ctr.data import NUM_DENSE, NUM_SPARSE

TOWERS = (
    "bottom_mlp",
    "deep_mlp",
    "cross_network",
    "dot_interaction",
    "factorization_machine",
    "wide_linear",
)


@keras.saving.register_keras_serializable(package="examples_ctr")
class NormalizedEntropy(keras.metrics.Metric):
    """Normalized entropy: log loss divided by the entropy of the empirical CTR.

    `NE = mean(BCE(y, p)) / H(ctr)` with `H(c) = -c log c - (1 - c) log(1 - c)`
    and `ctr` the mean label of everything seen since the last reset. Lower
    is better; 1.0 is as good as always predicting the average CTR.

    Args:
        from_logits: whether `y_pred` are logits (default: probabilities).
        epsilon: clipping of probabilities.

    Example:

    ```python
    ne = NormalizedEntropy()
    ne.update_state([[1.0], [0.0]], [[0.8], [0.3]])
    float(ne.result())
    ```
    """

    def __init__(self, name="ne", from_logits=False, epsilon=1e-7, **kwargs):
        super().__init__(name=name, **kwargs)
        self.from_logits = from_logits
        self.epsilon = epsilon
        self.cross_entropy = self.add_variable((), initializer="zeros", name="cross_entropy")
        self.positives = self.add_variable((), initializer="zeros", name="positives")
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = ops.reshape(ops.cast(y_true, "float32"), (-1,))
        y_pred = ops.reshape(ops.cast(y_pred, "float32"), (-1,))
        if self.from_logits:
            ce = ops.softplus(y_pred) - y_true * y_pred
        else:
            p = ops.clip(y_pred, self.epsilon, 1.0 - self.epsilon)
            ce = -(y_true * ops.log(p) + (1.0 - y_true) * ops.log(1.0 - p))
        weight = ops.ones_like(y_true)
        if sample_weight is not None:
            weight = ops.reshape(
                ops.broadcast_to(ops.cast(sample_weight, "float32"), ops.shape(y_true)), (-1,)
            )
        self.cross_entropy.assign_add(ops.sum(ce * weight))
        self.positives.assign_add(ops.sum(y_true * weight))
        self.count.assign_add(ops.sum(weight))

    def result(self):
        count = ops.maximum(self.count, 1e-12)
        ctr = ops.clip(self.positives / count, self.epsilon, 1.0 - self.epsilon)
        entropy = -(ctr * ops.log(ctr) + (1.0 - ctr) * ops.log(1.0 - ctr))
        return (self.cross_entropy / count) / entropy

    def get_config(self):
        return {**super().get_config(), "from_logits": self.from_logits, "epsilon": self.epsilon}


def _split_features(x, embedding_dim):
    """`[B, 13 + 26 E]` -> dense `[B, 13]`, embeddings `[B, 26, E]`."""
    dense = x[:, :NUM_DENSE]
    embedded = ops.reshape(x[:, NUM_DENSE:], (-1, NUM_SPARSE, embedding_dim))
    return dense, embedded


@keras.saving.register_keras_serializable(package="examples_ctr")
class Tower(layers.Layer):
    """One CTR sub-architecture on the shared feature vector -> `[B, width]`.

    Args:
        kind: one of `TOWERS`.
        width: output width (and hidden width of the MLPs).
        embedding_dim: width `E` of the categorical embeddings inside the
            feature vector.
        depth: MLP / cross layers.
    """

    def __init__(self, kind, width=128, embedding_dim=16, depth=3, **kwargs):
        super().__init__(**kwargs)
        if kind not in TOWERS:
            raise ValueError(f"`kind` must be one of {TOWERS}; received {kind!r}.")
        self.kind, self.width = kind, width
        self.embedding_dim, self.depth = embedding_dim, depth
        self.input_width = NUM_DENSE + NUM_SPARSE * embedding_dim
        if kind in ("bottom_mlp", "deep_mlp"):
            self.mlp = [layers.Dense(width, activation="relu") for _ in range(depth - 1)]
            self.mlp.append(layers.Dense(width))
        elif kind == "cross_network":
            self.cross = [layers.Dense(self.input_width) for _ in range(depth)]
            self.project = layers.Dense(width)
        elif kind == "dot_interaction":
            self.dense_to_embedding = layers.Dense(embedding_dim)
            n = NUM_SPARSE + 1
            rows, cols = np.triu_indices(n, k=1)
            self.pair_index = (rows * n + cols).astype("int32")
            self.project = layers.Dense(width)
        else:  # factorization_machine, wide_linear
            self.project = layers.Dense(width)

    def build(self, input_shape):
        batch = input_shape[0]
        e = self.embedding_dim
        if self.kind in ("bottom_mlp", "deep_mlp"):
            width = NUM_DENSE if self.kind == "bottom_mlp" else self.input_width
            for layer in self.mlp:
                layer.build((batch, width))
                width = layer.units
        elif self.kind == "cross_network":
            for layer in self.cross:
                layer.build((batch, self.input_width))
            self.project.build((batch, self.input_width))
        elif self.kind == "dot_interaction":
            self.dense_to_embedding.build((batch, NUM_DENSE))
            self.project.build((batch, len(self.pair_index) + e))
            # A device tensor made once: converting the numpy index in every call would
            # copy host data each step (which a CUDA Graph capture refuses).
            self.pair_index_tensor = ops.convert_to_tensor(self.pair_index)
        elif self.kind == "factorization_machine":
            self.project.build((batch, e + NUM_DENSE))
        else:
            self.project.build((batch, self.input_width))

    def call(self, x):
        dense, embedded = _split_features(x, self.embedding_dim)
        if self.kind in ("bottom_mlp", "deep_mlp"):
            h = dense if self.kind == "bottom_mlp" else x
            for layer in self.mlp:
                h = layer(h)
            return h
        if self.kind == "cross_network":
            h = x
            for layer in self.cross:
                h = x * layer(h) + h
            return self.project(h)
        if self.kind == "dot_interaction":
            d = self.dense_to_embedding(dense)
            vectors = ops.concatenate([d[:, None, :], embedded], axis=1)  # [B, 27, E]
            gram = ops.matmul(vectors, ops.transpose(vectors, (0, 2, 1)))
            n = NUM_SPARSE + 1
            pairs = ops.take(ops.reshape(gram, (-1, n * n)), self.pair_index_tensor, axis=1)
            return self.project(ops.concatenate([pairs, d], axis=1))
        if self.kind == "factorization_machine":
            total = ops.sum(embedded, axis=1)
            second_order = 0.5 * (total * total - ops.sum(embedded * embedded, axis=1))
            return self.project(ops.concatenate([second_order, dense], axis=1))
        return self.project(x)  # wide_linear

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.width)

    def get_config(self):
        return {
            **super().get_config(),
            "kind": self.kind,
            "width": self.width,
            "embedding_dim": self.embedding_dim,
            "depth": self.depth,
        }


def build_ctr_model(
    detached=True,
    *,
    buckets=1000,
    embedding_dim=16,
    width=128,
    depth=3,
    local_loss_weight=1.0,
    detach_input=False,
    dispatch="auto",
    cuda_graphs=False,
    num_streams=None,
    initial_ctr=None,
):
    """The CTR model: six towers feeding a top MLP with a sigmoid output.

    Args:
        detached: wrap each tower in a `DetachBlock` (with a `Dense(1)` logit
            head and `BinaryCrossentropy(from_logits=True)` local loss) and
            return an `EraseModel`; otherwise a plain `keras.Model`.
        buckets: hashed ids per categorical feature (table rows: `26 * buckets`).
        embedding_dim: categorical embedding width.
        width: tower width.
        depth: tower depth.
        local_loss_weight: weight of every tower's local loss.
        detach_input: whether the towers' inputs are stop-gradiented too.
            Default False: each tower's local loss also trains the shared
            embedding table (otherwise no loss would reach it).
        dispatch, cuda_graphs, num_streams: `EraseModel` schedule options.
        initial_ctr: if given, the output and head biases start at its logit,
            so training starts from the average CTR (NE near 1), not 0.5.

    Returns:
        A Keras model with inputs `{"dense", "sparse"}` and output `"ctr"`.
    """
    dense = keras.Input((NUM_DENSE,), name="dense")
    sparse = keras.Input((NUM_SPARSE,), dtype="int32", name="sparse")
    embedded = layers.Embedding(NUM_SPARSE * buckets, embedding_dim, name="embeddings")(sparse)
    features = layers.Concatenate(name="features")(
        [dense, layers.Flatten(name="flatten")(embedded)]
    )
    bias = "zeros"
    if initial_ctr is not None:
        bias = keras.initializers.Constant(float(np.log(initial_ctr / (1.0 - initial_ctr))))
    outputs = []
    for kind in TOWERS:
        tower = Tower(kind, width, embedding_dim, depth, name=kind)
        if detached:
            from keras_erase import DetachBlock

            tower = DetachBlock(
                tower,
                head=layers.Dense(1, bias_initializer=bias, name=f"{kind}_head"),
                loss=keras.losses.BinaryCrossentropy(from_logits=True),
                loss_weight=local_loss_weight,
                detach_input=detach_input,
                name=f"{kind}_block",
            )
        outputs.append(tower(features))
    h = layers.Concatenate(name="towers")(outputs)
    h = layers.Dense(width, activation="relu", name="top_1")(h)
    h = layers.Dense(width // 2, activation="relu", name="top_2")(h)
    ctr = layers.Dense(1, activation="sigmoid", bias_initializer=bias, name="ctr")(h)
    inputs = {"dense": dense, "sparse": sparse}
    if not detached:
        return keras.Model(inputs, ctr, name="ctr_baseline")
    from keras_erase import EraseModel

    kwargs = {"dispatch": dispatch, "cuda_graphs": cuda_graphs}
    if num_streams is not None:
        kwargs["num_streams"] = num_streams
    return EraseModel(inputs, ctr, name="ctr_erase", **kwargs)
