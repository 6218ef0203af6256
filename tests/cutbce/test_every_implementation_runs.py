"""Each public op and loss runs with each implementation the registry lists for it on this backend.

A docstring or page that says an implementation "raises" for an op is checked here against what runs:
every `implementation=` the registry (`keras_cutbce.registry.IMPLEMENTATIONS`) names for the op's
family on this backend runs through the public op and the Keras loss and gives the dense reference's
numbers. One that cannot run on this machine (Triton on a CPU tensor without the interpreter) raises
the `ValueError` its `DEVICES` entry gives, after its `FITS` entry accepted the inputs; a child process
runs it in the Triton interpreter. `"sharded"` is no `implementation=` value: a table split along V
over a JAX mesh reaches it, for both families (a child process with two CPU devices).
"""

import importlib
import json
import os
import sys

import keras
import numpy as np
import pytest

from keras_cutbce import CutBCELoss, CutSoftmaxLoss, cut_binary_crossentropy, cut_categorical_crossentropy
from keras_cutbce import registry
from tests.backend_utils import BACKEND, run_child_script, to_numpy

FAMILIES = {  # family -> (registry op, public op, Keras loss)
    "bce": ("cut_bce", cut_binary_crossentropy, CutBCELoss),
    "softmax": ("cut_softmax", cut_categorical_crossentropy, CutSoftmaxLoss),
}


def listed(op, backend=BACKEND):
    """The `implementation=` values that run `op` on `backend`: "auto" and every named one the registry has."""
    return ["auto"] + [name for name in registry.NAMES if name != "auto" and registry.has(op, name, backend)]


def _inputs(rows=6, vocab=37, dim=8):
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(rows, dim)).astype("float32")
    table = (rng.normal(size=(vocab, dim)) * 0.5).astype("float32")
    bias = (rng.normal(size=(vocab,)) * 0.1).astype("float32")
    ids = rng.integers(0, vocab, size=(rows, 3)).astype("int32")
    ids[1, 2] = -1  # padding
    return hidden, table, bias, ids


def _entry(path):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _refusal(implementation, hidden, table, bias):
    """The registry's reason `implementation` cannot run these inputs here (None: it runs them)."""
    if implementation not in registry.DEVICES:
        return None
    tensors = [keras.ops.convert_to_tensor(x) for x in (hidden, table, bias)]
    assert _entry(registry.FITS[implementation])(*tensors), f"{implementation} refuses the test's inputs"
    return _entry(registry.DEVICES[implementation])(tensors[0].device)


def run_everything(names=None):
    """Runs every (family, implementation) on this backend; `{family: {implementation: result}}`, the
    result "ok" (op and loss equal the reference's numbers) or the refusal's message."""
    hidden, table, bias, ids = _inputs()
    report = {}
    for family, (op, public_op, loss_class) in FAMILIES.items():
        want = to_numpy(public_op(hidden, table, ids, bias, implementation="reference"))
        want_mean = float(np.mean(want))
        report[family] = {}
        for name in listed(op):
            if names is not None and name not in names:
                continue
            refusal = _refusal(name, hidden, table, bias)
            if refusal:
                with pytest.raises(ValueError, match="triton"):
                    public_op(hidden, table, ids, bias, implementation=name)
                report[family][name] = refusal
                continue
            got = to_numpy(public_op(hidden, table, ids, bias, implementation=name))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"{family} {name} op")
            loss = loss_class(keras.Variable(table), bias=keras.Variable(bias), implementation=name)
            value = float(to_numpy(loss(ids, hidden)))
            np.testing.assert_allclose(value, want_mean, rtol=2e-5, err_msg=f"{family} {name} loss")
            report[family][name] = "ok"
    return report


def test_each_listed_implementation_runs_the_op_and_the_loss_of_both_families():
    """Every listed implementation but Pallas (its interpreter takes a minute: the slow test below)."""
    report = run_everything(names=[n for n in registry.NAMES if n != "pallas"])
    for family, (op, _, _) in FAMILIES.items():
        assert set(report[family]) == set(listed(op)) - {"pallas"}, family
        assert report[family]["auto"] == report[family]["chunked"] == report[family]["reference"] == "ok"
    # Both families have the same implementations on every backend: none "raises" for softmax.
    for backend in registry.BACKENDS:
        assert listed("cut_softmax", backend) == listed("cut_bce", backend), backend
        assert registry.has("cut_softmax", "sharded", backend) == registry.has("cut_bce", "sharded", backend)
    if BACKEND == "torch":  # CPU tensors: the interpreter runs them (slow test below), else the refusal
        refusal = _entry(registry.DEVICES["triton"])(keras.ops.convert_to_tensor(_inputs()[0]).device)
        assert report["softmax"]["triton"] == report["bce"]["triton"] == (refusal or "ok")


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "jax", reason="the Pallas kernels are JAX's")
def test_pallas_runs_both_families():
    """Off TPU the Pallas kernels run in the Pallas interpreter."""
    assert run_everything(names=("pallas",)) == {"bce": {"pallas": "ok"}, "softmax": {"pallas": "ok"}}


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "torch", reason="the Triton kernels are torch's")
def test_triton_runs_both_families_in_the_interpreter():
    report = run_child_script(__file__, {"TRITON_INTERPRET": "1", "KERAS_BACKEND": "torch"}, args=("triton",))
    assert report == {"bce": {"triton": "ok"}, "softmax": {"triton": "ok"}}


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "jax", reason="JAX meshes")
def test_a_table_split_over_a_mesh_runs_both_families():
    report = run_child_script(__file__, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                         "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}, args=("sharded",))
    assert report == {"cut_bce": 2, "cut_softmax": 2}  # the op and the loss, each family


def _child_sharded():
    """On two CPU devices: the public op and loss of each family on a table split along V."""
    import jax

    from keras_cutbce.backends.jax import sharded
    from tests.cutbce.test_distributed_jax import _spy

    calls = {}
    for name in ("cut_bce", "cut_softmax"):
        _spy(sharded, name, calls)
    hidden, table, bias, ids = _inputs(vocab=38)
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("model",))
    split = jax.device_put(table, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None)))
    for family, (_, public_op, loss_class) in FAMILIES.items():
        want = to_numpy(public_op(hidden, table, ids, bias, implementation="reference"))
        got = to_numpy(public_op(hidden, split, ids, bias))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=family)
        variable = keras.Variable(split)
        value = float(to_numpy(loss_class(variable, bias=keras.Variable(bias))(ids, hidden)))
        np.testing.assert_allclose(value, float(np.mean(want)), rtol=2e-5, err_msg=family)
    print(json.dumps(calls))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if sys.argv[1] == "triton":
        print(json.dumps(run_everything(names=("triton",))))
    else:
        _child_sharded()
