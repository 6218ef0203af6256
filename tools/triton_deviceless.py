"""Compile the fused kernels for a GPU that is not there, and read what the CUDA compiler says.

`compile_kernel(kernel, arch, dim, dtype, ...)` runs Triton's compiler
(`triton.compile` of an `ASTSource`, target `GPUTarget("cuda", arch, 32)`)
to PTX and a cubin, then the `ptxas` that Triton ships (under
`triton/backends/nvidia/bin`) with `-v` for registers and spills (the
compiled kernel's metadata leaves them empty until it is loaded on a GPU),
and `cuobjdump -sass` for the instruction count of the tile loop (the
longest backward branch). `metadata.shared` is the shared memory the
launch asks for. Nothing needs a GPU or a CUDA driver.

Example (a few seconds; needs Triton):

```python
report = compile_kernel("rows", arch=90, dim=64, dtype="bfloat16")
print(report["registers"], report["spill_bytes"], report["shared_bytes"])
```
"""

import os
import re
import subprocess
import tempfile

from keras_cutbce.backends.torch.triton import config

__all__ = ["GPUS", "KERNEL_VARIANTS", "compile_kernel", "disassemble", "loop_regions", "parse_sass", "ptxas",
           "tool"]

# (SMs, boost clock GHz, dense bf16 / tf32 / fp32 TFLOP/s, HBM TB/s) of the GPU each arch stands for.
GPUS = {80: ("A100 SXM", 108, 1.41, 312.0, 156.0, 19.5, 2.0),
        86: ("A10", 72, 1.695, 125.0, 62.5, 31.2, 0.6),
        89: ("L40S", 142, 2.52, 362.0, 183.0, 91.6, 0.864),
        90: ("H200 SXM", 132, 1.98, 989.0, 494.0, 67.0, 4.8),
        100: ("B200", 148, 1.965, 2250.0, 1100.0, 80.0, 8.0)}

# The heaviest variant of each kernel (the others compute a subset of it).
KERNEL_VARIANTS = {
    "rows": dict(LOSS=True, GRAD_H=True),
    "columns": dict(GRAD_E=True, GRAD_B=True),
}
_POINTERS = {
    "rows": ("hidden_ptr", "table_ptr", "bias_ptr", "positives_ptr", "tile_flags_ptr",
             "softplus_parts_ptr", "grad_h_parts_ptr"),
    "columns": ("hidden_ptr", "table_ptr", "bias_ptr", "positives_ptr", "tile_flags_ptr",
                "row_scale_ptr", "grad_table_ptr", "grad_bias_ptr"),
}
_SCALARS = {
    "rows": ("num_rows", "vocab_size", "dim", "num_targets", "tiles_per_split"),
    "columns": ("num_rows", "vocab_size", "dim", "num_targets"),
}
_TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def tool(name):
    """Returns the path of a CUDA tool Triton ships (`ptxas`, `cuobjdump`).

    Example:

    >>> tool("ptxas").endswith("ptxas")
    True
    """
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas(arch):
    """The `ptxas` Triton runs for `arch`: its `ptxas-blackwell` (a newer CUDA) from sm_100 on, where shipped."""
    blackwell = tool("ptxas-blackwell")
    return blackwell if arch >= 100 and os.path.exists(blackwell) else tool("ptxas")


def _signature(kernel, dtype):
    operand = _TRITON_TYPES[dtype]
    types = {"hidden_ptr": f"*{operand}", "table_ptr": f"*{operand}", "positives_ptr": "*i32",
             "tile_flags_ptr": "*i8"}
    signature = {name: types.get(name, "*fp32") for name in _POINTERS[kernel]}
    signature.update({name: "i32" for name in _SCALARS[kernel]})
    return signature


def _ptxas_resources(ptx, arch):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        proc = subprocess.run(
            [ptxas(arch), "-v", f"--gpu-name={gpu}", path, "-o", os.path.join(folder, "k.cubin")],
            capture_output=True, text=True, check=True,
        )
    text = proc.stdout + proc.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return registers, int(spills.group(1)) if spills else 0


