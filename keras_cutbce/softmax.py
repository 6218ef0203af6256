"""The softmax cross-entropy over the full vocabulary: `cut_categorical_crossentropy` and `CutSoftmaxLoss`.

The op and the Keras loss of the softmax family; they run the loss ops'
path (`keras_cutbce.ops`, `keras_cutbce.loss.CutLoss`) with
`family="softmax"`. Implementations: `"chunked"` on every backend,
`"pallas"` on JAX (what `"auto"` runs on TPU), the vocab-sharded path for a
table split over a JAX mesh, and `"reference"`; the Triton kernel is BCE
only so far (docs/cutbce.md).
"""

from typing import Optional

import keras
from keras import ops

from keras_cutbce import checks
from keras_cutbce import ops as cut_ops
from keras_cutbce.loss import CutLoss

__all__ = ["CutSoftmaxLoss", "cut_categorical_crossentropy"]


def cut_categorical_crossentropy(
    hidden,
    embeddings,
    target_ids,
    bias=None,
    *,
    label_smoothing: float = 0.0,
    chunk_size: Optional[int] = None,
    implementation: str = "auto",
):
    """Computes the per-position softmax cross-entropy over the full vocabulary, without logits.

    For each position with logits `z = h @ E.T + b` and valid target ids `P`
    (ids in `[0, V)`, a repeated id counted once), returns `logsumexp(z) -
    sum_v y'_v z_v` with `y = multi_hot(P) / |P|` and `y' = y (1 - a) + a / V`:
    `keras.losses.categorical_crossentropy(y, z, from_logits=True,
    label_smoothing=a)` (for one id a position,
    `sparse_categorical_crossentropy`), computed tile by tile over the
    vocabulary so the `[positions, V]` logits never exist. A position
    without a valid id is padding: loss 0, no gradient. Gradients for
    `hidden`, the table and `bias` are exact for any cotangent; float32
    accumulation with a running max (exact at saturated logits).

    Args:
        hidden: float tensor `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]`, as for `cut_binary_crossentropy`.
        target_ids: integer ids `[..., L]` (or `[...]`, one a position).
        bias: optional float `[V]`, for a table without its own bias.
        label_smoothing: float in `[0, 1]`.
        chunk_size: vocabulary tile width; `None` uses the default rule.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX) or
            `"reference"` (dense); `"triton"` raises `NotImplementedError`
            (not yet).

    Returns:
        Float32 loss of shape `hidden.shape[:-1]`.

    Example:

    >>> import numpy as np
    >>> h = np.log(np.array([[1.0, 2.0, 1.0]], "float32"))
    >>> loss = cut_categorical_crossentropy(h, np.eye(3, dtype="float32"), [[1]])
    >>> round(float(loss[0]), 4)
    0.6931
    """
    options = checks.loss_options(label_smoothing, 1.0, chunk_size, implementation, "softmax")
    inputs = cut_ops.loss_inputs(hidden, embeddings, target_ids, bias)
    return ops.reshape(cut_ops.per_position_loss(inputs, options), inputs.lead_shape)


@keras.saving.register_keras_serializable(package="keras_cutbce")
class CutSoftmaxLoss(CutLoss):
    """Computes the full-vocabulary softmax cross-entropy of hidden states against item ids.

    `cut_categorical_crossentropy` as a Keras loss, with the contract of
    `CutBCELoss`: `y_pred [..., D]` hidden states, `y_true [..., L]` integer
    ids (kept integral; ids outside `[0, V)` are padding), every Keras
    reduction, sample weights and masks with Keras's numbers, the table (and
    an `ItemEmbedding`'s bias) read at each call and trained through the
    loss, serialization. Its value and gradients equal
    `keras.losses.CategoricalCrossentropy(from_logits=True,
    label_smoothing=a)` on the dense logits with the targets `multi_hot /
    |P|`; a position without a valid id has loss 0 (it still counts in
    `"sum_over_batch_size"`'s divisor, as a zero-weight position in Keras).

    Args:
        embeddings: the item table `[V, D]` (as for `CutBCELoss`).
        bias: optional bias `[V]`, for a table without its own.
        label_smoothing: float in `[0, 1]`.
        chunk_size: vocabulary tile width, `None` for the default rule.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX) or `"reference"`.
        reduction: any Keras reduction.
        name: loss name.
        dtype: dtype of the reduced loss (default: Keras's float dtype).

    Example:

    ```python
    items = keras.layers.Embedding(num_items, 64, name="items")
    model.compile(optimizer="adam", loss=CutSoftmaxLoss(items))
    model.fit(sequences, next_items)   # next_items: int [batch, seq]
    ```
    """

    def __init__(
        self,
        embeddings,
        bias=None,
        *,
        label_smoothing: float = 0.0,
        chunk_size: Optional[int] = None,
        implementation: str = "auto",
        reduction: Optional[str] = "sum_over_batch_size",
        name: Optional[str] = "cut_categorical_crossentropy",
        dtype: Optional[str] = None,
    ):
        options = checks.loss_options(label_smoothing, 1.0, chunk_size, implementation, "softmax")
        super().__init__(embeddings, bias, options, reduction=reduction, name=name, dtype=dtype)
