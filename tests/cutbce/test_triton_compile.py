"""The fused Triton kernels compiled by the real CUDA compiler for GPUs that are not there.

Needs Triton (`pip install ".[triton-compile]"`, installed by
`scripts/setup_env.sh`; it ships `ptxas` and `cuobjdump`); skips without it,
and on backends other than torch. One child process runs
`benchmarks/cutbce_triton.py --deviceless`: both kernels (their heaviest
variants: loss and hidden gradient; table and bias gradients, with a bias)
of both loss families (BCE, softmax) with the static table's configuration (`keras_cutbce/backends/torch/triton/
config.py`), for `config.COMPILED_ARCHS` (sm_80, sm_86, sm_89, sm_90, sm_100; bf16 and fp16 only on
sm_86, sm_89 and sm_100, where fp32 tiles spill), at D in {32, 64, 128, 256}, float32 (full
fp32, torch's default, and TF32), bfloat16 and float16. Each must compile with no register spill
(ptxas -v) and ask for no more shared memory than one block may have on that SM (163 KiB on sm_80,
99 KiB on sm_86 and sm_89, 227 KiB on sm_90 and sm_100): what lets `implementation="auto"` run the kernels on those compute capabilities
(`config.COMPILED_ARCHS`, the archs compiled here) and nowhere else. About 5 minutes on 2 cores.
The launch code also runs through Triton's own JIT with a stand-in sm_90 driver (compiles, no launch).
"""

import importlib.util
import json
import os

import keras
import pytest

from tests.backend_utils import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="Triton kernels: torch only"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed (pip install '.[triton-compile]'): "
                              "no CUDA compiler"),
]


def test_every_configuration_compiles_without_spills_within_shared_memory(tmp_path):
    import subprocess
    import sys

    from keras_cutbce.backends.torch.triton import config

    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "cutbce_triton.py"), "--deviceless",
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table = json.loads((tmp_path / "cutbce_triton_deviceless.json").read_text())
    configurations = {(r["family"], r["arch"], r["dim"], r["dtype"], r["precision"], r["kernel"])
                      for r in table}
    # 2 families x the archs x (4 D x 4 operands, less fp32 at full precision with D = 256, which
    # runs the chunked loop) x 2 kernels.
    # 16-bit operands only (4 D x 2) on config.HALF_ONLY_ARCHS.
    archs = config.COMPILED_ARCHS
    per_arch = [8 if arch in config.HALF_ONLY_ARCHS else 4 * 4 - 1 for arch in archs]
    assert len(configurations) == len(table) == 2 * sum(per_arch) * 2
    assert {r["arch"] for r in table} == set(archs) >= {80, 90}
    for report in table:
        key = (report["arch"], report["dim"], report["dtype"], report["precision"], report["kernel"])
        where = "{} {} sm_{} D={} {} {}".format(report["family"], key[4], *key[:4])
        assert report["spill_bytes"] == 0, (where, report)
        assert 0 < report["shared_bytes"] <= report["shared_limit"], (where, report)
        assert report["registers"] <= 255 and report["loop_instructions"] > 0, (where, report)


# Lane instructions per logit of a BCE training step (both kernels) at the target shape, L = 8, sm_90,
# D = 64 (`tools/triton_sass.py`; "bfloat16": `mixed_bfloat16`). 151 / 149 before the tiles without a
# positive skipped the masking; 95 / 97 (compiled for aligned tensors) before the polynomial `log1p`,
# `ex2`/`rcp`, the columns kernel items first and no hi/lo split of a bf16-stored gradient: 48 / 53; 48 / 47
# since TF32's gradient products take k interleaved (no shuffles).
STEP_INSTRUCTIONS = {"bfloat16": 50, "float32": 48}


