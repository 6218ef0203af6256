"""The item table trains through `CutBCELoss` in every Keras training style.

`fit` is covered elsewhere; here Keras's documented JAX custom training loop
(`model.stateless_call` + `jax.grad` over the trainable variables): the loss
either sees the values being differentiated (inside a `keras.StatelessScope`
or through `model.stateless_compute_loss`) and its table gradient equals dense
BCE's, or it raises a clear error; never a silently dropped gradient.
"""

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, CutSoftmaxLoss
from keras_cutbce.math.reference import multi_hot
from tests.backend_utils import BACKEND, to_numpy

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="JAX stateless training loop")

VOCAB, DIM = 23, 4


def tied_model():
    keras.utils.set_random_seed(0)
    items = keras.layers.Embedding(VOCAB, DIM, name="items")
    inputs = keras.Input((3,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(DIM, name="proj")(items(inputs)))
    return model, items


def frozen_table(kind, values):
    """A table that no optimizer trains: a frozen layer, a non-trainable variable or a constant."""
    if kind == "layer":
        table = keras.layers.Embedding(values.shape[0], values.shape[1], trainable=False)
        table.build((None,))
        table.embeddings.assign(values)
        return table
    if kind == "variable":
        return keras.Variable(values, trainable=False)
    return keras.ops.convert_to_tensor(values)


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(6, 3)).astype("int32")
    y = rng.integers(-1, VOCAB, size=(6, 3, 2)).astype("int32")
    return x, y


def table_index(model, items):
    return [i for i, v in enumerate(model.trainable_variables) if v is items.embeddings][0]


def dense_objective(model, items, softmax=False):
    """Keras's dense BCE (or softmax cross-entropy) on the full logits, of the trainable values."""
    import jax.numpy as jnp

    index = table_index(model, items)

    def objective(trainable, non_trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        logits = jnp.einsum("btd,vd->btv", y_pred, trainable[index])
        targets = multi_hot(y.reshape(-1, y.shape[-1]), VOCAB).reshape(logits.shape)
        if softmax:  # a position without a valid id is padding: loss 0 (a zero target row)
            targets = targets / jnp.maximum(targets.sum(-1, keepdims=True), 1.0)
            return keras.losses.CategoricalCrossentropy(from_logits=True)(targets, logits)
        return keras.losses.BinaryCrossentropy(from_logits=True)(targets, logits)

    return objective


def assert_grads_match_dense(model, items, objective, softmax=False):
    import jax

    x, y = data()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    grad_fn = jax.jit(jax.grad(objective))
    want = jax.grad(dense_objective(model, items, softmax))(trainable, non_trainable, x, y)
    got = grad_fn(trainable, non_trainable, x, y)
    index = table_index(model, items)
    assert np.abs(to_numpy(want[index])).max() > 1e-4  # the table does get a gradient
    for g, w in zip(got, want):
        np.testing.assert_allclose(to_numpy(g), to_numpy(w), rtol=1e-4, atol=1e-7)
    # Not frozen at trace time: a different table gives the new gradient (same jit).
    trainable[index] = trainable[index] * 2.0
    got = grad_fn(trainable, non_trainable, x, y)
    want = jax.grad(dense_objective(model, items, softmax))(trainable, non_trainable, x, y)
    np.testing.assert_allclose(to_numpy(got[index]), to_numpy(want[index]), rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("softmax", [False, True], ids=["bce", "softmax"])
def test_stateless_loop_with_a_stateless_scope_trains_the_table(softmax):
    model, items = tied_model()
    loss = (CutSoftmaxLoss if softmax else CutBCELoss)(items, chunk_size=8)

    def objective(trainable, non_trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        mapping = list(zip(model.trainable_variables, trainable))
        mapping += list(zip(model.non_trainable_variables, non_trainable))
        with keras.StatelessScope(state_mapping=mapping):
            return loss(y, y_pred)

    assert_grads_match_dense(model, items, objective, softmax)


@pytest.mark.slow
@pytest.mark.parametrize("softmax", [False, True], ids=["bce", "softmax"])
def test_stateless_compute_loss_trains_the_table(softmax):
    model, items = tied_model()
    model.compile(optimizer="sgd", loss=(CutSoftmaxLoss if softmax else CutBCELoss)(items, chunk_size=8))
    x, y = data()
    model.fit(x, y, epochs=1, verbose=0)  # builds the compiled loss and metrics

    def objective(trainable, non_trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        metrics = [v.value for v in model.metrics_variables]
        value, _ = model.stateless_compute_loss(
            trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred
        )
        return value

    assert_grads_match_dense(model, items, objective, softmax)


def test_stateless_loop_without_the_values_raises_clearly():
    """Without the traced values the loss would drop the table's gradient: it raises instead."""
    import jax

    model, items = tied_model()
    loss = CutBCELoss(items, chunk_size=8)
    x, y = data()

    def objective(trainable, non_trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        return loss(y, y_pred)

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    with pytest.raises(RuntimeError, match="StatelessScope"):
        jax.grad(objective)(trainable, non_trainable, x, y)
    # A plain tensor table is the caller's own value: no error, normal gradients.
    table = to_numpy(items.embeddings).astype("float32")
    plain = CutBCELoss(keras.ops.convert_to_tensor(table), chunk_size=8)
    value = jax.jit(lambda t, n, x, y: plain(y, model.stateless_call(t, n, x)[0]))(
        trainable, non_trainable, x, y
    )
    assert np.isfinite(float(value))


# -- no false positives --------------------------------------------------


def _dense_bce(hidden, table, y):
    targets = multi_hot(y.reshape(-1, y.shape[-1]), table.shape[0]).reshape(
        hidden.shape[:-1] + (table.shape[0],)
    )
    logits = keras.ops.einsum("btd,vd->btv", hidden, table)
    return keras.losses.BinaryCrossentropy(from_logits=True)(targets, logits)


@pytest.mark.parametrize("frozen", ["layer", "variable", "constant"])
def test_a_frozen_table_is_never_refused(frozen):
    """A jit forward and a grad w.r.t. the hidden states, with a frozen table, run."""
    import jax
    import jax.numpy as jnp

    values = np.random.default_rng(3).normal(size=(VOCAB, DIM)).astype("float32")
    loss = CutBCELoss(frozen_table(frozen, values), chunk_size=8)
    x, y = data()
    hidden = jnp.asarray(np.random.default_rng(4).normal(size=(6, 3, DIM)).astype("float32"))
    want = float(_dense_bce(hidden, values, y))
    assert float(jax.jit(lambda h: loss(y, h))(hidden)) == pytest.approx(want, rel=1e-5)
    got = jax.jit(jax.grad(lambda h: loss(y, h)))(hidden)
    np.testing.assert_allclose(
        to_numpy(got), to_numpy(jax.grad(lambda h: _dense_bce(h, values, y))(hidden)),
        rtol=1e-4, atol=1e-8,
    )


def test_a_jitted_forward_of_a_trainable_table_is_not_refused_its_gradient_is():
    """Plain evaluation under jax.jit works; differentiating without the table's values raises."""
    import jax

    model, items = tied_model()
    loss = CutBCELoss(items, chunk_size=8)
    x, y = data()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def objective(trainable, non_trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        return loss(y, y_pred)

    got = jax.jit(objective)(trainable, non_trainable, x, y)
    want = dense_objective(model, items)(trainable, non_trainable, x, y)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for transform in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        with pytest.raises(RuntimeError, match=r"being differentiated.*StatelessScope"):
            transform(objective)(trainable, non_trainable, x, y)
