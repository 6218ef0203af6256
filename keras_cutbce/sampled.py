"""Sampled softmax with a logQ correction, without logits: `cut_sampled_softmax_crossentropy` and `SampledSoftmaxLoss`."""

import math
from typing import Optional

import keras
import numpy as np
from keras import ops

from keras_cutbce import _keras_private
from keras_cutbce import checks
from keras_cutbce import samplers
from keras_cutbce.item_table import tables_config
from keras_cutbce.loss import CutLoss
from keras_cutbce.registry import run_loss

__all__ = ["SampledSoftmaxLoss", "cut_sampled_softmax_crossentropy"]


def _safe(ids):
    return ops.where(ids < 0, ops.zeros_like(ids), ids)


def _sampled_loss(inputs, negatives, log_q, negative_log_q, remove_accidental_hits, temperature=1.0,
                  row_weights=None, trained=()):
    if inputs.table.layout is not None:
        raise NotImplementedError(
            "The sampled softmax reads the whole item table, and this one is split over "
            "torch.distributed ranks (`ItemEmbedding(vocab_parallel=True)`): train it with "
            "`CutSoftmaxLoss` or `CutBCELoss` (exact, over every item), or build the table with "
            f"`vocab_parallel=False`. Received: a table split over {inputs.table.layout.world} ranks"
        )
    return run_loss("cut_sampled_softmax", "gather", inputs, negatives, log_q=log_q,
                    negative_log_q=negative_log_q, remove_accidental_hits=remove_accidental_hits,
                    temperature=temperature, chunk_size=None, row_weights=row_weights,
                    trained=trained)


def cut_sampled_softmax_crossentropy(
    hidden,
    embeddings,
    target_ids,
    negative_ids,
    bias=None,
    *,
    log_q=None,
    remove_accidental_hits: bool = True,
):
    """The per-position sampled softmax cross-entropy: the targets' and shared negatives' rows only.

    Per position, the softmax cross-entropy over the candidates [its valid,
    distinct targets `P`, then `negative_ids`], each logit `h . E_id + b_id`
    minus `log_q[id]` when given; the targets weighted `1 / |P|` (as
    `cut_categorical_crossentropy`), so the loss is `logsumexp(candidates) -
    mean_{t in P} z_t`. A position without a valid target: 0, no gradient; a
    non-finite hidden state: NaN, as Keras's dense loss gives.
    `tf.nn.sampled_softmax_loss` with unique negatives gives the same number
    (TensorFlow masks one occurrence of a repeated negative per target; this
    masks every occurrence). Memory O(positions x (L + S) + S x D): the
    negatives' rows are gathered once, never `[positions, V]`.

    Args:
        hidden: float `[..., D]`, rank >= 2.
        embeddings: item table `[V, D]`, as for `cut_binary_crossentropy`.
        target_ids: integer ids `[..., L]` (or `[...]`); ids outside `[0, V)`
            are padding, duplicates count once.
        negative_ids: integer ids `[S]` shared by every position; outside
            `[0, V)`: padding (left out); a repeated id is a candidate each time;
            whole-number float ids as for `target_ids`.
        bias: optional float `[V]`, for a table without its own bias.
        log_q: optional float `[V]`, each item's log-probability under the
            sampler (the logQ correction); any per-item constant added to it
            changes nothing.
        remove_accidental_hits: mask every negative equal to one of the
            position's targets.

    Returns:
        Float32 loss of shape `hidden.shape[:-1]`.

    Example:

    >>> import numpy as np
    >>> h = np.zeros((1, 2), "float32")
    >>> round(float(cut_sampled_softmax_crossentropy(h, np.eye(4, 2, dtype="float32"), [[0]],
    ...                                              [1, 2, 0])[0]), 4)   # log 3: 0 is masked
    1.0986
    """
    inputs = checks.loss_inputs(hidden, embeddings, target_ids, bias)
    negatives = checks.negative_ids(negative_ids, inputs.table.vocab_size)
    log_q = checks.check_log_q(log_q, inputs.table.value)
    remove = checks.check_bool(remove_accidental_hits, "remove_accidental_hits")
    negative_log_q = None if log_q is None else ops.take(log_q, _safe(negatives), axis=0)
    return _sampled_loss(inputs, negatives, log_q, negative_log_q, remove)