def test_instructions_per_logit_at_the_target_shape():
    from tools import triton_sass

    table = triton_sass.measure(arch=90, dtypes=tuple(STEP_INSTRUCTIONS), targets=(8,))
    for row in table:
        dtype = row["dtype"].split()[0]
        if row["kernel"] == "step":
            assert row["total"] <= STEP_INSTRUCTIONS[dtype], row
            assert row["issue_ms"] > max(row["mufu_ms"], row["mma_ms"], row["hbm_ms"]), row
        else:
            assert 0 < row["fraction"] < 0.1 and row["mma"] > 0 and row["mufu"] >= 2, row


def test_programs_per_sm_of_the_compiled_rows_kernel():
    """The 8-warp BCE rows tile fits one program an SM by its registers (the grid was sized for two)."""
    from keras_cutbce.backends.torch.triton import config
    from tools.triton_deviceless import compile_kernel

    for arch, dim, dtype, programs in ((90, 64, "bfloat16", 1), (90, 256, "bfloat16", 3)):
        report = compile_kernel("rows", arch, dim, dtype)
        assert config.programs_per_sm(report["registers"], report["num_warps"],
                                      report["shared_bytes"], arch) == programs, report


class _SM90WithoutGPU:
    """Triton's active driver for an sm_90 GPU that is not there: Triton compiles for real; loading a
    kernel reads its registers from the cubin (`cuobjdump`); a launch records its grid, runs nothing."""

    def __init__(self):
        self.utils, self.grids, self.loaded = self, [], []

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448}

    def launcher_cls(self, src, metadata):
        return lambda *args: self.grids.append((src.fn.__name__, args[:3]))

    def load_binary(self, name, cubin, shared, device):
        import re
        import subprocess
        import tempfile

        from tools.triton_deviceless import tool

        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout
        registers = int(re.search(r"REG:(\d+)", usage).group(1))
        self.loaded.append((name, registers, shared))
        return None, None, registers, 0, 1024


def test_the_first_launch_splits_by_the_kernel_compiled_before_it(monkeypatch):
    """The launch code against Triton's own JIT (`JITFunction.warmup`, then `kernel[grid]`), compiled
    for sm_90 with no GPU: the rows kernel's programs an SM are read from its registers and shared
    memory before its first launch, and the first call's grid is the second's."""
    import collections

    import torch
    from triton.runtime import driver

    from keras_cutbce import cut_categorical_crossentropy
    from keras_cutbce.backends.torch.triton import config, kernels, launch

    for kernel in (kernels.rows_kernel, kernels.columns_kernel):  # this test's compiles stay here
        monkeypatch.setattr(kernel, "device_caches", collections.defaultdict(kernel.create_binder))
    monkeypatch.setattr(launch, "_PROGRAMS", {}, raising=False)  # read by other tests
    monkeypatch.setattr(launch, "device_problem", lambda device: None)  # CPU tensors: nothing runs
    stand_in = _SM90WithoutGPU()
    monkeypatch.setattr(driver, "_active", stand_in)  # `reset_active` would look for a GPU
    hidden, table = torch.ones(40, 64), torch.ones(5000, 64)  # full fp32 (torch's default precision)
    ids = torch.zeros(40, 1, dtype=torch.int32)
    for _ in range(2):
        cut_categorical_crossentropy(hidden, table, ids, implementation="triton")
    rows = [grid for name, grid in stand_in.grids if name == "rows_kernel"]
    assert len(rows) == 2 and rows[0] == rows[1], stand_in.grids
    name, registers, shared = stand_in.loaded[0]  # the kernel compiled before the first launch
    assert name == "rows_kernel"
    block_m, block_n, warps, _ = config.choose(64, torch.float32, False, 90, "ieee", family="softmax").rows_block
    programs = config.programs_per_sm(registers, warps, shared, 90)
    assert programs > 1, (registers, warps, shared)  # where the first launch used to split otherwise
    tiles = -(-5000 // block_n)
    per_split = -(-tiles // config.num_splits(40, tiles, block_m, torch.device("cpu"), programs))
    assert rows[0] == (-(-40 // block_m), -(-tiles // per_split), 1)
