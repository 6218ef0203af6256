"""Vocab-sharded / data-parallel CutBCE on JAX meshes of 8 simulated CPU devices.

Each test runs this file as a script in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set
before JAX starts) and checks, against the single-device kernels and the
dense reference:

- `ops`: loss and the gradients of hidden, table and bias, and top-k, for
  meshes (8,), (2, 4) and (4, 2) (data x model), through the public ops with
  a table placed `P("model", None)` (the sharding is detected under `jit`)
  and through `sharded.cut_bce`/`sharded.top_k` with V not divisible by the
  shard count (padded and masked);
- `fit`: the SASRec example model under `keras.distribution.ModelParallel`
  (item table `("model", None)`, batch over `"data"`) and under
  `DataParallel` gives the same per-step losses and weights as on one device.
"""

import json
import sys

import keras
import pytest

from tests.backend_utils import run_child_script

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX meshes need KERAS_BACKEND=jax"
)]


def _run_child(case):
    return run_child_script(__file__, dict(
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        KERAS_BACKEND="jax",
        JAX_PLATFORMS="cpu",
    ), args=(case,), timeout=900)


def test_ops_exact_against_single_device_on_meshes():
    report = _run_child("ops")
    assert report["meshes"] == [[8], [2, 4], [4, 2]]
    assert report["sharded_loss_calls"] >= 3 and report["sharded_top_k_calls"] >= 3


def test_sasrec_fit_under_model_parallel_matches_one_device():
    report = _run_child("fit")
    assert report["sharded_loss_calls"] >= 1
    assert report["table_shard_rows"] == report["vocab"] // 4


# --------------------------------------------------------------------- children ---


def _spy(module, name, calls):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def _close(actual, expected, what, rtol=1e-5, atol=1e-6):
    import numpy as np

    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32),
        rtol=rtol, atol=atol, err_msg=what,
    )


def _ids(rng, rows, length, vocab):
    """Random ids with padding (-1, V, V + 5) and a duplicate in every row."""
    import numpy as np

    ids = rng.integers(0, vocab, size=(rows, length))
    ids[:, 1] = ids[:, 0]
    last = min(2, length - 1)
    ids[0, last], ids[1, last], ids[2, last] = -1, vocab, vocab + 5
    return ids.astype(np.int32)


