"""CutBCE on CUDA: the fused Triton kernels compiled without a GPU (`--deviceless`: registers, spills, SASS
instructions per logit, a step's lower bounds), and measured on one (`--gpu`: `cutbce_triton_gpu.py`'s
sections; `--cpu-dry-run` in the Triton interpreter). docs/benchmarks.md and docs/gpu.md say what each is.

    python benchmarks/cutbce_triton.py --deviceless         # results/cutbce_triton_deviceless.{md,json}
    python benchmarks/cutbce_triton.py --gpu --budget 120   # results/cutbce_triton_gpu.{md,json}
"""

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "torch")
if "--cpu-dry-run" in sys.argv:  # read when Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
elif "--gpu" in sys.argv:  # a cold compile cache: the first call's JIT latency is measured
    import tempfile

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="cutbce_triton_cache_")

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import REPO, RESULTS, command_line, markdown_table, read_json, write_json  # noqa: E402
from benchmarks.common import write_text  # noqa: E402
from keras_cutbce.backends.torch.triton import config  # noqa: E402
from tools.triton_deviceless import GPUS, compile_kernel  # noqa: E402

PAPER = dict(rows=16384, dim=64, vocab=876_000)
DIMS = (32, 64, 128, 256)
# (operand dtype, fp32 dot precision): torch's default "highest" (ieee), "high" (tf32), bf16 and fp16.
OPERANDS = (("float32", "ieee"), ("float32", "tf32"), ("bfloat16", "ieee"), ("float16", "ieee"))
FAMILIES = ("bce", "softmax")
# bytes of shared memory one block may use, by compute capability
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def _bounds(rows_report, columns_report, arch, dtype, precision, rows, dim, vocab):
    """Lower bounds (ms) of one training step (both kernels) at `rows x vocab`: instruction issue, matmul (the
    tensor cores' dense peak, or the FMA units' for fp32 at `"ieee"`) and HBM (each kernel re-reads the other
    operand once per block: an upper bound on traffic, as L2 catches part of it)."""
    _, sms, ghz, bf16, tf32, fp32, hbm = GPUS[arch]
    logits = rows * vocab
    issue = sum(r["instructions_per_logit"] for r in (rows_report, columns_report))
    issue_ms = 1e3 * logits * issue / (4 * sms * ghz * 1e9)
    products = 2 * (1 + (2 if dtype != "float32" else 1))  # logits once + gradient products
    flops = 2.0 * logits * dim * products
    peak = bf16 if dtype != "float32" else tf32 if precision == "tf32" else fp32
    matmul_ms = 1e3 * flops / (peak * 1e12)
    size = 2 if dtype != "float32" else 4
    traffic = (-(-rows // rows_report["block_m"]) * vocab * dim
               + -(-vocab // columns_report["block_n"]) * rows * dim) * size
    hbm_ms = 1e3 * traffic / (hbm * 1e12)
    return dict(issue_ms=issue_ms, matmul_ms=matmul_ms, hbm_ms=hbm_ms,
                bound=max(("issue", issue_ms), ("matmul", matmul_ms), ("HBM", hbm_ms),
                          key=lambda kv: kv[1])[0])


def deviceless(archs=None):
    """Compiles every (family, arch, D, operands, kernel) of the static table for `archs` (default
    `config.COMPILED_ARCHS`, those `auto` runs the kernels on); returns the table's rows."""
    table = []
    archs = archs or config.COMPILED_ARCHS
    for family, arch, dim, (dtype, precision) in itertools.product(FAMILIES, archs, DIMS, OPERANDS):
        if not config.supports(dim, getattr(torch, dtype), precision, arch):
            continue  # the chunked loop runs these
        pair = {}
        for kernel in ("rows", "columns"):
            start = time.perf_counter()
            report = compile_kernel(kernel, arch, dim, dtype, precision=precision,
                                    family=family)
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
    columns = ["family", "arch", "dim", "dtype", "precision", "kernel", "block_m", "block_n", "num_warps", "num_stages",
               "registers", "spill_bytes", "shared_bytes", "instructions_per_logit",
               "issue_ms", "matmul_ms", "hbm_ms", "bound"]
    return (markdown_table(table, columns)
            + "\n\nBounds: one training step (both kernels) at 16384 x 876000, on the GPU of the arch "
            + f"({', '.join(f'sm_{a}: {g[0]}' for a, g in GPUS.items())}); matmul: tensor cores "
            + "(bf16, TF32) or FMA units (fp32 at ieee, torch's default).\n")


_KEY = ("family", "arch", "dim", "dtype", "precision", "kernel")
_COMPARED = ("registers", "spill_bytes", "instructions_per_logit")


def against(table, path):
    """`table`'s rows with the figures of the same configuration in `path` (another compiler's `--deviceless`
    JSON) beside them (`ref_*`)."""
    reference = {tuple(r[k] for k in _KEY): r for r in read_json(path)}
    rows = []
    for row in table:
        ref = reference.get(tuple(row[k] for k in _KEY), {})
        beside = {f"ref_{k}": ref.get(k, "missing") for k in _COMPARED + ("block_m", "block_n")}
        rows.append({**row, **beside})
    return rows


def _against_markdown(table, path):
    columns = list(_KEY) + ["block_m", "block_n", "num_warps"] + [
        c for k in _COMPARED for c in (k, f"ref_{k}")] + ["issue_ms"]
    moved = [r for r in table if (r["block_m"], r["block_n"]) != (r["ref_block_m"], r["ref_block_n"])]
    spills = [r for r in table if r["spill_bytes"] != r["ref_spill_bytes"]]
    return (f"Triton {triton.__version__} (columns without `ref_`) against `{os.path.relpath(path, REPO)}` "
            f"(`ref_`): {len(table)} configurations compiled, {len(spills)} whose spills differ, "
            f"{len(moved)} whose tiles differ.\n\n" + markdown_table(table, columns)
            + "\n\nissue_ms: this compiler's issue floor of one training step (see the reference's notes).\n")


def _gpu_markdown(report):
    parts = [f"Device: {report['device']}; budget {report['budget_s']:.0f} s, "
             f"{report['wall_s']:.0f} s used. (Each section: `benchmarks/cutbce_triton_gpu.py`.)"]
    for name, rows in report["sections"].items():
        if rows:
            parts.append(f"## {name}\n\n" + markdown_table(rows, list(dict.fromkeys(
                k for r in rows for k in r))))
    for key in ("skipped", "errors"):
        if report[key]:
            parts.append(f"## {key}\n\n" + "\n".join(f"- {line}" for line in report[key]))
    return "\n\n".join(parts) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--deviceless", action="store_true", help="compile for config.COMPILED_ARCHS, no GPU")
    mode.add_argument("--gpu", action="store_true", help="parity, timings and sweep on a GPU")
    mode.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)  # the `ncu` section's
    parser.add_argument("--archs", help="with --deviceless: comma-separated compute capabilities "
                                        "(default: config.COMPILED_ARCHS)")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for --gpu")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="with --gpu: tiny CPU shapes, the Triton interpreter")
    parser.add_argument("--against", metavar="JSON",
                        help="with --deviceless: beside another compiler's table (e.g. Triton 3.7.1's "
                             "benchmarks/results/cutbce_triton_deviceless.json); writes "
                             "cutbce_triton_deviceless_triton<major><minor>.md/.json")
    parser.add_argument("--sections", help="with --gpu: a comma-separated subset of the sections "
                                           "(benchmarks/cutbce_triton_gpu.py), e.g. to rerun those "
                                           "a budget left out; written as cutbce_triton_gpu_sections")
    parser.add_argument("--stem", help="with --gpu: the results' file name (default cutbce_triton_gpu, or "
                                        "cutbce_triton_gpu_sections with --sections)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if args.ncu_child:
        from benchmarks.cutbce_triton_gpu import ncu_child

        return ncu_child()
    if args.deviceless:
        payload = deviceless(args.archs and tuple(int(a) for a in args.archs.split(",")))
        stem = "cutbce_triton_deviceless"
        if args.against:
            payload = against(payload, args.against)
            text = f"Command: `{command_line()}`\n\n" + _against_markdown(payload, args.against)
            stem += "_triton" + "".join(triton.__version__.split(".")[:2])
        else:
            text = f"Command: `{command_line()}`\n\n" + _deviceless_markdown(payload)
    else:
        from benchmarks.cutbce_triton_gpu import SECTIONS, measure

        if not (args.cpu_dry_run or torch.cuda.is_available()):
            print("No CUDA device: run with --deviceless, or on a GPU.")
            return 2
        sections = SECTIONS if args.sections is None else tuple(args.sections.split(","))
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            parser.error(f"--sections: unknown {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
        payload = measure(args.budget, dry_run=args.cpu_dry_run, sections=sections)
        text = _gpu_markdown(payload)
        stem = args.stem or ("cutbce_triton_gpu" if args.sections is None else "cutbce_triton_gpu_sections")
    print(text)
    write_text(os.path.join(args.out, stem + ".md"), text)
    write_json(os.path.join(args.out, stem + ".json"), payload)
    return 1 if args.gpu and payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
