"""Metrics on a vocabulary-sharded table run the sharded kernels.

Runs this file as a script in a subprocess with 8 simulated CPU devices (as
`tests/cutbce/test_distributed_jax.py` does). Under `keras.distribution.ModelParallel`
with the item table laid out `("model", None)`, `model.evaluate` (a compiled
step: the metrics see traced values) must route `TopKRetrieval` to
`sharded.top_k`, and `MeanReciprocalRank` and `ThresholdConfusion` to
`sharded.count_above` (the sharding is read from the table's variable, not
from the traced value), and give the same numbers as on one device.
`cut_count_at_least` on a placed array routes to the sharded kernel too.
"""

import json

import keras
import pytest

from tests.backend_utils import run_child_script

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX meshes need KERAS_BACKEND=jax"
)]


def test_metrics_run_sharded_and_match_one_device():
    report = run_child_script(__file__, dict(
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        KERAS_BACKEND="jax",
        JAX_PLATFORMS="cpu",
    ))
    assert report["one_device_calls"] == {}
    assert report["sharded_calls"].get("top_k", 0) >= 1
    assert report["sharded_calls"].get("count_above", 0) >= 2  # MRR and the confusion
    assert report["direct_count_calls"] >= 1
    for key, value in report["one_device_logs"].items():
        assert report["sharded_logs"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def _child():
    import jax
    import numpy as np

    from keras_cutbce import CutBCELoss, MeanReciprocalRank, ThresholdConfusion, TopKRetrieval
    from keras_cutbce.backends.jax import sharded
    from keras_cutbce.ops import cut_count_at_least

    assert jax.device_count() == 8, jax.devices()
    calls = {}
    for name in ("top_k", "count_above"):
        original = getattr(sharded, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(sharded, name, spy)

    vocab, dim, seq = 40, 8, 3
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(16, seq)).astype("int32")
    y = rng.integers(-1, vocab, size=(16, seq, 2)).astype("int32")

    def evaluate():
        keras.utils.set_random_seed(3)
        items = keras.layers.Embedding(vocab, dim, name="items")
        inputs = keras.Input((seq,), dtype="int32")
        model = keras.Model(inputs, keras.layers.Dense(dim, name="proj")(items(inputs)))
        model.compile(
            optimizer="sgd",
            loss=CutBCELoss(items, chunk_size=4),
            metrics=[
                TopKRetrieval(items, k=(1, 5), chunk_size=4),
                MeanReciprocalRank(items, chunk_size=4),
                ThresholdConfusion(items, threshold=0.5, chunk_size=4),
            ],
        )
        logs = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
        return {k: float(v) for k, v in logs.items()}

    one_device = evaluate()
    one_device_calls = dict(calls)
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("data", "model"), keras.distribution.list_devices()
    )
    layout = keras.distribution.LayoutMap(mesh)
    layout["items/embeddings"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="data")
    )
    calls.clear()
    sharded_logs = evaluate()
    sharded_calls = dict(calls)
    keras.distribution.set_distribution(None)

    calls.clear()
    jax_mesh = jax.make_mesh((8,), ("model",))
    table = jax.device_put(
        rng.normal(size=(vocab, dim)).astype(np.float32),
        jax.sharding.NamedSharding(jax_mesh, jax.sharding.PartitionSpec("model", None)),
    )
    hidden = rng.normal(size=(6, dim)).astype(np.float32)
    got = cut_count_at_least(hidden, table, 0.5, chunk_size=4)
    want = (hidden @ np.asarray(table).T >= 0.5).sum(-1)
    np.testing.assert_array_equal(np.asarray(got), want)
    print(json.dumps({
        "one_device_logs": one_device,
        "one_device_calls": one_device_calls,
        "sharded_logs": sharded_logs,
        "sharded_calls": sharded_calls,
        "direct_count_calls": calls.get("count_above", 0),
    }))


if __name__ == "__main__":
    _child()
