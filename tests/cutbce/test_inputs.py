"""Bad and unusual inputs: the right answer or a clear error, on every backend."""

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, CutSoftmaxLoss, TopKRetrieval, cut_binary_crossentropy
from keras_cutbce import cut_categorical_crossentropy, cut_sampled_softmax_crossentropy, cut_top_k
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


# -- float ids, as Keras's sparse losses take them -----------------------------------


def _id_users(items, hidden, table):
    """Every loss, op and metric that reads ids: name -> function of the ids."""
    from keras_cutbce import MeanReciprocalRank, OutOfRangeTargets, ThresholdConfusion

    def metric(cls):
        def update(ids):
            m = cls(items)
            m.update_state(ids, hidden)
            return m.result()
        return update

    return {
        "CutBCELoss": lambda ids: CutBCELoss(items)(ids, hidden),
        "CutSoftmaxLoss": lambda ids: CutSoftmaxLoss(items, reduction="none")(ids, hidden),
        "cut_categorical_crossentropy": lambda ids: cut_categorical_crossentropy(hidden, table, ids),
        "cut_rank": lambda ids: cut_rank(hidden, table, ids[..., :1], exclude_ids=ids),
        "cut_top_k": lambda ids: cut_top_k(hidden, table, 3, exclude_ids=ids)[1],
        "TopKRetrieval": metric(lambda t: TopKRetrieval(t, k=(1, 3))),
        "MeanReciprocalRank": metric(MeanReciprocalRank),
        "ThresholdConfusion": metric(ThresholdConfusion),
        "OutOfRangeTargets": metric(OutOfRangeTargets),
        "cut_sampled_softmax_crossentropy": lambda ids: cut_sampled_softmax_crossentropy(
            hidden, table, ids, np.arange(4)),
        "negative_ids": lambda ids: cut_sampled_softmax_crossentropy(
            hidden, table, np.arange(len(hidden))[:, None], _flat(ids)),
    }


def _flat(ids):
    """The ids as one list `[S]`, NumPy staying NumPy (host data) and a tensor a tensor."""
    return ids.reshape(-1) if isinstance(ids, np.ndarray) else keras.ops.reshape(ids, (-1,))


def _numbers(value):
    return {k: to_numpy(v) for k, v in value.items()} if isinstance(value, dict) else to_numpy(value)


@pytest.mark.parametrize("form", ["numpy32", "numpy64", "tensor"])
def test_whole_number_float_ids_give_the_int_ids_numbers(form):
    """Keras's SparseCategoricalCrossentropy takes `3.0`; so does every id reader here (V <= 2**24)."""
    hidden, values, ids = case(vocab=11)
    ids[0, 1] = 13  # outside [0, V): padding, as an int id
    items = keras.Variable(values)
    floats = ids.astype("float64" if form == "numpy64" else "float32")
    if form == "tensor":
        floats = keras.ops.convert_to_tensor(floats)
    for name, use in _id_users(items, hidden, values).items():
        want, got = _numbers(use(ids)), _numbers(use(floats))
        if isinstance(want, dict):
            assert want.keys() == got.keys(), name
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("form", ["numpy", "tensor"])
def test_fractional_float_ids_are_refused_where_their_values_are_read(form):
    hidden, values, ids = case(vocab=11)
    items = keras.Variable(values)
    fractional = ids.astype("float32")
    fractional[1, 0] = 2.5
    if form == "tensor":
        fractional = keras.ops.convert_to_tensor(fractional)
    for name, use in _id_users(items, hidden, values).items():
        with pytest.raises(ValueError, match=r"must be whole-number item ids.*values \[2\.5\]"):
            use(fractional)
            pytest.fail(f"{name} took a fractional id")


def test_float_ids_beyond_their_exact_range_keep_the_type_error():
    from keras_cutbce import checks, count_out_of_range_ids

    hidden = np.zeros((2, 4), "float32")
    with pytest.raises(TypeError, match=r"float32: V <= 16777216; V here: 16777217.*dtype=float32"):
        checks.int32_ids(np.array([1.0, 2.0], "float32"), hidden, 2**24 + 1, "target_ids")
    with pytest.raises(TypeError, match=r"float64: V <= 16777216; V here: 16777217"):
        count_out_of_range_ids(np.array([1.0]), 2**24 + 1)
    table = np.zeros((2049, 4), "float32")  # float16 holds every id only up to 2048
    with pytest.raises(TypeError, match=r"`target_ids` must be integer.*float16: V <= 2048"):
        cut_binary_crossentropy(hidden, table, np.array([[1.0], [2.0]], "float16"))
    with pytest.raises(TypeError, match=r"V here: unknown"):
        checks.int32_ids(np.array([1.0]), np.zeros((1, 4), "float32"), None, "target_ids")
    with pytest.raises(TypeError, match=r"`negative_ids` must be integer.*V here: 16777217"):
        checks.negative_ids(np.array([1.0, 2.0], "float32"), 2**24 + 1)
    with pytest.raises(TypeError, match=r"`negative_ids` must be integer.*bfloat16: V <= 256"):
        checks.negative_ids(keras.ops.ones((2,), "bfloat16"), 257)
    with pytest.raises(TypeError, match=r"`negative_ids` must be integer.*dtype=bool"):
        checks.negative_ids(np.array([True, False]), 5)


@pytest.mark.slow
def test_fit_with_float_targets_trains_as_with_int_targets():
    """In `fit` (traced on JAX and TensorFlow, eager on torch) float targets give the int targets' steps."""
    from tests.cutbce.test_training_loops import data, tied_model

    x, y = data()
    runs = []
    for targets in (y, y.astype("float32")):
        model, items = tied_model()
        model.compile(optimizer="adam", loss=CutSoftmaxLoss(items, chunk_size=8),
                      metrics=[TopKRetrieval(items, k=3)])
        history = model.fit(x, targets, batch_size=3, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history, [to_numpy(w) for w in model.weights]))
    (h_int, w_int), (h_float, w_float) = runs
    assert h_int.keys() == h_float.keys()
    for key in h_int:
        np.testing.assert_allclose(h_float[key], h_int[key], rtol=1e-6, err_msg=key)
    for a, b in zip(w_float, w_int):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
