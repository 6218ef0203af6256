"""The TensorFlow chunked CutBCE kernel (`keras_cutbce.backends.tensorflow.chunked`).

The checks shared with the other backends (odd shapes, smoothing and pos_weight
against the reference and Keras BCE, low-precision inputs, id dtypes, extreme
logits, the positives' mask, dispatch through ops) are in
tests/cutbce/test_chunked.py; these are TensorFlow's own.

Loss and gradients (hidden, table, bias) under random cotangents against the
dense reference and Keras's `binary_crossentropy`, on odd shapes; eager,
`tf.function` and XLA agree; unknown batch dimension; Keras `fit`.
"""

import keras
import numpy as np
import pytest

from keras_cutbce.math import reference

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow backend kernel"
)

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    from keras_cutbce.backends.tensorflow import chunked


def make_case(rng, rows, dim, vocab, labels, *, bias=True, id_dtype="int32"):
    """Random inputs with a duplicate and padding ids (-1, V, V+5) mixed in."""
    hidden = (rng.normal(size=(rows, dim)) / np.sqrt(dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    ids = rng.integers(0, vocab, size=(rows, labels))
    if labels >= 2:
        ids[::2, 1] = ids[::2, 0]  # duplicates count once
    if labels >= 3:
        pads = np.array([-1, vocab, vocab + 5])
        ids[1::2, 2] = pads[np.arange(rows)[1::2] % 3]
    b = rng.normal(size=(vocab,)).astype("float32") if bias else None
    cot = rng.uniform(-2.0, 2.0, size=(rows,)).astype("float32")
    return hidden, table, ids.astype(id_dtype), b, cot


def loss_and_grads(fn, hidden, table, ids, bias, cot):
    """`fn(h, t, ids, b)` [M] and the gradients of `sum(loss * cot)` for h, t, b."""
    args = [tf.convert_to_tensor(hidden), tf.convert_to_tensor(table)]
    if bias is not None:
        args.append(tf.convert_to_tensor(bias))
    ids = tf.convert_to_tensor(ids)
    with tf.GradientTape() as tape:
        tape.watch(args)
        loss = fn(args[0], args[1], ids, args[2] if bias is not None else None)
        total = tf.reduce_sum(tf.cast(loss, tf.float32) * tf.convert_to_tensor(cot))
    grads = tape.gradient(total, args)
    return loss, grads


def chunked_fn(label_smoothing=0.0, pos_weight=1.0, chunk_size=128):
    def fn(h, t, ids, b):
        return chunked.cut_bce(
            h, t, ids, b, label_smoothing=label_smoothing, pos_weight=pos_weight,
            chunk_size=chunk_size,
        )

    return fn


def reference_fn(label_smoothing=0.0, pos_weight=1.0):
    def fn(h, t, ids, b):
        return reference.cut_bce(
            h, t, ids, b, label_smoothing=label_smoothing, pos_weight=pos_weight
        )

    return fn


def keras_fn(label_smoothing=0.0):
    def fn(h, t, ids, b):
        z = reference.logits(h, t, b)
        y = reference.multi_hot(ids, t.shape[0])
        return keras.losses.binary_crossentropy(
            y, z, from_logits=True, label_smoothing=label_smoothing
        )

    return fn


def as_numpy(x):
    return np.asarray(tf.cast(x, tf.float64))


def assert_close(actual, expected, rtol, what):
    actual, expected = as_numpy(actual), as_numpy(expected)
    assert actual.shape == expected.shape, what
    assert np.all(np.isfinite(actual)), what
    err = np.max(np.abs(actual - expected), initial=0.0)
    scale = np.max(np.abs(expected), initial=0.0) + 1e-30
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def assert_same(result, expected, rtol=2e-5):
    (loss, grads), (ref_loss, ref_grads) = result, expected
    assert loss.dtype == tf.float32
    assert_close(loss, ref_loss, rtol, "loss")
    for name, g, r in zip(("hidden", "table", "bias"), grads, ref_grads):
        assert_close(g, r, rtol, f"d {name}")


def test_huge_padding_ids_stay_padding():
    """int64 ids beyond int32 (e.g. 2**32 + 1) must not wrap onto valid ids."""
    rng = np.random.default_rng(4)
    h, t, _, b, cot = make_case(rng, 3, 4, 50, 0)
    ids = np.array([[1, 2**32 + 1], [2**40, 3], [-(2**33), 2**31 + 2]], dtype="int64")
    clean = np.where((ids >= 0) & (ids < 50), ids, -1)
    got = loss_and_grads(chunked_fn(chunk_size=16), h, t, ids, b, cot)
    assert_same(got, loss_and_grads(reference_fn(), h, t, clean, b, cot))


def test_only_padding_and_duplicates():
    rng = np.random.default_rng(5)
    h, t, _, b, cot = make_case(rng, 4, 4, 40, 0)
    ids = np.array([[-1, 40, 45, -7], [3, 3, 3, 3], [39, -1, 39, 0], [0, 0, 40, 0]])
    got = loss_and_grads(chunked_fn(chunk_size=16), h, t, ids, b, cot)
    assert_same(got, loss_and_grads(reference_fn(), h, t, ids, b, cot))
    assert_same(got, loss_and_grads(keras_fn(), h, t, ids, b, cot))


def test_eager_function_and_xla_agree():
    rng = np.random.default_rng(8)
    h, t, ids, b, cot = make_case(rng, 9, 8, 300, 4)
    fn = chunked_fn(label_smoothing=0.1, pos_weight=2.0, chunk_size=128)

    def run(h, t, ids, b):
        return loss_and_grads(fn, h, t, ids, b, cot)

    eager = run(h, t, ids, b)
    graph = tf.function(run)(h, t, ids, b)
    xla = tf.function(run, jit_compile=True)(h, t, ids, b)
    for other in (graph, xla):
        assert_same(other, eager, rtol=1e-5)
    assert_same(eager, loss_and_grads(reference_fn(0.1, 2.0), h, t, ids, b, cot))


def _softmax_fns(label_smoothing=0.1):
    """The chunked and reference `cut_softmax`, as `chunked_fn()` and `reference_fn()`."""
    def fn(h, t, ids, b):
        return chunked.cut_softmax(h, t, ids, b, label_smoothing=label_smoothing, chunk_size=64)

    def ref(h, t, ids, b):
        return reference.cut_softmax(h, t, ids, b, label_smoothing=label_smoothing)

    return fn, ref


@pytest.mark.parametrize("family", ["bce", "softmax"])
@pytest.mark.parametrize("static_vocab", [True, False])
def test_unknown_batch_dimension(static_vocab, family):
    """`M` (and `L`) unknown at trace time; also `V` when `static_vocab` is False (softmax:
    its smoothing's `a / V` read from the table inside the program)."""
    rng = np.random.default_rng(9)
    dim = 8
    traced = 200 if static_vocab else None
    fn, ref = (chunked_fn(chunk_size=64), reference_fn()) if family == "bce" else _softmax_fns()

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, dim], tf.float32),
            tf.TensorSpec([traced, dim], tf.float32),
            tf.TensorSpec([None, None], tf.int32),
            tf.TensorSpec([traced], tf.float32),
            tf.TensorSpec([None], tf.float32),
        ]
    )
    def run(h, t, ids, b, cot):
        return loss_and_grads(fn, h, t, ids, b, cot)

    cases = [(5, 3, 200), (11, 1, 200)] + ([] if static_vocab else [(4, 2, 128), (3, 3, 50)])
    for rows, labels, vocab in cases:
        h, t, ids, b, cot = make_case(rng, rows, dim, vocab, labels)
        assert_same(run(h, t, ids, b, cot), loss_and_grads(ref, h, t, ids, b, cot))