def _mesh(shape, names, explicit):
    import jax

    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _check_public_ops(mesh, rng, calls):
    """Public ops on a table placed P("model", None): detection under jit, exact results."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_cutbce import ops as cut_ops
    from keras_cutbce.math import reference
    from keras_cutbce.backends.jax import retrieval, sharded

    batch, seq, dim, vocab = 4, 3, 8, 40
    hidden = rng.normal(size=(batch, seq, dim)).astype(np.float32)
    table = rng.normal(size=(vocab, dim)).astype(np.float32)
    bias = rng.normal(size=(vocab,)).astype(np.float32)
    ids = _ids(rng, batch * seq, 4, vocab).reshape(batch, seq, 4)
    cotangent = rng.normal(size=(batch, seq)).astype(np.float32)
    data = "data" if "data" in mesh.axis_names else None
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (put(hidden, data, None, None), put(table, "model", None), put(bias, "model"))
    assert sharded.vocab_sharding_of(args[1]) == sharded.VocabSharding(mesh, ("model",))
    kwargs = dict(label_smoothing=0.1, pos_weight=2.0)

    def sharded_objective(h, t, b):
        loss = cut_ops.cut_binary_crossentropy(h, t, ids, b, chunk_size=4, **kwargs)
        return jnp.sum(cotangent * loss)

    def dense_objective(h, t, b):
        loss = reference.cut_bce(h.reshape(-1, dim), t, ids.reshape(-1, 4), b, **kwargs)
        return jnp.sum(cotangent.reshape(-1) * loss)

    before = calls.get("cut_bce", 0)
    if sharded.mesh.explicit(mesh):
        # Explicit axes: the sharding is part of the traced type, seen under jit.
        step = jax.jit(jax.value_and_grad(sharded_objective, argnums=(0, 1, 2)))
    else:
        # Automatic axes: a traced array carries no sharding, so a concrete
        # call is detected (checked here) and traced code names the sharding.
        sharded_objective(*args)
        assert calls.get("cut_bce", 0) > before, "the eager call was not dispatched"
        spec = sharded.VocabSharding(mesh, ("model",))

        def explicit_objective(h, t, b):
            loss = sharded.cut_bce(
                h.reshape(-1, dim), t, ids.reshape(-1, 4), b, sharding=spec,
                chunk_size=4, **kwargs,
            )
            return jnp.sum(cotangent.reshape(-1) * loss)

        step = jax.jit(jax.value_and_grad(explicit_objective, argnums=(0, 1, 2)))
    value, grads = step(*args)
    assert calls.get("cut_bce", 0) > before, "the sharded kernel was not dispatched"
    want, want_grads = jax.value_and_grad(dense_objective, argnums=(0, 1, 2))(
        hidden, table, bias
    )
    _close(value, want, "loss")
    for got, expected, name in zip(grads, want_grads, ("hidden", "table", "bias")):
        _close(got, expected, f"grad {name}")
    # The table gradient stays split along V: each device holds V / shards rows.
    shards = mesh.shape["model"]
    assert grads[1].addressable_shards[0].data.shape == (vocab // shards, dim)

    exclude = _ids(rng, batch * seq, 3, vocab).reshape(batch, seq, 3)
    before = calls.get("top_k", 0)
    top_k = lambda h, t, b: cut_ops.cut_top_k(  # noqa: E731
        h, t, 6, b, exclude_ids=exclude, chunk_size=4
    )
    scores, top = (jax.jit(top_k) if sharded.mesh.explicit(mesh) else top_k)(*args)
    assert calls.get("top_k", 0) > before, "the sharded top-k was not dispatched"
    want_scores, want_ids = retrieval.top_k(
        hidden.reshape(-1, dim), table, 6, bias, exclude.reshape(-1, 3), chunk_size=4
    )
    np.testing.assert_array_equal(np.asarray(top).reshape(-1, 6), want_ids)
    _close(np.asarray(scores).reshape(-1, 6), want_scores, "top-k scores")


def _check_uneven_vocab(mesh, rng, bf16=False):
    """`sharded.cut_bce`/`cut_softmax`/`top_k` with V = 37 over 2, 4 or 8 shards (padded, masked)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_cutbce.math import reference
    from keras_cutbce.backends.jax import chunked, sharded

    rows, dim, vocab = 8, 8, 37
    spec = sharded.VocabSharding(mesh, ("model",))
    hidden = rng.normal(size=(rows, dim)).astype(np.float32)
    table = rng.normal(size=(vocab, dim)).astype(np.float32)
    bias = rng.normal(size=(vocab,)).astype(np.float32)
    cotangent = rng.normal(size=(rows,)).astype(np.float32)
    cases = [
        dict(bias=bias, ids=_ids(rng, rows, 3, vocab), label_smoothing=0.0, pos_weight=1.0),
        dict(bias=None, ids=_ids(rng, rows, 3, vocab), label_smoothing=0.2, pos_weight=3.0),
        dict(bias=bias, ids=np.zeros((rows, 0), np.int32), label_smoothing=0.0, pos_weight=1.0),
        dict(bias=None, ids=np.full((rows, 1), 36, np.int32), label_smoothing=0.0, pos_weight=1.0),
    ]
    # Softmax: a global log-sum-exp across the shards (a row without a valid id: loss 0).
    softmax_ids = _ids(rng, rows, 3, vocab)
    softmax_ids[1] = -1
    cases += [
        dict(family="softmax", bias=bias, ids=softmax_ids, label_smoothing=0.0),
        dict(family="softmax", bias=None, ids=_ids(rng, rows, 3, vocab), label_smoothing=0.1),
        dict(family="softmax", bias=bias, ids=np.full((rows, 1), 36, np.int32),
             label_smoothing=0.1),
    ]
    # Items masked by a -inf bias (item 0, where padding falls, and the first shards): no
    # probability, no gradient; a masked target (row 0) gives +inf.
    masked = bias.copy()
    masked[:19] = -np.inf
    masked_ids = np.where((softmax_ids >= 0) & (softmax_ids < 19), 30, softmax_ids)
    masked_ids[0, 0], masked_ids[2, 1] = 5, -1
    cases.append(dict(family="softmax", bias=masked, ids=masked_ids, label_smoothing=0.0))
    for case in cases:
        ids, b = case.pop("ids"), case.pop("bias")
        op = "cut_" + case.pop("family", "bce")
        argnums = (0, 1) if b is None else (0, 1, 2)

        def objective(kernel, h, t, b=None, **extra):
            return jnp.sum(cotangent * kernel(h, t, ids, b, **case, **extra))

        got = jax.jit(jax.value_and_grad(
            lambda *a: objective(getattr(sharded, op), *a, sharding=spec, chunk_size=3),
            argnums=argnums,
        ))(hidden, table, *([] if b is None else [b]))
        single = jax.value_and_grad(
            lambda *a: objective(getattr(chunked, op), *a, chunk_size=3), argnums=argnums
        )(hidden, table, *([] if b is None else [b]))
        dense = jax.value_and_grad(
            lambda *a: objective(getattr(reference, op), *a), argnums=argnums
        )(hidden, table, *([] if b is None else [b]))
        for want in (single, dense):
            _close(got[0], want[0], f"loss {case}")
            for g, w in zip(got[1], want[1]):
                _close(g, w, f"grads {case}")

    if bf16:
        _check_bf16(spec, hidden, table, rng)

    # Top-k with ties across shards (rows 3 and 30 equal): the lower id wins.
    _check_top_k(spec, hidden, table, bias, rng)


