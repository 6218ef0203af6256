"""The softmax cross-entropy over the full vocabulary: `cut_categorical_crossentropy` and `CutSoftmaxLoss`."""

from typing import Optional

import keras

from keras_cutbce import checks
from keras_cutbce.loss import CutLoss
from keras_cutbce.registry import run_loss

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
    """The per-position softmax cross-entropy over the full vocabulary, without logits.

    `keras.losses.categorical_crossentropy(multi_hot(P) / |P|, h @ E.T + b,
    from_logits=True, label_smoothing=a)` for the valid, distinct ids `P`
    (`sparse_categorical_crossentropy` for one id); a position without a valid
    id has loss 0 and no gradient (NaN, as in Keras, where its hidden state is
    not finite).

    Args:
        hidden: float `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]`, as for `cut_binary_crossentropy`.
        target_ids: integer ids `[..., L]` (or `[...]`, one a position).
        bias: optional float `[V]`, for a table without its own bias.
        label_smoothing: float in `[0, 1]`.
        chunk_size: vocabulary tile width; `None`: the default rule.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX), `"triton"` (torch) or
            `"reference"`.

    Returns:
        Float32 loss of shape `hidden.shape[:-1]`.

    Raises:
        ValueError, TypeError: a checked argument is out of its domain (`"pallas"` runs on
            JAX, `"triton"` on torch).

    Example:

    >>> import numpy as np
    >>> h = np.log(np.array([[1.0, 2.0, 1.0]], "float32"))
    >>> round(float(cut_categorical_crossentropy(h, np.eye(3, dtype="float32"), [[1]])[0]), 4)
    0.6931
    """
    options = checks.loss_options(label_smoothing, 1.0, chunk_size, implementation, "softmax")
    inputs = checks.loss_inputs(hidden, embeddings, target_ids, bias)
    return run_loss(options.op, options.implementation, inputs, **options.keywords)


@keras.saving.register_keras_serializable(package="keras_cutbce")
class CutSoftmaxLoss(CutLoss):
    """`cut_categorical_crossentropy` as a Keras loss, with `CutBCELoss`'s contract.

    Equals `keras.losses.CategoricalCrossentropy(from_logits=True,
    label_smoothing=a)` with the targets `multi_hot / |P|`; a position without
    a valid id has loss 0 (and still counts in `"sum_over_batch_size"`). A NaN
    or infinite hidden state gives NaN, as Keras's dense loss does.

    Args:
        embeddings: the item table `[V, D]` (as for `CutBCELoss`).
        bias: optional bias `[V]`, for a table without its own.
        label_smoothing: float in `[0, 1]`.
        chunk_size: vocabulary tile width, `None` for the default rule.
        implementation: `"auto"`, `"chunked"`, `"pallas"` (JAX), `"triton"` (torch) or `"reference"`.
        reduction: any Keras reduction.
        name: loss name.
        dtype: dtype of the reduced loss (default: Keras's float dtype).

    Example:

    ```python
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
