"""Ids of any integer width: ids outside `[0, V)` are padding, never wrapped.

An int64 id `2**32 + 16` cast to int32 is 16, a valid item. The public ops
and the metrics must treat it (and `2**32`, `2**31`, ...) as padding on every
backend: NumPy int64 ids (JAX without x64 would wrap them on conversion) and
int64 backend tensors (torch, TensorFlow).
"""

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, cut_binary_crossentropy, cut_top_k
from keras_cutbce.metrics import ThresholdConfusion, TopKRetrieval
from tests.backend_utils import BACKEND, to_numpy

BIG = 2**32
WRAPPING = [BIG, BIG + 16, 2**31, 2**31 + 3, -(2**32) + 5]  # int32 casts: 0, 16, -2**31, ..., 5


def case(seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(4, 6)).astype("float32")
    table = rng.normal(size=(20, 6)).astype("float32")
    return hidden, table


def int64_inputs(array):
    """The same int64 ids as NumPy and, where the backend has int64 tensors, as a tensor."""
    array = np.asarray(array, "int64")
    forms = [array]
    if BACKEND in ("torch", "tensorflow"):
        forms.append(keras.ops.convert_to_tensor(array, dtype="int64"))
    return forms


def test_wrapping_ids_are_padding_in_the_loss():
    hidden, table = case()
    base = np.array([[1, -1], [2, -1], [3, -1], [4, -1]], "int64")
    want = to_numpy(cut_binary_crossentropy(hidden, table, base, chunk_size=8))
    wrapped = base.copy()
    wrapped[:, 1] = WRAPPING[:4]
    for ids in int64_inputs(wrapped):
        got = to_numpy(cut_binary_crossentropy(hidden, table, ids, chunk_size=8))
        np.testing.assert_allclose(got, want, rtol=1e-6)
        reduced = to_numpy(CutBCELoss(keras.Variable(table), chunk_size=8)(ids, hidden))
        np.testing.assert_allclose(reduced, want.mean(), rtol=1e-6)


@pytest.mark.parametrize("implementation", ["chunked", "reference"])
def test_wrapping_ids_are_padding_for_every_implementation(implementation):
    hidden, table = case(1)
    ids = np.array([[BIG], [BIG + 16], [2**31], [5]], "int64")
    padded = np.array([[-1], [-1], [-1], [5]], "int64")
    got = cut_binary_crossentropy(hidden, table, ids, implementation=implementation)
    want = cut_binary_crossentropy(hidden, table, padded, implementation=implementation)
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=1e-6)


def test_wrapping_exclusions_exclude_nothing_in_top_k():
    hidden, table = case(2)
    _, plain = cut_top_k(hidden, table, 20, chunk_size=8)
    plain = to_numpy(plain)
    wrapped = np.full((4, 1), BIG, "int64") + plain[:, :1]  # casts to each row's best item
    for exclude in int64_inputs(wrapped):
        _, ids = cut_top_k(hidden, table, 20, exclude_ids=exclude, chunk_size=8)
        np.testing.assert_array_equal(to_numpy(ids), plain)


def test_wrapping_ids_in_top_k_retrieval():
    hidden, table = case(3)
    _, ranked = cut_top_k(hidden, table, 20, chunk_size=8)
    best = to_numpy(ranked)[:, 0]
    targets = np.stack([best, np.full(4, BIG + 7)], axis=1).astype("int64")
    for y in int64_inputs(targets):
        metric = TopKRetrieval(keras.Variable(table), k=1, chunk_size=8)
        metric.update_state(y, hidden)
        # Only the valid target counts: each row's best item, a hit with recall 1.
        assert float(to_numpy(metric.result()["recall@1"])) == pytest.approx(1.0)
    # A per-call exclusion and a constructor exclusion that wrap to the best item exclude nothing.
    for exclude in int64_inputs(best[:, None].astype("int64") + BIG):
        metric = TopKRetrieval(keras.Variable(table), k=1, exclude_ids=[BIG + int(best[0])], chunk_size=8)
        metric.update_state(best[:, None], hidden, exclude_ids=exclude)
        assert float(to_numpy(metric.result()["hit@1"])) == pytest.approx(1.0)


def test_wrapping_ids_in_threshold_confusion():
    hidden, table = case(4)
    targets = np.array([[1, BIG + 1], [2, BIG], [3, 2**31], [4, -1]], "int64")
    padded = np.where(targets >= 20, -1, targets)
    want = ThresholdConfusion(keras.Variable(table))
    want.update_state(padded, hidden)
    for y in int64_inputs(targets):
        got = ThresholdConfusion(keras.Variable(table))
        got.update_state(y, hidden)
        for name in ("true_positives", "false_positives", "false_negatives", "true_negatives"):
            assert float(to_numpy(getattr(got, name))) == float(to_numpy(getattr(want, name))), name
