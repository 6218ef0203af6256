"""CutBCE on CUDA: the fused Triton kernels, compiled without a GPU, and measured on one.

Deviceless (any host with Triton, `pip install ".[triton-compile]"`; no GPU,
no CUDA driver):

    python benchmarks/cutbce_triton.py --deviceless

compiles both kernels (their heaviest variants) with the static table's
configuration for sm_80 and sm_90 at D in {32, 64, 128, 256}, float32 (at
torch's default precision, full fp32, and at TF32) and bfloat16, and prints registers, spill bytes, shared memory, the SASS
instructions of the tile loop per logit (warp instructions of one iteration
/ logits of the tile; the positives' inner loop counted once) and three
lower bounds of one training step (loss + all gradients: both kernels) at
the CutBCE paper's scale (16384 rows, V = 876000): instruction issue (4 warp
instructions per clock per SM), matmul (the tensor cores' dense peak, or the
FMA units' for full fp32) and HBM (each kernel re-reads the other operand once per block, an upper
bound on traffic as L2 catches part of it). Writes
`benchmarks/results/cutbce_triton_deviceless.json`.

On a GPU (the one GPU check, `scripts/gpu_check.sh`):

    python benchmarks/cutbce_triton.py --gpu --budget 240

checks parity of triton and chunked against the dense formula (TF32 off),
then times dense Keras BCE, chunked and triton, alternating in one process
(median of >= 5 forward + backward steps, `torch.cuda.max_memory_allocated`
per variant) at (4096, 64, 32768) and the paper's scale (dense only where
its logits fit), then sweeps a few tile configurations at the paper's scale
to retune `keras_cutbce/backends/torch/triton/config.py`, stopping when the
budget (seconds) is spent. Writes `benchmarks/results/cutbce_triton_gpu.json`.
`--gpu --cpu-dry-run` runs the same steps on tiny CPU shapes, the kernels in
the Triton interpreter (checks the script; the numbers mean nothing).
"""

import argparse
import json
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
os.environ.setdefault("KERAS_BACKEND", "torch")
if "--cpu-dry-run" in sys.argv:  # read when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

from benchmarks.common import markdown_table  # noqa: E402

PAPER = dict(rows=16384, dim=64, vocab=876_000)
GPU_SHAPES = ((4096, 64, 32768), tuple(PAPER.values()))
DRY_RUN_SHAPES = ((64, 16, 300), (96, 16, 700))
_DEVICE = {"name": "cuda"}
# (SMs, boost clock GHz, dense bf16 / tf32 / fp32 TFLOP/s, HBM TB/s) of the GPU each arch stands for.
GPUS = {80: ("A100 SXM", 108, 1.41, 312.0, 156.0, 19.5, 2.0),
        90: ("H200 SXM", 132, 1.98, 989.0, 494.0, 67.0, 4.8)}
ARCHS = (80, 90)
DIMS = (32, 64, 128, 256)
# (operand dtype, fp32 dot precision): torch's default "highest" (ieee), "high" (tf32), and bf16.
OPERANDS = (("float32", "ieee"), ("float32", "tf32"), ("bfloat16", "ieee"))
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory one block may use


