"""ERASE tests that run on every backend: DetachBlock semantics, EraseModel losses/logs,
serialization, and the cross-backend check (standard step vs torch ERASE).

Torch-only schedule tests (dispatch equivalence, trace, ordering, failures) are in
`test_erase_torch.py`; they reuse the builders below.
"""

import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock, EraseModel
from tests.backend_utils import BACKEND, to_numpy, value_and_grads


def grad_wrt_input(fn, x):
    """d sum(fn(x)) / dx on the active backend; zeros when no gradient path exists."""
    if BACKEND == "torch":
        import torch

        t = torch.tensor(x, requires_grad=True)
        value = fn(t)
        if not value.requires_grad:
            return np.zeros_like(x)
        (grad,) = torch.autograd.grad(value, t, allow_unused=True)
        return np.zeros_like(x) if grad is None else to_numpy(grad)
    return value_and_grads(fn, x)[1][0]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- builders shared with test_erase_torch.py ---------------------------------------


def make_tower(width, depth=2, name=None, regularized=False):
    """`depth` Dense layers; `regularized`: each with an L2 kernel regularizer and the
    first with an L1 activity regularizer (an `add_loss` in every call)."""
    extra = lambda i: (  # noqa: E731
        dict(kernel_regularizer=keras.regularizers.L2(0.05),
             activity_regularizer=keras.regularizers.L1(0.01) if i == 0 else None)
        if regularized else {}
    )
    return keras.Sequential(
        [keras.layers.Dense(width, activation="relu", **extra(i)) for i in range(depth)],
        name=name,
    )


def build_ctr(
    dispatch="auto",
    num_towers=3,
    width=16,
    depth=2,
    input_dim=8,
    loss_weight=0.5,
    detach_input=True,
    seed=0,
    regularized=False,
    **model_kwargs,
):
    """Small CTR-style EraseModel: parallel detached towers, a top MLP, BCE losses.

    `regularized`: the towers' layers carry regularizers (see `make_tower`) and
    so does the top layer (a loss outside every block)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), name="features")
    features = keras.layers.Dense(input_dim, name="stem")(inputs) if not detach_input else inputs
    outs = []
    for i in range(num_towers):
        block = DetachBlock(
            make_tower(width, depth, name=f"mlp_{i}", regularized=regularized),
            head=keras.layers.Dense(1, name=f"head_{i}"),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            loss_weight=loss_weight,
            detach_input=detach_input,
            name=f"tower_{i}",
        )
        outs.append(block(features))
    hidden = keras.layers.Concatenate()(outs) if len(outs) > 1 else outs[0]
    top_regularizer = keras.regularizers.L2(0.05) if regularized else None
    hidden = keras.layers.Dense(
        8, activation="relu", name="top_0", kernel_regularizer=top_regularizer
    )(hidden)
    outputs = keras.layers.Dense(1, activation="sigmoid", name="ctr")(hidden)
    return EraseModel(inputs, outputs, dispatch=dispatch, **model_kwargs)


def ctr_data(n=64, input_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, input_dim)).astype("float32")
    y = (x[:, :1] + 0.5 * rng.normal(size=(n, 1)) > 0).astype("float32")
    return x, y


def train(model, x, y, optimizer=None, batch_size=16, epochs=2, **fit_kwargs):
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return history.history


# -- DetachBlock ------------------------------------------------------------------------


@pytest.mark.parametrize("detach_input", [True, False])
def test_block_stops_gradient_at_input_and_output(detach_input):
    keras.utils.set_random_seed(1)
    block = DetachBlock(keras.layers.Dense(3), detach_input=detach_input)
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    block.build(x.shape)

    grad_through_block = grad_wrt_input(lambda t: keras.ops.sum(block(t) ** 2), x)
    np.testing.assert_array_equal(grad_through_block, 0.0)
    # The same layer without the block does pass a gradient (the test can fail).
    grad_layer = grad_wrt_input(lambda t: keras.ops.sum(block.forward_layer(t) ** 2), x)
    if detach_input:
        np.testing.assert_array_equal(grad_layer, 0.0)
    else:
        assert np.abs(grad_layer).max() > 1e-3


def test_block_output_matches_wrapped_layer_and_head_built():
    block = DetachBlock(make_tower(6), head=keras.layers.Dense(2), loss="mse", name="b")
    x = np.ones((3, 4), "float32")
    out = block(x)
    assert block.head.built and block.head.kernel.shape == (6, 2)
    np.testing.assert_allclose(to_numpy(out), to_numpy(block.layer(x)), rtol=1e-6)
    assert block.compute_output_shape((None, 4)) == (None, 6)


def test_block_argument_errors():
    with pytest.raises(TypeError, match="layer"):
        DetachBlock(lambda t: t)
    with pytest.raises(TypeError, match="head"):
        DetachBlock(keras.layers.Dense(2), head="dense")
    with pytest.raises(TypeError, match="target"):
        DetachBlock(keras.layers.Dense(2), target=1.5)
    with pytest.raises(ValueError, match="dispatch"):
        build_ctr(dispatch="fastest")


# -- EraseModel losses and logs ---------------------------------------------------------


def _expected_losses(model, x, y):
    """Main BCE and each block's weighted local loss, computed by hand from the weights."""
    y_pred = to_numpy(model(x, training=False))
    main = float(np.mean(to_numpy(keras.losses.binary_crossentropy(y, y_pred))))
    local = {}
    for block in model.detach_blocks():
        logits = to_numpy(block.head(block.layer(x)))
        bce = np.mean(np.maximum(logits, 0) - logits * y + np.log1p(np.exp(-np.abs(logits))))
        local[block.name] = block.loss_weight * float(bce)
    return main, local


