"""Bad and unusual inputs: the right answer or a clear error, on every backend."""

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, TopKRetrieval, cut_binary_crossentropy, cut_top_k
from keras_cutbce.ops import cut_count_at_least, cut_rank
from tests.backend_utils import dtype_name, to_numpy


def case(seed=0, rows=3, dim=4, vocab=11):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(rows, dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    ids = rng.integers(-1, vocab, size=(rows, 2))
    return hidden, table, ids


# -- clear errors naming the argument ----------------------------------------


def test_empty_vocabulary_names_embeddings():
    hidden, _, ids = case()
    empty = np.zeros((0, 4), "float32")
    for call in (
        lambda: cut_binary_crossentropy(hidden, empty, ids),
        lambda: cut_top_k(hidden, empty, 1),
        lambda: cut_count_at_least(hidden, empty, 0.0),
        lambda: CutBCELoss(keras.Variable(empty))(ids, hidden),
    ):
        with pytest.raises(ValueError, match=r"`embeddings`.*V >= 1"):
            call()


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(pos_weight=float("inf")), ValueError, "`pos_weight` must be a finite float > 0"),
        (dict(pos_weight=float("nan")), ValueError, "`pos_weight` must be a finite float > 0"),
        (dict(pos_weight="2"), TypeError, "`pos_weight` must be a float"),
        (dict(label_smoothing="x"), TypeError, "`label_smoothing` must be a float"),
        (dict(label_smoothing=float("nan")), ValueError, r"`label_smoothing` must be in \[0, 1\]"),
        (dict(chunk_size=2.5), ValueError, "`chunk_size` must be None or a positive int"),
        (dict(implementation="fast"), ValueError, "`implementation` must be one of"),
    ],
)
def test_bad_scalars_name_the_argument(kwargs, error, words):
    hidden, table, ids = case()
    with pytest.raises(error, match=words):
        cut_binary_crossentropy(hidden, table, ids, **kwargs)
    with pytest.raises(error, match=words):
        CutBCELoss(keras.Variable(table), **kwargs)


def test_numpy_integers_are_ints():
    hidden, table, ids = case()
    want = to_numpy(cut_binary_crossentropy(hidden, table, ids, chunk_size=4))
    got = cut_binary_crossentropy(hidden, table, ids, chunk_size=np.int64(4))
    np.testing.assert_allclose(to_numpy(got), want, rtol=1e-6)
    loss = CutBCELoss(keras.Variable(table), chunk_size=np.int32(4))
    assert loss.chunk_size == 4 and type(loss.chunk_size) is int
    np.testing.assert_allclose(to_numpy(loss(ids, hidden)), want.mean(), rtol=1e-6)
    scores, top = cut_top_k(hidden, table, np.int64(3), chunk_size=np.int64(4))
    assert tuple(top.shape) == (3, 3)
    metric = TopKRetrieval(keras.Variable(table), k=(np.int64(1), np.int32(3)), chunk_size=np.int64(4))
    assert metric.k == (1, 3)
    metric.update_state(ids, hidden)


@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_zero_rows(implementation):
    _, table, _ = case()
    hidden = np.zeros((0, 4), "float32")
    ids = np.zeros((0, 2), "int32")
    loss = cut_binary_crossentropy(hidden, table, ids, implementation=implementation)
    assert tuple(loss.shape) == (0,) and dtype_name(loss) == "float32"
    total = CutBCELoss(keras.Variable(table), implementation=implementation, reduction="sum")(ids, hidden)
    assert float(to_numpy(total)) == 0.0


# -- one output dtype -------------------------------------------------------------


def test_float64_inputs_give_float32_everywhere():
    hidden, table, ids = case()
    h64, t64 = hidden.astype("float64"), table.astype("float64")
    for implementation in ("chunked", "reference"):
        loss = cut_binary_crossentropy(h64, t64, ids, implementation=implementation)
        assert dtype_name(loss) == "float32", implementation
        np.testing.assert_allclose(
            to_numpy(loss), to_numpy(cut_binary_crossentropy(hidden, table, ids)), rtol=1e-5
        )
    scores, _ = cut_top_k(h64, t64, 3)
    assert dtype_name(scores) == "float32"
    assert dtype_name(CutBCELoss(keras.Variable(t64))(ids, h64)) == keras.config.floatx()


# -- NaN logits: no ranking, the same on every backend ------------------------------


def test_nan_hidden_row_has_nan_scores_and_empty_ids():
    hidden, table, _ = case(rows=4)
    hidden[1, 2] = np.nan
    scores, ids = cut_top_k(hidden, table, 3, chunk_size=4)
    scores, ids = to_numpy(scores), to_numpy(ids)
    assert np.isnan(scores[1]).all() and (ids[1] == -1).all()
    clean = [0, 2, 3]
    want_scores, want_ids = cut_top_k(hidden[clean], table, 3, chunk_size=4)
    np.testing.assert_array_equal(ids[clean], to_numpy(want_ids))
    np.testing.assert_allclose(scores[clean], to_numpy(want_scores), rtol=1e-6)


@pytest.mark.parametrize("item", [0, 5, 10])  # first tile, middle, the narrower last tile
def test_nan_table_row_leaves_no_ranking_on_every_backend(item):
    """A NaN table row makes a NaN logit in every row: no ranking, never a first place or a skip."""
    hidden, table, ids = case(rows=4)
    table[item] = np.nan
    scores, top = cut_top_k(hidden, table, 3, chunk_size=4)
    assert np.isnan(to_numpy(scores)).all() and (to_numpy(top) == -1).all()
    assert (to_numpy(cut_count_at_least(hidden, table, 0.0, chunk_size=4)) == -1).all()
    assert (to_numpy(cut_rank(hidden, table, ids, chunk_size=4)) == -1).all()
    # Excluding the item does not hide it: the model is broken either way.
    excluded = np.full((4, 1), item)
    _, top = cut_top_k(hidden, table, 3, exclude_ids=excluded, chunk_size=4)
    assert (to_numpy(top) == -1).all()
