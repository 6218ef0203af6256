"""CutBCE compiled by the real TPU compiler (Mosaic, XLA:TPU) for deviceless TPUs.

Needs `libtpu` (`pip install ".[tpu-compile]"`, installed by
`scripts/setup_env.sh`); skips without it, and on backends other than JAX.
Nothing runs on a TPU: each program is lowered and compiled in one child
process (`tests/tpu_compile_child.py`, TPU settings in its environment) and
its `CompileReport` checked:

- the loss ops and `CutBCELoss` in a jitted train step, with
  `implementation="auto"` from this CPU host, compile the Pallas kernels
  (`tpu_custom_call`s named `cutbce_*`) and no host callback: dispatch
  follows the compilation target;
- HBM temporaries <= max(64 MiB, 5% of the table's bytes): no table-sized
  copy, pad, transpose or relayout (tables here are 64 MiB to 1 GiB);
- every kernel's scoped VMEM within its limit (the limit it asked for, else
  16 MiB, the smallest default);
- every kernel has a "parallel" grid axis, and on two-core chips (v4, v5p,
  generation known) its outputs are per-core partials (megacore);
- `weighted_loss_sum`'s resident row blocks at their largest (D = 64,
  float32, L = 8): two full blocks on v4, v5e, v5p and v6e, and the CutBCE
  paper's (16384, 64, 876000) on v5e with the generation unknown, every
  pass within its scoped VMEM limit;
- retrieval (`cut_top_k`, `cut_count_at_least`: XLA loops, no Pallas kernel)
  compiles without host callbacks;
- the fused kernel's schedule (`tools/pallas_cycles.py`: the final
  bundles, a static property of the compiled kernel, not a timing) stays
  within the cycles per 1024 logits and the multiple of the MXU floor it
  reached (v6e, (4096, 64, 876000) float32 and bfloat16, L = 8; float32
  with a bias too), and so do softmax's statistics and gradient kernels
  together (float32);
- softmax (`cutsoftmax_*` kernels): the reduced `CutSoftmaxLoss` on v5p and
  v5e and the per-position op on v6e (generation unknown), the same checks.

The matrix spreads v4, v5e, v5p and v6e, D in {32, 64, 96, 128, 192, 256},
float32 and bfloat16, aligned and unaligned V, and a known or unknown
generation (`mesh`) over 15 programs rather than their full cross product,
to fit CI's time (on 2 shared cores about 4.5 minutes with the cycles
compiles, and 3.5 more for the five resident-row programs).
"""

import importlib.util
import json
import os
import subprocess
import sys

import keras
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(keras.backend.backend() != "jax", reason="TPU compilation is JAX only"),
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu is not installed (pip install '.[tpu-compile]'): no TPU compiler",
    ),
]

MiB = 2**20
DEFAULT_SCOPED_VMEM = 16 * MiB
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_compile_child.py")


def _case(op, topology, dim, dtype, vocab, mesh, rows=2048):
    return dict(op=op, topology=topology, rows=rows, dim=dim, vocab=vocab, dtype=dtype, mesh=mesh)


CASES = [
    _case("weighted_sum", "v6e:2x2", 64, "float32", 2_000_003, True),
    _case("weighted_sum", "v5e:2x2", 128, "bfloat16", 2_097_152, False),
    _case("weighted_sum", "v4:2x2x1", 192, "float32", 1_000_003, True),
    _case("weighted_sum", "v5p:2x2x1", 32, "bfloat16", 2_097_152, True, rows=4096),
    _case("loss", "v4:2x2x1", 96, "bfloat16", 2_000_003, False),
    _case("loss", "v5p:2x2x1", 256, "float32", 1_048_576, False),
    _case("loss", "v6e:2x2", 32, "bfloat16", 2_097_152, True),
    _case("loss", "v5e:2x2", 64, "float32", 1_000_003, True),
    _case("train", "v5p:2x2x1", 32, "float32", 600_001, False, rows=4096),
    _case("train", "v6e:2x2", 192, "bfloat16", 300_007, True),
    _case("top_k", "v5e:2x2", 96, "float32", 50_003, False),
    _case("count", "v4:2x2x1", 128, "bfloat16", 50_000, True),
    _case("softmax_weighted_sum", "v5p:2x2x1", 64, "float32", 1_000_003, True),
    _case("softmax_weighted_sum", "v5e:2x2", 64, "float32", 1_000_003, True),
    _case("softmax_loss", "v6e:2x2", 128, "bfloat16", 2_097_152, False),
]
PALLAS_OPS = ("weighted_sum", "loss", "train", "softmax_weighted_sum", "softmax_loss")