def disassemble(cubin):
    """Returns the `cuobjdump -sass` text of a cubin."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout


# One SASS instruction of `cuobjdump -sass`: address, optional predicate, opcode, modifiers, operands.
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[^ ]*)?\s*([^;]*);")


def parse_sass(sass):
    """`[(address, opcode, operands)]` of `cuobjdump -sass` text."""
    return [(int(a, 16), op, rest) for a, op, _, rest in _LINE.findall(sass)]


def _branch_target(op, operands):
    target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
    return int(target.group(1), 16) if target else None


def loop_regions(instructions):
    """`(tile loop, nested loop, skipped region)` address ranges `[first, last]` (None where absent).

    The tile loop is the longest backward branch; the nested loop the longest backward branch inside it;
    the skipped region the largest one a forward branch of the tile loop jumps over around the nested loop.
    """
    loops = [(target, address) for address, op, rest in instructions
             if (target := _branch_target(op, rest)) is not None and target < address]
    if not loops:
        return None, None, None
    outer = max(loops, key=lambda span: span[1] - span[0])
    inner = [s for s in loops if outer[0] <= s[0] and s[1] < outer[1] and s != outer]
    if not inner:
        return outer, None, None
    nested = max(inner, key=lambda span: span[1] - span[0])
    region = None
    for address, op, rest in instructions:
        target = _branch_target(op, rest)
        if target is None or not outer[0] <= address < nested[0]:
            continue
        if nested[1] < target <= outer[1] + 16 and (region is None or address < region[0]):
            region = (address + 16, target - 16)
    return outer, nested, region


def _loop_instructions(cubin):
    """Returns the SASS instructions of the tile loop (`loop_regions`) and of the kernel."""
    instructions = parse_sass(disassemble(cubin))
    outer = loop_regions(instructions)[0]
    return (0 if outer is None else (outer[1] - outer[0]) // 16 + 1), len(instructions)


def compile_kernel(kernel, arch, dim, dtype, block=None, precision="tf32", has_bias=True, family="bce",
                   keep_cubin=False, stored="float32"):
    """Compiles one kernel for `sm_<arch>` and returns what the compiler reports.

    Args:
        kernel: `"rows"` or `"columns"` (its heaviest variant, `KERNEL_VARIANTS`).
        arch: compute capability as an int (80, 90).
        dim: the feature width D.
        dtype: operand dtype name (`"float32"`, `"bfloat16"`, `"float16"`).
        block: `(BLOCK_M, BLOCK_N, num_warps, num_stages)`; None: the static table's.
        precision: `tl.dot` input precision of fp32 operands.
        has_bias: compile the bias variant.
        family: the loss family (`"bce"` or `"softmax"`).
        keep_cubin: also return the `cubin` (bytes).
        stored: the dtype the kernel's gradient is stored in (its hi/lo split, `config.split_dot`).

    Returns:
        A dict: the settings, `registers`, `spill_bytes`, `shared_bytes`,
        `loop_instructions` (SASS of the tile loop, per thread), `instructions`
        (the whole kernel), `instructions_per_logit` (warp instructions of
        one tile loop iteration per logit of the tile) and `skips_empty_tiles`
        (whether the kernel skips the positives' loop in tiles without one).
    """
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from keras_cutbce.backends.torch.triton import kernels

    if block is None:
        settings = config.choose(dim, getattr(torch, dtype), interpret=False, arch=arch,
                                 precision=precision, family=family)
        block = settings.rows_block if kernel == "rows" else settings.columns_block
    block_m, block_n, warps, stages = block
    constants = dict(
        HAS_BIAS=has_bias, RESCALE=dtype == "float16",
        SPLIT_DOT=config.split_dot(getattr(torch, dtype), getattr(torch, stored)),
        INTERPRET=False, PRECISION=precision,
        K_INTERLEAVED=config.k_interleaved(dim, getattr(torch, dtype), arch, precision),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=config.block_dim(dim), **KERNEL_VARIANTS[kernel],
        FAMILY=family,
    )
    signature = _signature(kernel, dtype)
    if kernel == "columns":  # softmax's row log-sum-exp
        if family == "softmax":
            signature["lse_ptr"] = "*fp32"
        else:
            constants["lse_ptr"] = None
    signature.update({name: "constexpr" for name in constants})
    fn = kernels.rows_kernel if kernel == "rows" else kernels.columns_kernel
    # As a launch specializes them: 16-byte aligned tensors (torch's allocations), and `dim` when a
    # multiple of 16.
    aligned = [name for name, kind in signature.items()
               if kind.startswith("*") or (name == "dim" and dim % 16 == 0)]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    registers, spills = _ptxas_resources(compiled.asm["ptx"], arch)
    loop, total = _loop_instructions(compiled.asm["cubin"])
    report = dict(
        kernel=kernel, family=family, arch=arch, dim=dim, dtype=dtype, block_m=block_m, block_n=block_n,
        num_warps=warps, num_stages=stages, registers=registers, spill_bytes=spills,
        shared_bytes=int(compiled.metadata.shared), loop_instructions=loop, instructions=total,
        instructions_per_logit=loop * warps / (block_m * block_n),
        skips_empty_tiles="tile_flags_ptr" in fn.arg_names, split_dot=constants["SPLIT_DOT"],
    )
    if keep_cubin:
        report["cubin"] = compiled.asm["cubin"]
    return report
