"""`cut_top_k`, `cut_rank` and `cut_count_at_least` against dense numpy computations, on every backend.

Inputs are small multiples of 1/4 (and bias of 1/8), so every logit is exact in
float32 whatever the summation order: the ids must match a dense stable sort
exactly, ties (plentiful with such inputs, and forced with duplicated table
rows) included.
"""

import keras
import numpy as np
import pytest

from keras_cutbce.ops import cut_count_at_least, cut_rank, cut_top_k
from tests.backend_utils import BACKEND, to_numpy


def quantized(rng, shape, scale=4):
    return (rng.integers(-4, 5, size=shape) / scale).astype("float32")


def dense_logits(hidden, table, bias=None):
    z = hidden.astype(np.float64) @ table.astype(np.float64).T
    return z if bias is None else z + bias.astype(np.float64)


def dense_top_k(hidden, table, k, bias=None, exclude_ids=None):
    """Numpy oracle: stable sort of -logits (ties: lower id), -inf and id -1 for empty slots."""
    z = dense_logits(hidden, table, bias)
    vocab_size = table.shape[0]
    if exclude_ids is not None:
        for row, excluded in enumerate(exclude_ids):
            valid = excluded[(excluded >= 0) & (excluded < vocab_size)]
            z[row, valid] = -np.inf
    order = np.argsort(-z, axis=1, kind="stable")[:, :k]
    scores = np.take_along_axis(z, order, axis=1)
    return scores, np.where(scores == -np.inf, -1, order)


def check_top_k(hidden, table, k, bias=None, exclude_ids=None, chunk_size=None):
    scores, ids = cut_top_k(
        hidden, table, k, bias=bias, exclude_ids=exclude_ids, chunk_size=chunk_size
    )
    assert keras.backend.standardize_dtype(scores.dtype) == "float32"
    assert keras.backend.standardize_dtype(ids.dtype) == "int32"
    lead = hidden.shape[:-1]
    assert tuple(scores.shape) == lead + (k,) and tuple(ids.shape) == lead + (k,)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_exclude = None if exclude_ids is None else exclude_ids.reshape(len(flat_hidden), -1)
    want_scores, want_ids = dense_top_k(flat_hidden, table, k, bias, flat_exclude)
    np.testing.assert_array_equal(to_numpy(ids).reshape(-1, k), want_ids)
    np.testing.assert_array_equal(to_numpy(scores).reshape(-1, k), want_scores)
    return want_scores, want_ids


@pytest.mark.parametrize(
    "vocab_size, chunk_size, k",
    [
        (37, 8, 5),  # V > tile, V not a multiple of the tile
        (37, 8, 20),  # k > tile
        (37, 8, 1),  # k = 1
        (37, 8, 37),  # k = V
        (10, 64, 4),  # V < tile
        (32, 8, 8),  # V a multiple of the tile, k = tile
        (37, 1, 3),  # tile of one item
    ],
)
def test_top_k_matches_dense(rng, vocab_size, chunk_size, k):
    hidden = quantized(rng, (6, 5))
    table = quantized(rng, (vocab_size, 5))
    check_top_k(hidden, table, k, chunk_size=chunk_size)


def test_top_k_ties_go_to_lower_id(rng):
    base = quantized(rng, (5, 4))
    # Every row appears several times, across and within tiles.
    table = np.concatenate([base, base[::-1], base, base[:3]], axis=0)
    hidden = quantized(rng, (7, 4))
    hidden[0] = 0.0  # all logits equal: the answer is 0, 1, 2, ...
    _, want_ids = check_top_k(hidden, table, 9, chunk_size=4)
    np.testing.assert_array_equal(want_ids[0], np.arange(9))
    assert len(set(map(tuple, want_ids))) > 1


def test_top_k_with_bias(rng):
    hidden = quantized(rng, (6, 3))
    table = quantized(rng, (29, 3))
    bias = quantized(rng, (29,), scale=8)
    check_top_k(hidden, table, 7, bias=bias, chunk_size=8)


def test_top_k_exclusions_with_padding_ids(rng):
    vocab_size = 23
    hidden = quantized(rng, (5, 4))
    table = quantized(rng, (vocab_size, 4))
    exclude = rng.integers(-3, vocab_size + 3, size=(5, 9)).astype("int32")
    exclude[0, :3] = [-1, vocab_size, vocab_size + 100]  # padding, ignored
    exclude[1, :] = exclude[1, 0]  # duplicates
    check_top_k(hidden, table, 6, exclude_ids=exclude, chunk_size=8)
    check_top_k(hidden, table, 15, exclude_ids=exclude, chunk_size=4)