def _case_id(case):
    target = "known" if case["mesh"] else "unknown"
    return "{op}-{topology}-D{dim}-{dtype}-V{vocab}".format(**case) + f"-{target}"


def _compile_in_child(cases):
    """`{case id: result}` of `cases`, compiled in one child process."""
    env = dict(os.environ, KERAS_BACKEND="jax", TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env["JAX_PLATFORMS"] = ""  # JAX's own choice, not the quiet start's CPU: the child must see the TPU compiler
    out = subprocess.run(
        [sys.executable, CHILD, json.dumps(cases)], capture_output=True, text=True,
        env=env, timeout=1500,
    )
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            results[_case_id(result["case"])] = result
    assert results, f"the child compiled nothing:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return results


@pytest.fixture(scope="module")
def reports():
    """`{case id: result}` of every case, compiled in one child process."""
    return _compile_in_child(CASES)


def _table_bytes(case):
    itemsize = 2 if case["dtype"] == "bfloat16" else 4
    return case["vocab"] * case["dim"] * itemsize


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_compiles_for_tpu(reports, case):
    result = reports[_case_id(case)]
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert not report["host_callbacks"], report["custom_call_targets"]
    bound = max(64 * MiB, _table_bytes(case) // 20)
    assert report["temp_bytes"] <= bound, (report["temp_bytes"], bound)
    if case["op"] in PALLAS_OPS:
        names = [k["name"] for k in report["kernels"]]
        family = "cutsoftmax_" if case["op"].startswith("softmax") else "cutbce_"
        assert names and all(family in name for name in names), names
    for kernel in report["kernels"]:
        limit = kernel["vmem_limit_bytes"] or DEFAULT_SCOPED_VMEM
        assert 0 < kernel["scoped_vmem_bytes"] <= limit, kernel
    if case["op"] in PALLAS_OPS:
        # Megacore (C4): the vocabulary axis is "parallel" and, on two-core
        # chips whose generation the trace knows, every kernel writes one
        # loss / hidden-gradient partial per core (leading dim 2).
        cores = 2 if case["mesh"] and case["topology"].split(":")[0] in ("v4", "v5p") else 1
        for kernel in report["kernels"]:
            assert kernel["parallel_axis"], kernel
            assert kernel["output_shapes"][0].split("[")[1].startswith(f"{cores},"), kernel


# Resident row blocks at their largest, `weighted_sum` (the fused kernel
# alone), D = 64, float32, 8 ids a row: on every chip (generation known) the
# rows of two full blocks, the most one pass holds (the second pass also
# holds the carried table gradient); and the CutBCE paper's (16384, 64,
# 876000) on v5e compiled with the generation unknown (the default 16 MiB
# scoped VMEM), which ran out of scoped VMEM in the passes after the first.
VMEM_TARGETS = ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2", "v5e:2x2-unknown"]
_DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}


def _vmem_case(target):
    """The case of a `VMEM_TARGETS` entry and the kernel passes the tiling rule gives it."""
    from types import SimpleNamespace

    from keras_cutbce.backends.jax import compile_platform
    from keras_cutbce.backends.jax.pallas import api

    topology, _, unknown = target.partition("-")
    info = None if unknown else compile_platform.chip_info(_DEVICE_KINDS[topology.split(":")[0]])
    capacity = None if info is None else info.vmem_bytes
    vocab = 876_000 if unknown else 2**20
    row_tile, tile = api.choose_tiles(2**15, vocab, 64, "float32",
                                      api.tile_budget_bytes(capacity))
    cfg = SimpleNamespace(row_tile=row_tile, tile=tile, num_ids=8, vmem_capacity=capacity,
                          mm_dtype="float32", table_dtype="float32")
    rows = 16384 if unknown else 2 * api.rows_per_pass(cfg, 64, 4)
    case = _case("weighted_sum", topology, 64, "float32", vocab, not unknown, rows=rows)
    return dict(case, ids=8), api.row_blocks(rows, 64, 4, cfg)[0]


@pytest.fixture(scope="module")
def vmem_reports():
    """`{target: (result, passes)}` of every `VMEM_TARGETS` entry, compiled in one child process."""
    cases = {target: _vmem_case(target) for target in VMEM_TARGETS}
    results = _compile_in_child([case for case, _ in cases.values()])
    return {target: (results[_case_id(case)], passes) for target, (case, passes) in cases.items()}


@pytest.mark.parametrize("target", VMEM_TARGETS)
def test_resident_row_blocks_fit_scoped_vmem(vmem_reports, target):
    result, passes = vmem_reports[target]
    assert "error" not in result, result.get("error")
    kernels = result["report"]["kernels"]
    assert len(kernels) == passes and all("cutbce_fused" in k["name"] for k in kernels), kernels
    if not target.endswith("unknown"):
        assert passes == 2
    for kernel in kernels:
        limit = kernel["vmem_limit_bytes"] or DEFAULT_SCOPED_VMEM
        assert 0 < kernel["scoped_vmem_bytes"] <= limit, kernel
    assert result["report"]["temp_bytes"] <= 64 * MiB, result["report"]["temp_bytes"]


# The fused kernel's schedule (softmax: its statistics and gradient kernels, summed; "+ bias":
# with a bias and its gradient): v6e, (4096, 64, 876000), L = 8 ids a row, per table dtype.
CYCLES_CASE = dict(op="cycles", chip="v6e", ids=8, rows=4096, dim=64, vocab=876_000)
MAX_CYCLES_PER_1024_LOGITS = {("float32", "fused"): 5.45, ("bfloat16", "fused"): 5.8,
                              ("float32", "fused + bias"): 5.5, ("float32", "softmax"): 5.5}
MAX_TIMES_MXU_FLOOR = {("float32", "fused"): 1.81, ("bfloat16", "fused"): 1.93,
                       ("float32", "fused + bias"): 1.83, ("float32", "softmax"): 1.38}


@pytest.mark.parametrize("dtype,path", list(MAX_CYCLES_PER_1024_LOGITS))
def test_fused_kernel_cycles_per_1024_logits(tmp_path, dtype, path):
    from tools import pallas_cycles

    env = dict(os.environ, KERAS_BACKEND="jax", TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1", CUTBCE_DUMP_DIR=str(tmp_path),
               LIBTPU_INIT_ARGS=pallas_cycles.DUMP_FLAGS.format(dir=tmp_path))
    env["JAX_PLATFORMS"] = ""  # JAX's own choice (scripts/quiet_start.pth pins the CPU)
    base, _, bias = path.partition(" + ")
    case = dict(CYCLES_CASE, dtype=dtype, path=base, **({"bias": True} if bias else {}))
    out = subprocess.run([sys.executable, CHILD, json.dumps([case])], capture_output=True,
                         text=True, env=env, timeout=1500)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"no result:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert "error" not in result, result["error"]
    kernels = result["report"]["kernels"]
    names = {"fused": ["cutbce_fused"], "softmax": ["cutsoftmax_grads", "cutsoftmax_stats"]}
    assert sorted(k["kernel"] for k in kernels) == names[base], kernels
    assert all(k["step_cycles"] > 0 for k in kernels), kernels
    cycles = sum(k["cycles_per_1024"] for k in kernels)
    assert cycles <= MAX_CYCLES_PER_1024_LOGITS[dtype, path], kernels
    times = sum(k["est_ms"] for k in kernels) / sum(k["mxu_ms"] for k in kernels)
    assert times <= MAX_TIMES_MXU_FLOOR[dtype, path], kernels
