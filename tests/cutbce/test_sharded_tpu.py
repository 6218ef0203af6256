"""The vocab-sharded loss picks its per-shard kernel by the compilation target.

- `kernels`: on 4 simulated CPU devices, `sharded.cut_bce` and `cut_softmax` with
  `kernel="auto"` (chunked off TPU), `"chunked"` and `"pallas"` (the Pallas
  TPU interpreter inside `shard_map`) give the loss and the gradients of
  hidden, table and bias of the single-device kernel, V not divisible by 4;
  the public op passes `kernel="chunked"` when `implementation="chunked"`.
- `tpu`: the same sharded train step compiled by libtpu for a deviceless
  v6e 2x2 pod (4 chips, table split along V) contains the Pallas kernels
  (`tpu_custom_call`), no host callback, no XLA loop and no all-gather of the
  table (only the rows' sums of each shard are gathered); per-chip temporaries
  stay small. Skips without libtpu (`jax[tpu]`).

Each case runs in a subprocess (the device count and the TPU compiler must be
set up before JAX starts).
"""

import json
import math
import re
import sys

import keras
import pytest

from tests.backend_utils import run_child_script

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX meshes need KERAS_BACKEND=jax"
)]
MIB = 2**20


def _libtpu():
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def test_per_shard_kernels_match_one_device():
    report = run_child_script(__file__, dict(
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
    ), args=("kernels",), timeout=900)
    assert sorted(report["kernels"]) == sorted(f"{family} {kernel}" for family in ("bce", "softmax")
                                               for kernel in ("auto", "chunked", "pallas"))
    assert report["op_kernels"] == ["auto", "chunked"]


@pytest.mark.skipif(not _libtpu(), reason="the TPU compiler needs libtpu: pip install 'jax[tpu]'")
def test_compiled_for_a_tpu_pod_runs_pallas_per_shard():
    report = run_child_script(__file__, dict(
        TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
    ), args=("tpu",), timeout=900)
    assert report["chips"] == 4
    assert report["tpu_custom_calls"] >= 2, report  # forward + gradient kernels
    assert report["host_callbacks"] == 0, report
    assert report["while_loops"] == 0, report
    # At most each shard's row sums `[chips, M]` are gathered (the family's merge), never the table.
    assert report["largest_all_gather"] <= report["chips"] * report["rows"], report
    assert report["temp_bytes"] <= 64 * MIB, report
    # Table shard and its gradient shard, not the full table, on each chip.
    assert report["argument_bytes"] < 2 * report["table_shard_bytes"], report
    # Softmax (label smoothing 0.1, 10^6 rows a chip): the positives' rows come from a row-major copy of
    # the shard (lanes padded: 2x its bytes), freed before the gradient kernel writes the shard's
    # gradient; the two held at once were 4x.
    assert report["softmax_temp_bytes"] <= 2.25 * report["softmax_shard_bytes"], report


# --------------------------------------------------------------------- children ---


def _child_kernels():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_cutbce.backends.jax import chunked, sharded

    mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = sharded.VocabSharding(mesh, ("model",))
    rng = np.random.default_rng(0)
    rows, dim, vocab = 16, 8, 1030  # 1030 = 4 x 257 + 2: padded shards
    hidden = jnp.asarray(rng.normal(size=(rows, dim)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(vocab, dim)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.normal(size=(vocab,)) * 0.1, jnp.float32)
    ids = jnp.asarray(rng.integers(-1, vocab, size=(rows, 3)), jnp.int32)
    cotangent = jnp.asarray(rng.normal(size=(rows,)), jnp.float32)
    families = {"bce": dict(label_smoothing=0.1, pos_weight=2.0),
                "softmax": dict(label_smoothing=0.1)}

    def value_and_grads(fn):
        out, pullback = jax.vjp(fn, hidden, table, bias)
        return [np.asarray(x) for x in (out, *pullback(cotangent))]

    checked = []
    for family, settings in families.items():
        one, split = getattr(chunked, f"cut_{family}"), getattr(sharded, f"cut_{family}")
        expected = value_and_grads(lambda h, t, b: one(h, t, ids, b, chunk_size=128, **settings))
        for kernel in sharded.KERNELS:
            got = value_and_grads(lambda h, t, b: split(
                h, t, ids, b, sharding=spec, kernel=kernel, **settings))
            for name, a, e in zip(("loss", "hidden", "table", "bias"), got, expected):
                np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6,
                                           err_msg=f"{family} {kernel} {name}")
            checked.append(f"{family} {kernel}")
    # Through the public op: "auto" lets the target choose, "chunked" forces the XLA loop.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_cutbce import cut_binary_crossentropy

    kernels_asked = []
    original = sharded.cut_bce

    def spy(*args, **kwargs):
        kernels_asked.append(kwargs.get("kernel", "auto"))
        return original(*args, **kwargs)

    sharded.cut_bce = spy
    placed = jax.device_put(table[:1028], NamedSharding(mesh, P("model", None)))
    for implementation in ("auto", "chunked"):
        loss = cut_binary_crossentropy(hidden, placed, ids, implementation=implementation)
        reference = chunked.cut_bce(hidden, table[:1028], ids, chunk_size=128)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(reference), rtol=2e-5)
    sharded.cut_bce = original
    assert kernels_asked == ["auto", "chunked"], kernels_asked
    try:
        sharded.cut_bce(hidden, table, ids, sharding=spec, kernel="mosaic")
    except ValueError as error:
        assert "kernel" in str(error) and "mosaic" in str(error)
    else:
        raise AssertionError("an unknown kernel was accepted")
    print(json.dumps({"kernels": checked, "op_kernels": kernels_asked}))


def _child_tpu():
    from tools import sharded_tpu

    devices = sharded_tpu.topology_devices("v6e:2x2")
    rows, dim, vocab = 1024, 64, 100_000  # 25,000 rows a chip: a partial last tile
    compiled = sharded_tpu.compile_sharded_step(devices, rows, dim, vocab)
    stats = compiled.memory_analysis()
    text = compiled.as_text()
    softmax = sharded_tpu.compile_sharded_step(devices, 4096, dim, 4_000_000, family="softmax",
                                               label_smoothing=0.1)
    gathered = re.findall(r"= \w+\[([0-9,]+)\][^=]*? all-gather(?:-start)?\(", text)
    print(json.dumps({
        "chips": len(devices),
        "tpu_custom_calls": text.count("tpu_custom_call"),
        "host_callbacks": text.count("callback"),
        "while_loops": text.count(" while("),
        "all_gathers": len(gathered),
        "largest_all_gather": max((math.prod(map(int, shape.split(","))) for shape in gathered),
                                  default=0),
        "rows": rows,
        "temp_bytes": stats.temp_size_in_bytes,
        "argument_bytes": stats.argument_size_in_bytes,
        "table_shard_bytes": -(-vocab // len(devices)) * dim * 4,
        "softmax_temp_bytes": softmax.memory_analysis().temp_size_in_bytes,
        "softmax_shard_bytes": 4_000_000 // len(devices) * dim * 4,
    }))


if __name__ == "__main__":
    {"kernels": _child_kernels, "tpu": _child_tpu}[sys.argv[1]]()