def test_top_k_fewer_items_than_k_after_exclusions(rng):
    vocab_size = 11
    hidden = quantized(rng, (3, 4))
    table = quantized(rng, (vocab_size, 4))
    exclude = np.array(
        [[0, 1, 2, -1], [10, 10, 5, 99], [-5, -5, -5, -5]], dtype="int32"
    )
    scores, ids = check_top_k(hidden, table, vocab_size, exclude_ids=exclude, chunk_size=4)
    # Row 0 lost 3 items: its last 3 slots are empty (-inf, id -1).
    np.testing.assert_array_equal(ids[0, -3:], [-1, -1, -1])
    assert np.all(np.isinf(scores[0, -3:])) and np.all(np.isfinite(scores[0, :-3]))
    assert np.all(ids[2] >= 0)


def test_top_k_rank_3_hidden_and_exclusions(rng):
    hidden = quantized(rng, (2, 3, 4))
    table = quantized(rng, (19, 4))
    exclude = rng.integers(-1, 19, size=(2, 3, 5)).astype("int32")
    check_top_k(hidden, table, 4, exclude_ids=exclude, chunk_size=8)
    check_top_k(hidden, table, 4, chunk_size=None)


def test_top_k_random_normal_inputs(rng):
    """Generic float inputs: same ids as dense where the gaps are not at rounding level."""
    hidden = rng.normal(size=(16, 8)).astype("float32")
    table = rng.normal(size=(300, 8)).astype("float32")
    scores, ids = cut_top_k(hidden, table, 10, chunk_size=64)
    want_scores, want_ids = dense_top_k(hidden, table, 10)
    np.testing.assert_allclose(to_numpy(scores), want_scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(to_numpy(ids), want_ids)


def test_top_k_embedding_layer(rng):
    layer = keras.layers.Embedding(17, 4)
    layer.build()
    table = quantized(rng, (17, 4))
    layer.embeddings.assign(table)
    hidden = quantized(rng, (3, 4))
    scores, ids = cut_top_k(hidden, layer, 5, chunk_size=8)
    np.testing.assert_array_equal(to_numpy(ids), dense_top_k(hidden, table, 5)[1])


def test_top_k_bad_k(rng):
    hidden = quantized(rng, (3, 4))
    table = quantized(rng, (7, 4))
    for k in (0, 8, 2.0):
        with pytest.raises(ValueError, match="`k`"):
            cut_top_k(hidden, table, k)


@pytest.mark.parametrize("vocab_size, chunk_size", [(41, 8), (41, 64), (40, 8)])
def test_count_at_least_matches_dense(rng, vocab_size, chunk_size):
    hidden = quantized(rng, (2, 3, 4))
    table = quantized(rng, (vocab_size, 4))
    bias = quantized(rng, (vocab_size,), scale=8)
    for b in (None, bias):
        z = dense_logits(hidden.reshape(-1, 4), table, b)
        # Exact thresholds, one of them a logit itself: the `>=` boundary counts.
        for threshold in (0.0, 0.5, -0.25, float(z[1, 2])):
            counts = cut_count_at_least(hidden, table, threshold, bias=b, chunk_size=chunk_size)
            assert keras.backend.standardize_dtype(counts.dtype) == "int32"
            assert tuple(counts.shape) == (2, 3)
            want = np.sum(z >= threshold, axis=1).reshape(2, 3)
            np.testing.assert_array_equal(to_numpy(counts), want)


def dense_rank(hidden, table, ids, bias=None, exclude_ids=None):
    """Numpy oracle: 1 + the position of the first of `ids` in the stable sort of -logits, 0 if none."""
    vocab_size = table.shape[0]
    _, order = dense_top_k(hidden, table, vocab_size, bias, exclude_ids)
    ranks = []
    for row, items in enumerate(ids):
        wanted = {int(i) for i in np.atleast_1d(items) if 0 <= i < vocab_size}
        found = [r for r, i in enumerate(order[row]) if i in wanted]
        ranks.append(found[0] + 1 if found else 0)
    return np.array(ranks)


@pytest.mark.parametrize("vocab_size, chunk_size", [(41, 8), (41, 64), (40, 1)])
def test_rank_matches_dense(rng, vocab_size, chunk_size):
    """The rank of a position's first item, ties to the lower id, exclusions out of the ranking."""
    base = quantized(rng, (vocab_size // 2 + 1, 4))
    table = np.concatenate([base, base])[:vocab_size]  # twins: every logit tied
    bias = quantized(rng, (vocab_size,), scale=8)
    hidden = quantized(rng, (2, 5, 4))
    ids = rng.integers(-1, vocab_size, size=(2, 5, 3))
    ids[0, 0] = -1  # padding only: rank 0
    ids[1, 1] = [vocab_size + 3, 2**20, -5]  # out of range: padding
    exclude = rng.integers(-1, vocab_size, size=(2, 5, 6))
    exclude[0, 1, :3] = ids[0, 1]  # every item excluded: rank 0
    for b in (None, bias):
        for x in (None, exclude):
            ranks = cut_rank(hidden, table, ids, bias=b, exclude_ids=x, chunk_size=chunk_size)
            assert keras.backend.standardize_dtype(ranks.dtype) == "int32"
            assert tuple(ranks.shape) == (2, 5)
            flat_x = None if x is None else x.reshape(10, -1)
            want = dense_rank(hidden.reshape(10, 4), table, ids.reshape(10, 3), b, flat_x)
            np.testing.assert_array_equal(to_numpy(ranks).reshape(-1), want)
            assert want.max() > 5 and (want == 0).sum() >= 1
    one = cut_rank(hidden, table, ids[..., 0], chunk_size=chunk_size)  # one id a position
    want = dense_rank(hidden.reshape(10, 4), table, ids[..., :1].reshape(10, 1))
    np.testing.assert_array_equal(to_numpy(one).reshape(-1), want)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit only on the JAX backend")
def test_top_k_under_jax_jit(rng):
    import jax

    hidden = quantized(rng, (6, 4))
    table = quantized(rng, (37, 4))
    bias = quantized(rng, (37,), scale=8)
    exclude = rng.integers(-1, 37, size=(6, 3)).astype("int32")

    @jax.jit
    def run(h, e, b, x):
        return cut_top_k(h, e, 12, bias=b, exclude_ids=x, chunk_size=8)

    scores, ids = run(hidden, table, bias, exclude)
    want_scores, want_ids = dense_top_k(hidden, table, 12, bias, exclude)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(scores), want_scores)
    counts = jax.jit(lambda h, e: cut_count_at_least(h, e, 0.5, chunk_size=8))(hidden, table)
    np.testing.assert_array_equal(
        np.asarray(counts), np.sum(dense_logits(hidden, table) >= 0.5, axis=1)
    )
    ranks = jax.jit(lambda h, e, x: cut_rank(h, e, x[:, :2], exclude_ids=x, chunk_size=8))(
        hidden, table, exclude
    )  # every item excluded: rank 0
    np.testing.assert_array_equal(np.asarray(ranks), np.zeros(6))
    ranks = jax.jit(lambda h, e, i: cut_rank(h, e, i, bias=bias, chunk_size=8))(
        hidden, table, exclude
    )
    np.testing.assert_array_equal(np.asarray(ranks), dense_rank(hidden, table, exclude, bias))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function only on TensorFlow")
def test_top_k_under_tf_function(rng):
    import tensorflow as tf

    hidden = quantized(rng, (6, 4))
    table = quantized(rng, (37, 4))
    exclude = rng.integers(-1, 37, size=(6, 3)).astype("int32")

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, 4], tf.float32),
            tf.TensorSpec([None, 4], tf.float32),
            tf.TensorSpec([None, None], tf.int32),
        ]
    )
    def run(h, e, x):
        return cut_top_k(h, e, 12, exclude_ids=x, chunk_size=8), cut_rank(h, e, x, chunk_size=8)

    (scores, ids), ranks = run(hidden, table, exclude)
    np.testing.assert_array_equal(ranks.numpy(), dense_rank(hidden, table, exclude))
    want_scores, want_ids = dense_top_k(hidden, table, 12, None, exclude)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_array_equal(scores.numpy(), want_scores)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_top_k_under_every_policy(rng, policy):
    """Hidden states in the policy's compute dtype (exact for these values) and the model's
    float32 table give the float32 answer, ties included."""
    from tests.backend_utils import dtype_policy

    hidden = quantized(rng, (5, 4))
    table = quantized(rng, (29, 4))
    with dtype_policy(policy) as compute:
        items = keras.layers.Embedding(29, 4)
        items.build()
        items.embeddings.assign(table)
        scores, ids = cut_top_k(keras.ops.cast(hidden, compute), items, 6, chunk_size=8)
    assert keras.backend.standardize_dtype(scores.dtype) == "float32"
    want_scores, want_ids = dense_top_k(hidden, table, 6)
    np.testing.assert_array_equal(to_numpy(ids), want_ids)
    np.testing.assert_array_equal(to_numpy(scores), want_scores)