@pytest.mark.parametrize("chunk_size", [16, None])
@pytest.mark.parametrize("family", ["bce", "softmax"])
def test_the_loss_with_a_vocabulary_unknown_at_trace_time(family, chunk_size):
    """The Keras loss (its fused weighted-sum pass) and its gradients in a `tf.function` whose
    table has an unknown V (`None`: the default tile, wider than V): as in eager mode."""
    from keras_cutbce import CutBCELoss, CutSoftmaxLoss

    loss_class = CutBCELoss if family == "bce" else CutSoftmaxLoss
    rng = np.random.default_rng(12)
    h, t, ids, b, _ = make_case(rng, 6, 8, 50, 3)
    h, ids = h.reshape(2, 3, 8), ids.reshape(2, 3, 3)

    def step(h, t, ids, b):
        with tf.GradientTape() as tape:
            tape.watch([h, t, b])
            loss = loss_class(t, b, label_smoothing=0.1, chunk_size=chunk_size)(ids, h)
        return loss, tape.gradient(loss, [h, t, b])

    traced = tf.function(step, input_signature=[
        tf.TensorSpec([None, None, 8]), tf.TensorSpec([None, 8]),
        tf.TensorSpec([None, None, None], tf.int32), tf.TensorSpec([None])])
    assert_same(traced(h, t, ids, b), step(*(tf.convert_to_tensor(x) for x in (h, t, ids, b))))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_trains_tied_embedding_in_keras_fit(jit_compile):
    """An Embedding table tied to `CutBCELoss` trains through the loss in `fit`.

    `jit_compile=True` is what Keras's "auto" picks on a GPU.
    """
    from keras_cutbce import CutBCELoss

    vocab, dim, seq = 300, 8, 5
    keras.utils.set_random_seed(0)
    items = keras.layers.Embedding(vocab, dim, name="items")
    inputs = keras.Input((seq,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(dim)(items(inputs)))
    model.compile(
        optimizer=keras.optimizers.SGD(1.0),
        loss=CutBCELoss(items, chunk_size=128, implementation="chunked"),
        jit_compile=jit_compile,
    )
    rng = np.random.default_rng(11)
    x = rng.integers(0, vocab, size=(32, seq)).astype("int32")
    y = np.stack([x, np.roll(x, 1, axis=1), np.full_like(x, -1)], axis=-1)
    before = items.get_weights()[0]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    # Rows never used as input still move: they get gradient only through the loss.
    unused = np.setdiff1d(np.arange(vocab), x)
    assert np.abs(items.get_weights()[0][unused] - before[unused]).max() > 0


@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_weighted_sum_matches_per_row_and_scales(with_bias):
    """Checks `cut_bce_weighted_sum` (one XLA-compiled pass for loss and gradients).

    Same value and gradients as `sum(w * cut_bce)`, a non-unit upstream
    cotangent scales them, and an unknown batch size works in `tf.function`.
    """
    rng = np.random.default_rng(12)
    h, t, ids, b, _ = make_case(rng, 9, 8, 203, 3, bias=with_bias)
    w = rng.uniform(0.0, 2.0, size=(9,)).astype("float32")
    kwargs = dict(label_smoothing=0.1, pos_weight=2.0, chunk_size=64)

    @tf.function(input_signature=[
        tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([203, 8], tf.float32),
        tf.TensorSpec([None, 3], tf.int32), tf.TensorSpec([None], tf.float32),
    ] + ([tf.TensorSpec([203], tf.float32)] if with_bias else []))
    def fused_and_reference(h, t, ids, w, *b):
        b = b[0] if b else None
        watched = [h, t] + ([b] if with_bias else [])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(watched)
            fused = 3.0 * chunked.cut_bce_weighted_sum(h, t, ids, b, w, **kwargs)
            per_row = 3.0 * tf.reduce_sum(w * chunked.cut_bce(h, t, ids, b, **kwargs))
        return fused, per_row, tape.gradient(fused, watched), tape.gradient(per_row, watched)

    args = [h, t, ids.astype("int32"), w] + ([b] if with_bias else [])
    fused, per_row, fused_grads, per_row_grads = fused_and_reference(*args)
    np.testing.assert_allclose(fused.numpy(), per_row.numpy(), rtol=1e-5)
    for got, want in zip(fused_grads, per_row_grads):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-6)


def test_mask_positives_with_a_tile_width_unknown_at_trace_time():
    """`mask_positives` in a `tf.function` whose tile width is unknown (a dynamic
    V's remainder, empty included) marks the same positives as eagerly.

    The static-width behaviour is checked for every backend in
    tests/cutbce/test_chunked.py.
    """
    rng = np.random.default_rng(5)
    ids = rng.integers(-3, 70, size=(6, 5)).astype("int32")
    ids[0, :] = 64  # duplicates
    dynamic = tf.function(
        chunked.mask_positives,
        input_signature=[tf.TensorSpec([6, None], tf.float32), tf.TensorSpec([6, None], tf.int32),
                         tf.TensorSpec([], tf.int32)],
    )
    for start, width in ((0, 16), (64, 6), (70, 0)):
        z = tf.constant(rng.normal(size=(6, width)).astype("float32"))
        want = chunked.mask_positives(z, tf.constant(ids), start).numpy()
        assert np.isneginf(want).sum() == sum(
            len({i for i in row if start <= i < start + width}) for row in ids
        )
        got = dynamic(z, tf.constant(ids), tf.constant(start)).numpy()
        np.testing.assert_array_equal(got, want)