def test_total_loss_is_main_plus_local_and_logged():
    model = build_ctr("auto")
    x, y = ctr_data(32)
    main, local = _expected_losses(model, x, y)
    history = train(model, x, y, optimizer=keras.optimizers.SGD(0.0), batch_size=32, epochs=1)
    assert set(history) == {"loss"} | {f"tower_{i}_loss" for i in range(3)}
    for name, value in local.items():
        np.testing.assert_allclose(history[f"{name}_loss"][0], value, rtol=1e-5)
    np.testing.assert_allclose(history["loss"][0], main + sum(local.values()), rtol=1e-5)


def test_block_regularizers_and_add_loss_are_in_its_logged_objective():
    """A block's own losses (weight regularizers, activity regularizer) are logged with its
    local loss; the total is still main + local + every regularizer (Keras's loss)."""
    model = build_ctr("standard", num_towers=2, regularized=True)
    x, y = ctr_data(32)
    main, local = _expected_losses(model, x, y)
    reg = {}
    for block in model.detach_blocks():
        kernels = [layer.kernel for layer in block.layer.layers]
        hidden = to_numpy(block.layer.layers[0](x))
        reg[block.name] = sum(0.05 * float(np.sum(to_numpy(k) ** 2)) for k in kernels) + (
            0.01 * float(np.sum(np.abs(hidden))) / len(x)
        )
    top = 0.05 * float(np.sum(to_numpy(model.get_layer("top_0").kernel) ** 2))
    history = train(model, x, y, optimizer=keras.optimizers.SGD(0.0), batch_size=32, epochs=1)
    for name in local:
        np.testing.assert_allclose(history[f"{name}_loss"][0], local[name] + reg[name], rtol=1e-5)
    total = main + sum(local.values()) + sum(reg.values()) + top
    np.testing.assert_allclose(history["loss"][0], total, rtol=1e-5)


def test_local_losses_train_the_towers_and_reset_per_epoch():
    model = build_ctr("auto")
    x, y = ctr_data(64)
    before = [to_numpy(w) for w in model.detach_blocks()[0].trainable_weights]
    history = train(model, x, y, optimizer=keras.optimizers.SGD(0.5), epochs=3)
    after = [to_numpy(w) for w in model.detach_blocks()[0].trainable_weights]
    assert all(np.abs(a - b).max() > 0 for a, b in zip(after, before))
    # Per-epoch means (reset every epoch): training lowers them.
    assert history["tower_0_loss"][-1] < history["tower_0_loss"][0]