def _bounds(rows_report, columns_report, arch, dtype, precision, rows, dim, vocab):
    """Lower bounds (ms) of one training step (both kernels) at `rows x vocab`, per limiter.

    The matmul bound is at the tensor cores' dense peak (bf16, TF32), or the FMA units' for fp32
    at `"ieee"` precision (torch's default `"highest"`).
    """
    _, sms, ghz, bf16, tf32, fp32, hbm = GPUS[arch]
    logits = rows * vocab
    issue = sum(r["instructions_per_logit"] for r in (rows_report, columns_report))
    issue_ms = 1e3 * logits * issue / (4 * sms * ghz * 1e9)
    products = 2 * (1 + (2 if dtype != "float32" else 1))  # logits once + gradient products
    flops = 2.0 * logits * dim * products
    if dtype != "float32":
        peak = bf16
    else:
        peak = tf32 if precision == "tf32" else fp32
    matmul_ms = 1e3 * flops / (peak * 1e12)
    size = 2 if dtype != "float32" else 4
    traffic = (-(-rows // rows_report["block_m"]) * vocab * dim
               + -(-vocab // columns_report["block_n"]) * rows * dim) * size
    hbm_ms = 1e3 * traffic / (hbm * 1e12)
    return dict(issue_ms=issue_ms, matmul_ms=matmul_ms, hbm_ms=hbm_ms,
                bound=max(("issue", issue_ms), ("matmul", matmul_ms), ("HBM", hbm_ms),
                          key=lambda kv: kv[1])[0])


def deviceless():
    """Compiles every (arch, D, operands, kernel) of the static table; returns the table's rows."""
    import torch

    from keras_cutbce.backends.torch.triton import config
    from keras_cutbce.backends.torch.triton.deviceless import compile_kernel

    table = []
    for arch in ARCHS:
        for dim in DIMS:
            for dtype, precision in OPERANDS:
                if not config.supports(dim, getattr(torch, dtype), precision):
                    continue  # the chunked loop runs these
                pair = {}
                for kernel in ("rows", "columns"):
                    start = time.perf_counter()
                    report = compile_kernel(kernel, arch, dim, dtype, precision=precision)
                    report["precision"] = precision if dtype == "float32" else "-"
                    report["compile_s"] = time.perf_counter() - start
                    report["shared_limit"] = SHARED_LIMIT[arch]
                    pair[kernel] = report
                bounds = _bounds(pair["rows"], pair["columns"], arch, dtype, precision,
                                 PAPER["rows"], dim, PAPER["vocab"])
                for report in pair.values():
                    table.append({**report, **bounds})
    return table


def _deviceless_markdown(table):
    columns = ["arch", "dim", "dtype", "precision", "kernel", "block_m", "block_n", "num_warps", "num_stages",
               "registers", "spill_bytes", "shared_bytes", "instructions_per_logit",
               "issue_ms", "matmul_ms", "hbm_ms", "bound"]
    return (markdown_table(table, columns)
            + "\n\nBounds: one training step (both kernels) at 16384 x 876000, on the GPU of the arch "
            + f"({', '.join(f'sm_{a}: {g[0]}' for a, g in GPUS.items())}); matmul: tensor cores "
            + "(bf16, TF32) or FMA units (fp32 at ieee, torch's default).\n")


def _gpu_markdown(report):
    parts = [f"Device: {report['device']}"]
    for key in ("parity", "timings", "sweep"):
        if report[key]:
            parts.append(markdown_table(report[key], sorted({k for r in report[key] for k in r})))
    return "\n\n".join(parts) + "\n"


def _step(implementation, h, e, b, ids):
    import keras
    import torch

    from keras_cutbce import cut_binary_crossentropy
    from keras_cutbce.math import reference

    for x in (h, e, b):
        x.grad = None
    if implementation == "dense":
        y = reference.multi_hot(ids, e.shape[0])
        loss = keras.losses.binary_crossentropy(y, reference.logits(h, e, b), from_logits=True)
    else:
        loss = cut_binary_crossentropy(h, e, ids, b, implementation=implementation)
    loss.mean().backward()
    _synchronize()
    return loss.detach()


def _synchronize():
    import torch

    if _DEVICE["name"] == "cuda":
        torch.cuda.synchronize()


def _peak_mib():
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if _DEVICE["name"] == "cuda" else 0.0


def _problem(rows, dim, vocab, dtype, seed=0):
    import torch

    gen = torch.Generator(device=_DEVICE["name"]).manual_seed(seed)
    kw = dict(device=_DEVICE["name"], generator=gen)
    h = (torch.randn(rows, dim, **kw) * 0.3).to(dtype).requires_grad_()
    e = (torch.randn(vocab, dim, **kw) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(vocab, **kw) * 0.1).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (rows, 8), device=_DEVICE["name"], generator=gen)
    return h, e, b, ids


def _parity(shape):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    h, e, b, ids = _problem(*shape, torch.float32)
    want = _step("dense", h, e, b, ids)
    grads = [x.grad.clone() for x in (h, e, b)]
    rows = []
    for implementation in ("chunked", "triton"):
        got = _step(implementation, h, e, b, ids)
        errors = [float((got - want).abs().max() / want.abs().max())]
        errors += [float((x.grad - g).abs().max() / g.abs().max()) for x, g in zip((h, e, b), grads)]
        rows.append(dict(implementation=implementation, loss_rel=errors[0], grad_h_rel=errors[1],
                         grad_table_rel=errors[2], grad_bias_rel=errors[3]))
    return rows


def _time(implementations, problem, repeats):
    import torch

    times = {name: [] for name in implementations}
    peaks = {}
    for name in implementations:  # warm-up (compiles) and peak memory
        if _DEVICE["name"] == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _step(name, *problem)
        peaks[name] = _peak_mib()
    for _ in range(repeats):
        for name in implementations:  # alternating
            start = time.perf_counter()
            _step(name, *problem)
            times[name].append(1e3 * (time.perf_counter() - start))
    return [dict(implementation=n, median_ms=statistics.median(t), min_ms=min(t),
                 peak_mib=peaks[n], repeats=len(t)) for n, t in times.items()]


def gpu(budget, shapes=GPU_SHAPES, parity_shape=(1000, 64, 5003)):
    """The GPU check's CutBCE part; returns its report (stops the sweep when `budget` s is spent).

    The last of `shapes` is the sweep's.
    """
    import torch

    from keras_cutbce.backends.torch.triton import config

    start = time.perf_counter()
    device = torch.cuda.get_device_name() if _DEVICE["name"] == "cuda" else "cpu (dry run)"
    report = dict(device=device, parity=_parity(parity_shape), timings=[], sweep=[])
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        for rows, dim, vocab in shapes:
            problem = _problem(rows, dim, vocab, torch.float32)
            free = torch.cuda.mem_get_info()[0] if _DEVICE["name"] == "cuda" else 2**30
            dense_fits = 3 * rows * vocab * 4 < 0.8 * free
            names = (["dense"] if dense_fits else []) + ["chunked", "triton"]
            for row in _time(names, problem, repeats=5):
                report["timings"].append(dict(rows=rows, dim=dim, vocab=vocab, tf32=tf32, **row))
            del problem
            if _DEVICE["name"] == "cuda":
                torch.cuda.empty_cache()
    candidates = [((128, 64, 8, 2), (128, 64, 8, 2)), ((64, 64, 4, 2), (64, 64, 4, 2)),
                  ((128, 128, 8, 3), (128, 128, 8, 2)), ((64, 128, 4, 2), (128, 64, 4, 2))]
    for dtype in (torch.bfloat16, torch.float32):
        problem = _problem(*shapes[-1], dtype)
        for rows_block, columns_block in candidates:
            if time.perf_counter() - start > budget:
                report["sweep_stopped"] = "budget spent"
                return report
            try:
                with config.overridden((rows_block, columns_block)):
                    row = _time(["triton"], problem, repeats=5)[0]
            except Exception as error:  # a configuration that does not compile or fit
                row = dict(error=repr(error)[:200])
            report["sweep"].append(dict(dtype=str(dtype), rows_block=rows_block,
                                        columns_block=columns_block, **row))
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--deviceless", action="store_true", help="compile for sm_80/sm_90, no GPU")
    mode.add_argument("--gpu", action="store_true", help="parity, timings and sweep on a GPU")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for --gpu")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="with --gpu: tiny CPU shapes, the Triton interpreter")
    parser.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.deviceless:
        payload = deviceless()
        text = _deviceless_markdown(payload)
        stem = "cutbce_triton_deviceless"
    else:
        import torch

        if args.cpu_dry_run:
            _DEVICE["name"] = "cpu"
            payload = gpu(args.budget, DRY_RUN_SHAPES, parity_shape=(40, 16, 203))
        elif not torch.cuda.is_available():
            print("No CUDA device: run with --deviceless, or on a GPU.")
            return 2
        else:
            payload = gpu(args.budget)
        text = _gpu_markdown(payload)
        stem = "cutbce_triton_gpu"
    print(text)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(text)
    path = os.path.join(args.out, stem + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