def _check_bf16(spec, hidden, table, rng):
    """bf16 inputs: the same per-shard kernel, float32 accumulation."""
    import jax
    import jax.numpy as jnp

    from keras_cutbce.backends.jax import chunked, sharded

    rows, vocab = hidden.shape[0], table.shape[0]
    h16, t16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(table, jnp.bfloat16)
    ids = _ids(rng, rows, 3, vocab)
    got = jax.jit(jax.value_and_grad(
        lambda h, t: jnp.sum(sharded.cut_bce(h, t, ids, sharding=spec, chunk_size=4)),
        argnums=(0, 1),
    ))(h16, t16)
    want = jax.value_and_grad(
        lambda h, t: jnp.sum(chunked.cut_bce(h, t, ids, chunk_size=4)), argnums=(0, 1)
    )(h16, t16)
    _close(got[0], want[0], "bf16 loss", rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        assert g.dtype == jnp.bfloat16
        _close(g, w, "bf16 grads", rtol=2e-2, atol=1e-3)


def _check_top_k(spec, hidden, table, bias, rng):
    """Top-k with ties across shards (rows 3 and 30 equal): the lower id wins."""
    import jax
    import numpy as np

    from keras_cutbce.backends.jax import retrieval, sharded

    rows, vocab = hidden.shape[0], table.shape[0]
    tied_table, tied_bias = table.copy(), bias.copy()
    tied_table[30], tied_bias[30] = tied_table[3], tied_bias[3]
    exclude = _ids(rng, rows, 2, vocab)
    for k, b, x in ((5, tied_bias, exclude), (vocab, None, None), (vocab, tied_bias, exclude)):
        scores, top = jax.jit(
            lambda h, t, b, x: sharded.top_k(h, t, k, b, x, sharding=spec, chunk_size=4)
        )(hidden, tied_table, b, x)
        want_scores, want_ids = retrieval.top_k(hidden, tied_table, k, b, x, chunk_size=4)
        np.testing.assert_array_equal(top, want_ids)
        np.testing.assert_array_equal(np.isinf(scores), np.isinf(want_scores))
        finite = np.isfinite(want_scores)
        _close(np.asarray(scores)[finite], np.asarray(want_scores)[finite], "top-k")
        assert tuple(top.shape) == (rows, k)


def _check_count_and_cache(mesh, rng):
    """D1: sharded `count_above` (V = 37, uneven) matches one device, gathers no table;
    D2: eager calls reuse one cached, jitted program per configuration."""
    import math
    import re

    import jax
    import numpy as np

    from keras_cutbce.backends.jax import retrieval, sharded

    rows, dim, vocab = 8, 8, 37
    spec = sharded.VocabSharding(mesh, ("model",))
    hidden = rng.normal(size=(rows, dim)).astype(np.float32)
    table = rng.normal(size=(vocab, dim)).astype(np.float32)
    bias = rng.normal(size=(vocab,)).astype(np.float32)
    at_vocab = np.full((rows,), vocab, np.int32)  # ids = V: the logits >= the score
    for b in (bias, None):
        for threshold in (0.0, 1.5, -math.inf, math.inf):
            scores = np.full((rows,), threshold, np.float32)
            got = sharded.count_above(hidden, table, b, scores, at_vocab, sharding=spec,
                                      chunk_size=4)
            want = retrieval.count_above(hidden, table, b, scores, at_vocab, chunk_size=4)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert got.dtype == np.int32
        # Ranks: each row's own item's logit, ids across the shards, exclusions, ties.
        tied = np.concatenate([table[:20], table[:17]])
        ids = rng.integers(0, vocab, size=(rows,)).astype(np.int32)
        scores = np.sum(hidden * tied[ids], axis=1) + (0 if b is None else b[ids])
        exclude = _ids(rng, rows, 5, vocab)
        got = sharded.count_above(hidden, tied, b, scores, ids, exclude, sharding=spec,
                                  chunk_size=4)
        want = retrieval.count_above(hidden, tied, b, scores, ids, exclude, chunk_size=4)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    broken = table.copy()
    broken[30] = np.nan  # a NaN on one shard: no ranking for any row, as on one device
    got = sharded.count_above(hidden, broken, None, np.zeros(rows, np.float32), at_vocab,
                              sharding=spec, chunk_size=4)
    np.testing.assert_array_equal(np.asarray(got), -1)
    scores, top = sharded.top_k(hidden, broken, 3, sharding=spec, chunk_size=4)
    assert np.isnan(np.asarray(scores)).all() and (np.asarray(top) == -1).all()
    # Compiled on a table placed P("model", None) (V = 40: JAX places only even
    # splits): no all-gather of the table.
    vocab = 40
    placed = jax.device_put(
        rng.normal(size=(vocab, dim)).astype(np.float32),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None)),
    )
    for fn in (
        lambda h, t: sharded.count_above(h, t, None, h[:, 0], h[:, 0].astype(np.int32),
                                         sharding=spec, chunk_size=4),
        lambda h, t: sharded.top_k(h, t, 5, sharding=spec, chunk_size=4),
    ):
        hlo = jax.jit(fn).lower(hidden, placed).compile().as_text()
        gathered = re.findall(r"= \S+\[([0-9,]+)\][^=]*? all-gather", hlo)
        assert not any(int(shape.split(",")[0]) >= vocab // 2 for shape in gathered), gathered
        assert f"f32[{vocab},{dim}]" not in " ".join(
            line for line in hlo.splitlines() if "all-gather" in line
        )

    # the second eager call with the same configuration builds nothing.
    ids = _ids(rng, rows, 3, table.shape[0])
    for build, call in (
        (sharded.loss._loss_program, lambda: sharded.cut_bce(hidden, table, ids, bias, sharding=spec, chunk_size=4)),
        (sharded.retrieval._retrieval_program, lambda: sharded.top_k(hidden, table, 3, bias, ids, sharding=spec, chunk_size=4)),
        (sharded.retrieval._retrieval_program, lambda: sharded.count_above(
            hidden, table, bias, hidden[:, 0], ids[:, 0], sharding=spec)),
    ):
        first = call()
        misses, hits = build.cache_info().misses, build.cache_info().hits
        second = call()
        assert build.cache_info().misses == misses, "an eager call rebuilt its program"
        assert build.cache_info().hits == hits + 1
        jax.tree_util.tree_map(np.testing.assert_array_equal, first, second)


def _child_ops():
    import jax
    import numpy as np

    from keras_cutbce.backends.jax import sharded

    assert jax.device_count() == 8, jax.devices()
    calls = {}
    _spy(sharded, "cut_bce", calls)
    _spy(sharded, "top_k", calls)
    rng = np.random.default_rng(0)
    # A table split over an axis of size 1, or not split, is not vocab-sharded.
    flat = _mesh((8, 1), ("data", "model"), explicit=False)
    table = jax.device_put(
        np.zeros((8, 2), np.float32),
        jax.sharding.NamedSharding(flat, jax.sharding.PartitionSpec("model", None)),
    )
    assert sharded.vocab_sharding_of(table) is None
    assert sharded.vocab_sharding_of(np.zeros((8, 2), np.float32)) is None
    meshes = [((8,), ("model",), True), ((2, 4), ("data", "model"), False),
              ((4, 2), ("data", "model"), True)]
    for index, (shape, names, explicit) in enumerate(meshes):
        mesh = _mesh(shape, names, explicit)
        _check_public_ops(mesh, rng, calls)
        _check_uneven_vocab(mesh, rng, bf16=index == 0)
        _check_count_and_cache(mesh, rng)
    print(json.dumps({
        "meshes": [list(m[0]) for m in meshes],
        "sharded_loss_calls": calls.get("cut_bce", 0),
        "sharded_top_k_calls": calls.get("top_k", 0),
    }))


def _child_fit():
    import numpy as np

    from examples.sasrec.model import build_sasrec
    from keras_cutbce import CutBCELoss
    from keras_cutbce.backends.jax import sharded

    calls = {}
    _spy(sharded, "cut_bce", calls)
    num_items, batch, seq, dim = 39, 8, 6, 8  # V = 40 rows: 10 per model shard
    rng = np.random.default_rng(0)
    x = rng.integers(0, num_items + 1, size=(2 * batch, seq)).astype("int32")
    y = rng.integers(-1, num_items + 1, size=(2 * batch, seq, 3)).astype("int32")

    def train():
        keras.utils.set_random_seed(1)
        model = build_sasrec(num_items, max_len=seq, dim=dim, num_blocks=1, dropout=0.0)
        model.compile(
            optimizer=keras.optimizers.SGD(0.5), loss=CutBCELoss(model.get_layer("items"))
        )
        initial = [np.array(w) for w in model.weights]
        losses = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda step, logs: losses.append(float(logs["loss"]))
        )
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[record])
        return model, initial, losses, [np.array(w) for w in model.weights]

    _, initial_1, losses_1, final_1 = train()
    assert not calls, "one device must not take the sharded path"
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"),
                                         keras.distribution.list_devices())
    layout = keras.distribution.LayoutMap(mesh)
    layout["items/embeddings"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="data")
    )
    model, initial_8, losses_8, final_8 = train()
    assert calls.get("cut_bce", 0) >= 1, "the train step did not take the sharded path"
    for a, b in zip(initial_1, initial_8):
        np.testing.assert_array_equal(a, b)
    assert len(losses_1) == len(losses_8) == 2
    _close(losses_8, losses_1, "per-step losses", rtol=1e-6)
    for a, b in zip(final_8, final_1):
        _close(a, b, "weights after 2 steps", rtol=1e-5, atol=1e-6)
    table = model.get_layer("items").embeddings.value
    assert tuple(table.sharding.spec) == ("model", None), table.sharding

    # Data parallel only (replicated table): the plain kernel, same numbers.
    before = calls["cut_bce"]
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    _, _, losses_dp, final_dp = train()
    assert calls["cut_bce"] == before, "a replicated table is not vocab-sharded"
    _close(losses_dp, losses_1, "data-parallel per-step losses", rtol=1e-6)
    for a, b in zip(final_dp, final_1):
        _close(a, b, "data-parallel weights", rtol=1e-5, atol=1e-6)
    print(json.dumps({
        "sharded_loss_calls": calls["cut_bce"],
        "vocab": num_items + 1,
        "table_shard_rows": table.addressable_shards[0].data.shape[0],
        "losses": losses_8,
    }))


if __name__ == "__main__":
    {"ops": _child_ops, "fit": _child_fit}[sys.argv[1]]()