@keras.saving.register_keras_serializable(package="keras_cutbce")
class SampledSoftmaxLoss(CutLoss):
    """Sampled softmax cross-entropy with a logQ correction, with `CutBCELoss`'s Keras contract.

    Each call (one a training step) draws `num_negatives` ids with
    replacement from `sampler` with Keras's `SeedGenerator` (reproducible
    with `seed`; inside a compiled step on JAX, the draw of step `k` uses the
    generator's state plus `k`, the optimizer's step count, which is what
    the generator reaches on TensorFlow and torch), shared by every
    position, and/or takes the batch's own targets as negatives
    (`in_batch_negatives`), then runs `cut_sampled_softmax_crossentropy`.

    The order, per candidate: the logit `(h . E_id + b_id) / temperature`,
    then the correction `- log(expected count of id)`, then the masks
    (padding, and with `remove_accidental_hits` every negative equal to one
    of the position's targets) to `-inf`.

    The correction (`logq_correction=True`), as TensorFlow's
    `sampled_softmax_loss`: each occurrence of a sampled negative is
    corrected by `log(S q(id))` (so repeats need no special case), each
    in-batch one by `log(N q_b(id))`, `N` the batch's valid targets and `q_b`
    from `item_counts` (or from `sampler` when it is counts), else the
    batch's own frequencies (`N q_b(id)` = the id's count in the batch);
    the targets by `log(S q(t) + N q_b(t))`, their expected count over both
    groups. `"uniform"` alone shifts every logit alike: no change. With
    `in_batch_negatives` and `remove_accidental_hits=False` a position's own
    target is also one of its negatives.

    Args:
        embeddings: the item table `[V, D]` (as for `CutBCELoss`; a table split
            over ranks, `vocab_parallel=True`, raises `NotImplementedError`).
        num_negatives: `S`, ids drawn per call (`>= 0`; 0 needs `in_batch_negatives`).
        sampler: `"uniform"`, `"log_uniform"` (ids by decreasing popularity) or
            item counts `[V]` (see `keras_cutbce.samplers`).
        in_batch_negatives: also use every target of the batch as a negative.
        item_counts: optional counts `[V]` for the in-batch correction.
        remove_accidental_hits: mask negatives equal to a target of the position.
        logq_correction: subtract the log expected counts.
        temperature: positive float dividing the logits.
        seed: int seed of the draws (None: random).
        bias: optional bias `[V]`, for a table without its own.
        reduction, name, dtype: as for any Keras loss.

    Example:

    ```python
    model.compile(optimizer="adam", loss=SampledSoftmaxLoss(items, 256, sampler=item_counts, seed=0))
    ```
    """

    def __init__(
        self,
        embeddings,
        num_negatives: int,
        *,
        sampler="uniform",
        in_batch_negatives: bool = False,
        item_counts=None,
        remove_accidental_hits: bool = True,
        logq_correction: bool = True,
        temperature: float = 1.0,
        seed: Optional[int] = None,
        bias=None,
        reduction: Optional[str] = "sum_over_batch_size",
        name: Optional[str] = "sampled_softmax_crossentropy",
        dtype: Optional[str] = None,
    ):
        super().__init__(embeddings, bias, checks.loss_options(family="softmax"),
                         reduction=reduction, name=name, dtype=dtype)
        self.in_batch_negatives = checks.check_bool(in_batch_negatives, "in_batch_negatives")
        self.num_negatives = checks.check_int(num_negatives, "num_negatives",
                                              minimum=0 if self.in_batch_negatives else 1)
        if isinstance(sampler, str) and sampler not in samplers.NAMES:
            samplers.make_sampler(sampler, 1)  # raises the ValueError
        self.sampler = sampler if isinstance(sampler, str) else np.asarray(sampler, np.float64)
        self.item_counts = None if item_counts is None else np.asarray(item_counts, np.float64)
        self.remove_accidental_hits = checks.check_bool(remove_accidental_hits,
                                                        "remove_accidental_hits")
        self.logq_correction = checks.check_bool(logq_correction, "logq_correction")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            0.0 < temperature < math.inf
        ):
            raise ValueError(
                f"`temperature` must be a finite float > 0. Received: temperature={temperature!r}"
            )
        self.temperature = float(temperature)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def _seed(self):
        """The generator (it advances), or on a JAX trainer step its state plus the traced step count."""
        if keras.backend.backend() == "jax":
            step = _keras_private.jax_step_iterations()
            if step is not None:
                state = self.seed_generator.state.value
                return state + ops.cast(ops.stack([ops.zeros_like(step), step]), state.dtype)
        return self.seed_generator

    def draw(self, vocab_size):
        """The ids `[num_negatives]` one call draws (advances the generator)."""
        return samplers.make_sampler(self.sampler, vocab_size).draw(self.num_negatives, self._seed())

    def _groups(self, inputs, vocab):
        """`[(ids [n], log expected count [V])]`: the sampled draws, the in-batch targets."""
        groups = []
        sampler = samplers.make_sampler(self.sampler, vocab)
        if self.num_negatives:
            ids = sampler.draw(self.num_negatives, self._seed())
            groups.append((ids, sampler.log_q() + math.log(self.num_negatives)))
        if self.in_batch_negatives:
            ids = ops.reshape(inputs.ids, (-1,))
            counts = self.item_counts
            if counts is None and sampler.kind == "counts":
                counts = sampler.counts
            if counts is None:
                log_count = samplers.batch_log_counts(ids, vocab)
            else:
                valid = ops.sum(ops.cast(ids >= 0, "float32"))
                q = samplers.make_sampler(samplers.item_counts(counts, vocab, "item_counts"), vocab)
                log_count = q.log_q() + ops.log(ops.maximum(valid, 1.0))
            groups.append((ids, log_count))
        return groups

    def call(self, y_true, y_pred):
        """Computes the per-position loss `y_pred.shape[:-1]` for integer ids `y_true` (one draw)."""
        table, bias, trained = self._tables()
        inputs = checks.loss_inputs(y_pred, table, self._integral_ids(y_true), bias)
        return self._loss(inputs, trained)

    def _loss(self, inputs, trained, row_weights=None):
        vocab = inputs.table.vocab_size
        if not isinstance(vocab, int):
            raise ValueError("`SampledSoftmaxLoss` needs a table of static size [V, D].")
        groups = self._groups(inputs, vocab)
        negatives = ops.concatenate([ids for ids, _ in groups], axis=0)
        log_q = negative_log_q = None
        if self.logq_correction:
            negative_log_q = ops.concatenate(
                [ops.take(counts, _safe(ids), axis=0) for ids, counts in groups], axis=0
            )
            log_q = groups[0][1]
            for _, counts in groups[1:]:
                log_q = ops.logaddexp(log_q, counts)
        return _sampled_loss(inputs, negatives, log_q, negative_log_q, self.remove_accidental_hits,
                             self.temperature, row_weights, trained)

    def get_config(self):
        """The config: the table as for `CutBCELoss`, the sampler and counts as lists."""
        config = keras.losses.Loss.get_config(self)
        config.update(
            **tables_config(self.embeddings, self.bias),
            num_negatives=self.num_negatives,
            sampler=self.sampler if isinstance(self.sampler, str) else self.sampler.tolist(),
            in_batch_negatives=self.in_batch_negatives,
            item_counts=None if self.item_counts is None else self.item_counts.tolist(),
            remove_accidental_hits=self.remove_accidental_hits,
            logq_correction=self.logq_correction,
            temperature=self.temperature,
            seed=self.seed,
        )
        return config
