"""SASS instructions per logit, by class, of the fused Triton kernels' tile loops, beside the floors.

Nothing runs on a GPU and nothing is timed. Each kernel is compiled deviceless
(`tools/triton_deviceless.py`: Triton 3.7.1 and its `ptxas`) and its cubin
disassembled (`cuobjdump -sass`). The tile loop is the longest backward
branch; a loop nested in it is the positives' loop (BCE: one trip per target
id of the row block), and the outermost forward branch around it skips its
region (the loop's guard, and the tile's "any positive here" flag where the
kernel has one). Per tile, a lane issues

    base + f (preamble + L x per_target)

instructions: `base` the tile loop outside that region, `preamble` the
region outside the nested loop, `per_target` the nested loop's body, `L` the
target ids per row and `f` the fraction of tiles that enter the region: 1
when every tile does (the loop runs whenever `L > 0`), else the expected
fraction of `[BLOCK_M, BLOCK_N]` tiles holding one of the row block's
`BLOCK_M x L` positives for ids drawn uniformly, `1 - (1 - BLOCK_N / V) ^
(BLOCK_M L)` (clustered ids enter fewer tiles). Per logit: lane instructions
of one tile x lanes / logits of the tile (`x 32` the warp instructions per
logit of `benchmarks/cutbce_triton.py --deviceless`).

Classes: `float` (FMA/ALU: FFMA, FADD, FMUL, FMNMX, FSETP, conversions),
`mufu` (special functions: exp2, lg2, rcp), `mma` (HGMMA, HMMA), `integer`
(integer ALU, selects, predicates, moves), `memory` (loads, stores, shared
memory), `barrier` (BAR, warp-group fences, dependency barriers), `other`
(branches, reconvergence, NOPs).

The floors of one training step (both kernels, loss and every gradient) at
`(M, D, V)`, estimates:

- issue: warp instructions / (4 per clock per SM x SMs x boost clock);
- special functions: lane MUFU ops / (16 per clock per SM x SMs x clock);
- MMA: `2 M V D` FLOP per product (the logits in each kernel; the two
  gradient products, each twice where it splits bf16/fp16 slopes in hi and lo) at
  the tensor cores' dense peak;
- HBM: each kernel reads the other operand once per block (the same count as
  `benchmarks/cutbce_triton.py`), an upper bound as L2 keeps part of it.

Usage (needs Triton; a few seconds a kernel):

    python tools/triton_sass.py                                # sm_90, bf16 (both tables), TF32; L = 8, 1
    python tools/triton_sass.py --dtypes float32 --precision ieee --family softmax   # full fp32 (FMA)
    python tools/triton_sass.py --json /tmp/before.json        # in another checkout: the "before"
    python tools/triton_sass.py --compare /tmp/before.json     # + a before/after table
"""

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.triton_deviceless import GPUS  # noqa: E402
from tools.triton_deviceless import compile_kernel  # noqa: E402
from tools.triton_deviceless import disassemble  # noqa: E402
from tools.triton_deviceless import loop_regions  # noqa: E402
from tools.triton_deviceless import parse_sass  # noqa: E402

__all__ = ["CLASSES", "SHAPE", "classify", "count", "floors", "per_logit"]