def test_inference_computes_no_local_loss():
    model = build_ctr("auto")
    x, y = ctr_data(16)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    model.predict(x, verbose=0)
    model(x, training=False)
    assert all(not b._pending_predictions for b in model.detach_blocks())
    # A training call keeps the prediction for compute_loss; the next call clears it.
    model(x, training=True)
    assert all(len(b._pending_predictions) == 1 for b in model.detach_blocks())
    model(x, training=False)
    assert all(not b._pending_predictions for b in model.detach_blocks())
    # evaluate's loss is the main loss plus the local losses, each logged
    main, local = _expected_losses(model, x, y)
    results = model.evaluate(x, y, verbose=0, return_dict=True)
    np.testing.assert_allclose(results["loss"], main + sum(local.values()), rtol=1e-5)
    for name, value in local.items():
        np.testing.assert_allclose(results[f"{name}_loss"], value, rtol=1e-5)
    model.predict(x, verbose=0)
    assert all(not b._pending_predictions for b in model.detach_blocks())


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_block_outside_an_erase_model_warns_and_keeps_nothing(kind):
    """In a plain keras.Model the local loss has no consumer: say so, keep no prediction."""
    keras.utils.set_random_seed(0)
    block = DetachBlock(make_tower(8, 1), head=keras.layers.Dense(1), loss="mse", name="lone")
    if kind == "functional":
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(1)(block(inputs)))
    else:
        model = keras.Sequential([keras.Input((8,)), block, keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = ctr_data(48)
    with pytest.warns(UserWarning, match=r"lone.*outside a keras_erase\.EraseModel"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert block._pending_predictions == []  # nothing kept (on torch: no graph per step)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert block._pending_predictions == []


def _two_target_model(dispatch="auto"):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    a = DetachBlock(
        make_tower(8, 1),
        head=keras.layers.Dense(1, activation="sigmoid"),
        loss="binary_crossentropy",
        target="buy",
        name="to_buy",
    )(inputs)
    b = DetachBlock(
        make_tower(8, 1), head=keras.layers.Dense(1), loss="mse", target=1, name="to_click"
    )(inputs)
    h = keras.layers.Concatenate()([a, b])
    click = keras.layers.Dense(1, activation="sigmoid", name="click")(h)
    buy = keras.layers.Dense(1, activation="sigmoid", name="buy")(h)
    return EraseModel(inputs, {"click": click, "buy": buy}, dispatch=dispatch)


def test_several_targets_select_by_name_and_index():
    model = _two_target_model()
    assert model.output_names == ["buy", "click"]  # an int target indexes output_names
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = {
        "click": (rng.random((16, 1)) < 0.5).astype("float32"),
        "buy": (rng.random((16, 1)) < 0.2).astype("float32"),
    }
    blocks = {b.name: b for b in model.detach_blocks()}
    p_buy = to_numpy(blocks["to_buy"].head(blocks["to_buy"].layer(x)))
    p_click = to_numpy(blocks["to_click"].head(blocks["to_click"].layer(x)))
    want_buy = float(np.mean(to_numpy(keras.losses.binary_crossentropy(y["buy"], p_buy))))
    want_click = float(np.mean((y["click"] - p_click) ** 2))
    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss={"click": "binary_crossentropy", "buy": "binary_crossentropy"},
    )
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    np.testing.assert_allclose(history["to_buy_loss"][0], want_buy, rtol=1e-5)
    np.testing.assert_allclose(history["to_click_loss"][0], want_click, rtol=1e-5)


def test_missing_target_choice_raises():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = DetachBlock(keras.layers.Dense(3), head=keras.layers.Dense(1), loss="mse", name="t")(
        inputs
    )
    model = EraseModel(
        inputs, [keras.layers.Dense(1, name="o1")(h), keras.layers.Dense(1, name="o2")(h)]
    )
    model.compile(optimizer="sgd", loss=["mse", "mse"])
    x = np.ones((4, 4), "float32")
    with pytest.raises(ValueError, match="target="):
        model.fit(x, [np.ones((4, 1)), np.ones((4, 1))], verbose=0)


def test_nested_model_as_layer_and_chained_blocks():
    keras.utils.set_random_seed(4)
    inner_in = keras.Input((5,))
    inner = keras.Model(inner_in, keras.layers.Dense(7, activation="tanh")(inner_in), name="inner")
    inputs = keras.Input((5,))
    first = DetachBlock(
        inner, head=keras.layers.Dense(1), loss="mse", loss_weight=0.3, name="first"
    )(inputs)
    second = DetachBlock(
        make_tower(4, 1), head=keras.layers.Dense(1), loss="mse", name="second"
    )(first)
    model = EraseModel(inputs, keras.layers.Dense(1)(second))
    x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    before = to_numpy(inner.layers[-1].kernel)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert {"first_loss", "second_loss"} <= set(history)
    assert np.abs(to_numpy(inner.layers[-1].kernel) - before).max() > 0


class SubclassedCTR(EraseModel):
    def __init__(self, width=8, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.towers = [
            DetachBlock(
                make_tower(width, 1),
                head=keras.layers.Dense(1),
                loss=keras.losses.BinaryCrossentropy(from_logits=True),
                name=f"sub_tower_{i}",
            )
            for i in range(2)
        ]
        self.concat = keras.layers.Concatenate()
        self.out = keras.layers.Dense(1, activation="sigmoid")

    def call(self, inputs, training=None):
        return self.out(self.concat([t(inputs, training=training) for t in self.towers]))


def test_subclassed_erase_model():
    keras.utils.set_random_seed(5)
    model = SubclassedCTR(dispatch="auto")
    x, y = ctr_data(32)
    history = train(model, x, y, epochs=2)
    assert {"loss", "sub_tower_0_loss", "sub_tower_1_loss"} == set(history)
    assert history["sub_tower_0_loss"][1] < history["sub_tower_0_loss"][0]


class SubclassedWithoutTraining(SubclassedCTR):
    """`call` without a `training` argument: the blocks still train (training=True is passed on)."""

    def call(self, inputs):
        return self.out(self.concat([t(inputs) for t in self.towers]))


def test_subclassed_erase_model_whose_call_has_no_training_argument():
    keras.utils.set_random_seed(5)
    model = SubclassedWithoutTraining(dispatch="auto", auto_steps=1)
    x, y = ctr_data(32)
    model(x)  # build
    before = [to_numpy(w) for w in model.towers[0].trainable_weights]
    history = train(model, x, y, optimizer=keras.optimizers.SGD(0.5), epochs=2)
    after = [to_numpy(w) for w in model.towers[0].trainable_weights]
    assert all(np.abs(a - b).max() > 0 for a, b in zip(after, before))
    assert history["sub_tower_0_loss"][0] > 0.1
    assert history["sub_tower_0_loss"][1] < history["sub_tower_0_loss"][0]
    model.predict(x, verbose=0)
    assert all(not t._pending_predictions for t in model.towers)  # inference: no local loss


@pytest.mark.slow
def test_keras_file_round_trip(tmp_path):
    model = build_ctr("blocking", num_streams=2, auto_steps=5)
    x, y = ctr_data(32)
    train(model, x, y, epochs=1)
    path = str(tmp_path / "erase.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, EraseModel)
    assert (loaded.dispatch, loaded.num_streams, loaded.auto_steps) == ("blocking", 2, 5)
    blocks = {b.name: b for b in loaded.detach_blocks()}
    assert sorted(blocks) == ["tower_0", "tower_1", "tower_2"]
    assert blocks["tower_1"].loss_weight == 0.5 and blocks["tower_1"].head is not None
    assert isinstance(blocks["tower_1"].loss_fn, keras.losses.BinaryCrossentropy)
    np.testing.assert_allclose(
        to_numpy(loaded.predict(x, verbose=0)), to_numpy(model.predict(x, verbose=0)), rtol=1e-6
    )
    history = loaded.fit(x, y, epochs=1, verbose=0).history  # compiled from the file
    assert "tower_2_loss" in history


def test_block_config_round_trip_with_string_loss():
    block = DetachBlock(
        make_tower(3, 1), head=keras.layers.Dense(1), loss="binary_crossentropy",
        loss_weight=0.25, detach_input=False, target="buy", name="blk",
    )
    clone = DetachBlock.from_config(block.get_config())
    assert (clone.name, clone.loss_weight, clone.detach_input, clone.target) == (
        "blk", 0.25, False, "buy",
    )
    y = np.array([[1.0], [0.0]], "float32")
    p = np.array([[0.8], [0.3]], "float32")
    np.testing.assert_allclose(
        to_numpy(clone.local_loss(y, p)), to_numpy(block.local_loss(y, p)), rtol=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_the_models_users_have_train_every_block_under_every_policy(policy):
    """Every backend's step (torch: ERASE, "threaded") under each policy: every block weight
    changes at every step, and every local loss is logged. (torch's schedules against its
    standard step and float64: tests/erase/test_erase_schedules.py.)"""
    from tests.backend_utils import dtype_policy
    from tests.erase.test_erase_schedules import fit_users, reconfigure, users_model

    with dtype_policy(policy):
        model = users_model()
        if BACKEND == "torch":
            reconfigure(model, dispatch="threaded")
        got = fit_users(model)
    for path, steps in got["changes"].items():
        frozen = [s for s, change in enumerate(steps) if change == 0]
        assert not frozen, f"{path} did not change at steps {frozen}"
    blocks = {"tower_a_loss", "tower_b_loss", "tower_c_loss", "reused_loss"}
    assert blocks <= set(got["logs"]) and all(np.isfinite(v) for v in got["logs"].values())


# -- cross-backend: standard step (JAX, TensorFlow) vs torch ERASE ----------------------

CROSS_STEPS = 6


def _cross_run(weights, x, y, dispatch):
    model = build_ctr(dispatch, num_towers=3, width=16)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    return [to_numpy(w) for w in model.get_weights()], history


def _child(in_path, out_path):
    data = np.load(in_path)
    n = int(data["n_weights"])
    weights = [data[f"w{i}"] for i in range(n)]
    dispatch = "threaded" if BACKEND == "torch" else "standard"
    final, history = _cross_run(weights, data["x"], data["y"], dispatch)
    np.savez(out_path, *final, loss=np.asarray(history["loss"]))


def _run_backend(backend, in_path, out_path):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.erase.test_erase", in_path, out_path],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(out_path)
    return [out[f"arr_{i}"] for i in range(len(out.files) - 1)], out["loss"]


@pytest.mark.slow
def test_cross_backend_same_weights(tmp_path):
    """torch ERASE ("threaded") and the JAX/TensorFlow standard step end at the same weights."""
    model = build_ctr("standard", num_towers=3, width=16)
    weights = [to_numpy(w).astype("float32") for w in model.get_weights()]
    x, y = ctr_data(16 * CROSS_STEPS, seed=7)
    in_path = str(tmp_path / "init.npz")
    np.savez(in_path, x=x, y=y, n_weights=len(weights), **{f"w{i}": w for i, w in enumerate(weights)})
    dispatch = "threaded" if BACKEND == "torch" else "standard"
    mine, history = _cross_run(weights, x, y, dispatch)
    # JAX and TensorFlow runs compare themselves with torch ERASE; the torch run
    # checks JAX once more (fast to import) to keep the suite short.
    others = ["jax"] if BACKEND == "torch" else ["torch"]
    for other in others:
        theirs, loss = _run_backend(other, in_path, str(tmp_path / f"{other}.npz"))
        assert len(theirs) == len(mine)
        moved = max(np.abs(a - w).max() for a, w in zip(mine, weights))
        assert moved > 1e-3  # training happened
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=other)
        np.testing.assert_allclose(history["loss"], loss, rtol=1e-4, err_msg=other)



def test_validation_loss_is_comparable_and_logs_each_local_loss():
    """Validation on the training batch with a zero learning rate: every val_ log equals
    its training log (val_loss includes the local losses as loss does)."""
    model = build_ctr("auto", num_towers=2, regularized=True)
    x, y = ctr_data(32)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="binary_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=1, validation_data=(x, y), verbose=0).history
    names = {"loss", "accuracy", "tower_0_loss", "tower_1_loss"}
    assert set(history) == names | {f"val_{name}" for name in names}
    for name in names:
        np.testing.assert_allclose(history[f"val_{name}"], history[name], rtol=1e-5, err_msg=name)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])


# -- argument errors a user meets ---------------------------------------------------


@pytest.mark.parametrize("target", ["nope", 2, -1])
def test_bad_target_of_a_multi_output_model_is_named_at_construction(target):
    inputs = keras.Input((4,))
    h = DetachBlock(keras.layers.Dense(3), head=keras.layers.Dense(1), loss="mse",
                    target=target, name="t")(inputs)
    outputs = {"buy": keras.layers.Dense(1, name="buy")(h),
               "click": keras.layers.Dense(1, name="click")(h)}
    with pytest.raises(ValueError, match=r"`target` must name one of the model's outputs "
                                         r"\['buy', 'click'\].*Received: target="):
        EraseModel(inputs, outputs)


def test_bad_target_of_a_subclassed_model_is_named_at_the_first_step():
    class TwoHeads(EraseModel):
        def __init__(self):
            super().__init__(dispatch="standard")
            self.block = DetachBlock(keras.layers.Dense(3), head=keras.layers.Dense(1),
                                     loss="mse", target="nope", name="t")
            self.a, self.b = keras.layers.Dense(1), keras.layers.Dense(1)

        def call(self, x):
            h = self.block(x)
            return {"buy": self.a(h), "click": self.b(h)}

    model = TwoHeads()
    model.compile(optimizer="sgd", loss={"buy": "mse", "click": "mse"})
    x = np.ones((4, 4), "float32")
    with pytest.raises(ValueError, match=r"'t': `target` must name one of.*target='nope'"):
        model.fit(x, {"buy": np.ones((4, 1)), "click": np.ones((4, 1))}, verbose=0)


@pytest.mark.parametrize(
    "loss_weight, error, text",
    [("x", TypeError, "of type str"), (None, TypeError, "of type NoneType"),
     (True, TypeError, "of type bool"), (-1, ValueError, "loss_weight=-1"),
     (float("nan"), ValueError, "loss_weight=nan"), (float("inf"), ValueError, "inf")],
)
def test_loss_weight_must_be_a_finite_non_negative_number(loss_weight, error, text):
    with pytest.raises(error, match=f"`loss_weight` must be .*{text}"):
        DetachBlock(keras.layers.Dense(2), loss="mse", loss_weight=loss_weight)
    assert DetachBlock(keras.layers.Dense(2), loss="mse", loss_weight=np.float32(0.5)).loss_weight == 0.5
    assert DetachBlock(keras.layers.Dense(2), loss="mse", loss_weight=0).loss_weight == 0.0


@pytest.mark.parametrize("kwargs", [{"dispatch": "streams"}, {"cuda_graphs": True},
                                    {"dispatch": "streams", "cuda_graphs": True}])
def test_torch_only_settings_say_what_runs_instead(kwargs):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EraseModel(inputs, outputs, **kwargs)
    messages = [str(w.message) for w in caught if "EraseModel:" in str(w.message)]
    if BACKEND == "torch":
        assert messages == []  # a torch schedule: nothing runs instead
    else:
        assert len(messages) == 1
        assert f"on backend {BACKEND!r} the standard Keras train step runs instead" in messages[0]
        for setting in ("dispatch='streams'" if "dispatch" in kwargs else None,
                        "cuda_graphs=True" if "cuda_graphs" in kwargs else None):
            assert setting is None or setting in messages[0]


@pytest.mark.parametrize("monitor", ["val_tower_1_loss", "tower_0_loss"])
def test_monitoring_callbacks_minimise_block_losses_in_auto_mode(monitor, tmp_path):
    model = build_ctr("standard", num_towers=2)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    x, y = ctr_data(64)
    stop = keras.callbacks.EarlyStopping(monitor=monitor, patience=1)
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor=monitor, save_best_only=True
    )
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_split=0.25,
                        callbacks=[stop, checkpoint])
    assert stop.mode == checkpoint.mode == "min"  # as Keras decides for "loss"
    assert monitor in history.history and (tmp_path / "best.keras").exists()
    # A block loss that goes up is the worse one: EarlyStopping keeps the lowest.
    assert stop.best == pytest.approx(min(history.history[monitor]))
