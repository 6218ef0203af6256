"""Child process of `tests/cutbce/test_tpu_compile.py`: compiles CutBCE programs for deviceless TPUs.

Usage: `python tests/tpu_compile_child.py '<JSON list of cases>'`; prints one
`RESULT <json>` line per case (its `CompileReport`, or its error). Each case:
`{"op", "topology", "rows", "dim", "vocab", "dtype", "mesh"}`, optionally
`"ids"` (ids a row, default 4); `mesh`: the trace knows the TPU generation
(`jax.set_mesh`), else it is decided at lowering. Every op runs through the
public API with `implementation="auto"`.

A case `{"op": "cycles", ...}` (the keys of `tools/pallas_cycles.py`'s
cases) reports the kernels' cycles read from their final bundles instead; the
parent then starts this process with libtpu dumping into `CUTBCE_DUMP_DIR`
(`pallas_cycles.DUMP_FLAGS`).
"""

import json
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402

from keras_cutbce import CutBCELoss, CutSoftmaxLoss, cut_categorical_crossentropy  # noqa: E402
from keras_cutbce import ops as kc  # noqa: E402
from tools import tpu_aot  # noqa: E402

NUM_IDS = 4


def _spec(shape, dtype, device):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def _op_program(case, device):
    m, d, v, dtype = case["rows"], case["dim"], case["vocab"], case["dtype"]
    h, t = _spec((m, d), dtype, device), _spec((v, d), dtype, device)
    ids = _spec((m, case.get("ids", NUM_IDS)), jnp.int32, device)
    w = _spec((m,), jnp.float32, device)
    op = case["op"]
    if op == "loss":  # per-row loss, gradients under a cotangent
        def fn(h, t, ids, w):
            def total(h, t):
                return jnp.vdot(w, kc.cut_binary_crossentropy(h, t, ids))
            return jax.value_and_grad(total, argnums=(0, 1))(h, t)
    elif op == "weighted_sum":
        def fn(h, t, ids, w):
            def total(h, t):
                return kc.weighted_loss_sum(h, t, ids, w)
            return jax.value_and_grad(total, argnums=(0, 1))(h, t)
    elif op == "softmax_loss":  # the statistics pass, then the gradient pass under a cotangent
        def fn(h, t, ids, w):
            def total(h, t):
                return jnp.vdot(w, cut_categorical_crossentropy(h, t, ids, label_smoothing=0.1))
            return jax.value_and_grad(total, argnums=(0, 1))(h, t)
    elif op == "softmax_weighted_sum":
        def fn(h, t, ids, w):
            def total(h, t):
                return CutSoftmaxLoss(t, reduction="sum")(ids, h, sample_weight=w)
            return jax.value_and_grad(total, argnums=(0, 1))(h, t)
    elif op == "top_k":
        def fn(h, t, ids, w):
            return kc.cut_top_k(h, t, 10, exclude_ids=ids)
    elif op == "count":
        def fn(h, t, ids, w):
            return kc.cut_count_at_least(h, t, 0.5)
    else:
        raise ValueError(f"unknown op {op!r}")
    return fn, (h, t, ids, w)


def _train_program(case, device):
    """`CutBCELoss` (table: a `keras.Variable`) on a Dense model in a jitted train step.

    The table is used only by the loss, so every table-sized buffer would be
    the loss's (a model that also looks items up pays the lookup's own
    table-sized gradient).
    """
    m, d, v, dtype = case["rows"], case["dim"], case["vocab"], case["dtype"]
    seq = 8
    inputs = keras.Input((seq, d), dtype=dtype)
    model = keras.Model(inputs, keras.layers.Dense(d, dtype=dtype)(inputs))
    table = keras.Variable(jnp.zeros((v, d), dtype), name="items", dtype=dtype)
    loss = CutBCELoss(table)
    variables = list(model.trainable_variables) + [table]

    def fn(values, x, y):
        def total(values):
            y_pred, _ = model.stateless_call(values[:-1], [], x)
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return loss(y, y_pred)
        return jax.value_and_grad(total)(values)

    args = (
        [_spec(x.shape, x.dtype, device) for x in variables],
        _spec((m // seq, seq, d), dtype, device),
        _spec((m // seq, seq, NUM_IDS), jnp.int32, device),
    )
    return fn, args


def _cycles(case):
    from tools import pallas_cycles

    dump_dir = os.environ["CUTBCE_DUMP_DIR"]
    case = {k: v for k, v in case.items() if k != "op"}
    return pallas_cycles.case_row(case, pallas_cycles.compile_case(case, dump_dir))


def run_case(case):
    if case["op"] == "cycles":
        return _cycles(case)
    device = tpu_aot.topology_devices(case["topology"])[0]
    program = _train_program if case["op"] == "train" else _op_program
    fn, args = program(case, device)
    start = time.perf_counter()
    report = tpu_aot.compile_report(fn, args, target=device if case["mesh"] else None)
    data = json.loads(tpu_aot.report_json(report))
    data["compile_s"] = round(time.perf_counter() - start, 2)
    return data


def main():
    for case in json.loads(sys.argv[1]):
        try:
            result = {"case": case, "report": run_case(case)}
        except Exception as error:  # noqa: BLE001 - reported to the parent test
            result = {"case": case, "error": f"{type(error).__name__}: {error}"[:4000]}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