CLASSES = ("float", "mufu", "mma", "integer", "memory", "barrier", "other")
SHAPE = (16384, 64, 876_000)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
_FLOAT = {"FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FCHK", "FSWZADD", "F2F", "F2FP", "F2I", "I2F",
          "I2FP", "FRND", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2"}
_MMA = {"HGMMA", "HMMA", "IMMA", "DMMA", "QGMMA", "IGMMA"}
_MEMORY = {"LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LD", "ST", "LDL", "STL", "LDC", "LDGSTS",
           "ATOM", "ATOMS", "ATOMG", "RED", "UTMALDG", "UTMASTG", "UBLKCP", "LDGDEPBAR"}
_BARRIER = {"BAR", "WARPGROUP", "DEPBAR", "MEMBAR", "FENCE", "SYNCS", "ARRIVES", "WARPSYNC", "ERRBAR"}
_OTHER = {"BRA", "BSSY", "BSYNC", "NOP", "EXIT", "RET", "CALL", "JMP", "BREAK", "YIELD", "WARPGROUP_SYNC"}


def classify(opcode):
    """The class of a SASS opcode (its name before the first dot; uniform-datapath `U` ops by their base).

    >>> classify("FFMA"), classify("MUFU"), classify("ULDC"), classify("ISETP"), classify("HGMMA")
    ('float', 'mufu', 'memory', 'integer', 'mma')
    """
    if opcode == "MUFU":
        return "mufu"
    for name in (opcode, opcode[1:] if opcode.startswith("U") else opcode):
        for group, members in (("float", _FLOAT), ("mma", _MMA), ("memory", _MEMORY),
                               ("barrier", _BARRIER), ("other", _OTHER)):
            if name in members:
                return group
    return "integer"


def count(sass):
    """Lane instructions by class: `{"base", "preamble", "per_target"}` -> `Counter` (see the module doc)."""
    instructions = parse_sass(sass)
    outer, nested, region = loop_regions(instructions)
    parts = {name: collections.Counter() for name in ("base", "preamble", "per_target")}
    for address, op, _ in instructions:
        if not outer[0] <= address <= outer[1]:
            continue
        if nested and nested[0] <= address <= nested[1]:
            part = "per_target"
        elif region and region[0] <= address <= region[1]:
            part = "preamble"
        else:
            part = "base"
        parts[part][classify(op)] += 1
    return parts


def positive_fraction(block_m, block_n, vocab, targets):
    """The expected fraction of tiles holding a positive, ids uniform.

    >>> round(positive_fraction(128, 64, 876_000, 8), 3)
    0.072
    """
    return 1.0 - (1.0 - block_n / vocab) ** (block_m * targets)


def per_logit(parts, block_m, block_n, warps, targets, fraction):
    """Lane instructions per logit by class (and "total") at `targets` ids per row."""
    lanes = 32 * warps / (block_m * block_n)
    out = {}
    for name in CLASSES:
        tile = parts["base"][name] + fraction * (parts["preamble"][name]
                                                   + targets * parts["per_target"][name])
        out[name] = tile * lanes if targets else parts["base"][name] * lanes
    out["total"] = sum(out[name] for name in CLASSES)
    return out


def floors(kernels, arch, dtype, rows, dim, vocab, precision="tf32"):
    """The step's floors (ms) of `kernels` (the rows and columns reports, with `per_logit`).

    Full fp32 (`precision="ieee"`): the `mma_ms` column is the FMA units' fp32 peak instead.
    """
    _, sms, ghz, bf16, tf32, fp32, hbm = GPUS[arch]
    logits = rows * vocab
    issue = sum(k["per_logit"]["total"] for k in kernels) / 32
    mufu = sum(k["per_logit"]["mufu"] for k in kernels)
    products = 2 + sum(2 if k["split_dot"] else 1 for k in kernels)  # the logits', the gradients'
    peak = bf16 if dtype != "float32" else (fp32 if precision == "ieee" else tf32)
    size = 2 if dtype != "float32" else 4
    rows_report, columns_report = kernels
    traffic = (-(-rows // rows_report["block_m"]) * vocab * dim
               + -(-vocab // columns_report["block_n"]) * rows * dim) * size
    return dict(issue_ms=1e3 * logits * issue / (4 * sms * ghz * 1e9),
                mufu_ms=1e3 * logits * mufu / (16 * sms * ghz * 1e9),
                mma_ms=1e3 * 2.0 * logits * dim * products / (peak * 1e12),
                hbm_ms=1e3 * traffic / (hbm * 1e12))


# dtype name -> (operands, the stored gradients' dtypes (hidden, table), its label; `{precision}`: fp32's
# products): "bfloat16" is Keras's `mixed_bfloat16` (bf16 hidden states, a float32 table),
# "bfloat16-table" a bf16 table too.
# A gradient stored in the operands' dtype skips the hi/lo split (`config.split_dot`).
VARIANTS = {
    "bfloat16": ("bfloat16", ("bfloat16", "float32"), "bfloat16"),
    "bfloat16-table": ("bfloat16", ("bfloat16", "bfloat16"), "bfloat16 (bf16 table)"),
    "float32": ("float32", ("float32", "float32"), "float32 ({precision})"),
}


def measure(arch=90, dtypes=("bfloat16", "bfloat16-table", "float32"), targets=(8, 1), shape=SHAPE,
            family="bce", precision="tf32"):
    """One row per (dtype, L, kernel) and one "step" row with the floors (dtypes: `VARIANTS`' keys;
    `precision`: fp32's products)."""
    rows, dim, vocab = shape
    table = []
    for name in dtypes:
        dtype, stored, label = VARIANTS[name]
        label = label.format(precision=precision.upper())
        reports = {}
        for kernel, gradient in zip(("rows", "columns"), stored):
            report = compile_kernel(kernel, arch, dim, dtype, precision=precision, family=family,
                                    keep_cubin=True, stored=gradient)
            report["parts"] = count(disassemble(report.pop("cubin")))
            reports[kernel] = report
        for number in targets:
            pair = []
            for kernel, report in reports.items():
                fraction = (positive_fraction(report["block_m"], report["block_n"], vocab, number)
                            if report["skips_empty_tiles"] else 1.0)
                values = per_logit(report["parts"], report["block_m"], report["block_n"],
                                   report["num_warps"], number, fraction)
                pair.append(dict(report, per_logit=values, targets=number, fraction=fraction))
            step = floors(pair, arch, dtype, rows, dim, vocab, precision)
            for row in pair:
                table.append(_row(row, label))
            table.append(dict(_row(dict(pair[0], kernel="step"), label, pair), **step))
    return table


def _row(report, label, pair=None):
    values = ({name: sum(r["per_logit"][name] for r in pair) for name in (*CLASSES, "total")}
              if pair else report["per_logit"])
    return dict(arch=report["arch"], dtype=label,
                L=report["targets"], kernel=report["kernel"],
                tile=f"{report['block_m']}x{report['block_n']}/{report['num_warps']}w",
                fraction=round(report["fraction"], 3) if not pair else "",
                registers=report["registers"] if not pair else "",
                spill_bytes=report["spill_bytes"] if not pair else "",
                **{name: round(v, 1) for name, v in values.items()})


def markdown_table(rows, columns):
    """A markdown table of `rows` (dicts) restricted to `columns`."""
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                     + ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows])


def markdown(table, label, family="bce"):
    columns = ["arch", "dtype", "L", "kernel", "tile", "fraction", "registers", "spill_bytes",
               *CLASSES, "total", "issue_ms", "mufu_ms", "mma_ms", "hbm_ms"]
    return (f"SASS lane instructions per logit by class of the fused Triton kernels' tile loops "
            f"({label}; Triton 3.7.1 + ptxas deviceless, nothing ran), {family.upper()} at (M, D, V) = "
            f"{SHAPE}; fraction: the tiles that run the positives' loop (1: every tile; else the "
            f"expected fraction for uniform ids). The floors (ms) of one training step (both "
            f"kernels) on an H200 SXM (sm_90, 132 SMs, 1.98 GHz): issue at 4 warp instructions "
            f"a clock an SM, MUFU at 16 lanes a clock an SM, MMA at the dense tensor-core peak "
            f"(full fp32: the FMA units' 67 TFLOPS), "
            f"HBM at 4.8 TB/s: estimates, see tools/triton_sass.py.\n\n"
            + markdown_table(table, columns) + "\n")


def compare_markdown(before, after):
    index = {(r["dtype"], r["L"], r["kernel"]): r for r in before["rows"]}
    rows = []
    for r in after["rows"]:
        old = index.get((r["dtype"], r["L"], r["kernel"]))
        if old:
            rows.append(dict(dtype=r["dtype"], L=r["L"], kernel=r["kernel"], before=old["total"],
                             after=r["total"],
                             issue_ms=f"{old['issue_ms']:.1f} -> {r['issue_ms']:.1f}"
                             if r["kernel"] == "step" else ""))
    return (f"Lane instructions per logit, before ({before['label']}) -> after ({after['label']}); "
            f"step: both kernels, with the issue floor (ms) at {SHAPE} on sm_90.\n\n"
            + markdown_table(rows, ["dtype", "L", "kernel", "before", "after", "issue_ms"]) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtypes", default="bfloat16,bfloat16-table,float32", help="`VARIANTS` keys")
    parser.add_argument("--ids", default="8,1")
    parser.add_argument("--precision", default="tf32", choices=("tf32", "ieee"), help="fp32 products'")
    parser.add_argument("--family", default="bce", choices=("bce", "softmax"))
    parser.add_argument("--json", default=os.path.join(RESULTS, "cutbce_triton_sass.json"))
    parser.add_argument("--label", default=None, help="what the table names the code")
    parser.add_argument("--compare", default=None, metavar="BEFORE_JSON")
    args = parser.parse_args(argv)
    label = args.label or subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip()
    table = measure(args.arch, tuple(args.dtypes.split(",")), tuple(map(int, args.ids.split(","))),
                    family=args.family, precision=args.precision)
    payload = {"label": label, "rows": table}
    with open(args.json, "w") as f:
        json.dump(payload, f, indent=1)
    text = f"Command: `python tools/triton_sass.py {shlex.join(argv or sys.argv[1:])}`\n\n"
    text += markdown(table, label, args.family)
    if args.compare:
        with open(args.compare) as f:
            text += "\n" + compare_markdown(json.load(f), payload)
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
