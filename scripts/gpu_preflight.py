"""The GPU check's first step: stop at once, naming the package and why, if this Python cannot run it.

`scripts/gpu_check.sh` runs this before anything else (a few seconds). It checks, in order:

1. Python and the minimum version of each package the check imports (`MINIMUMS`: the version and
   the reason); a missing or older one ends the check with one line per problem;
2. that torch, Keras, `keras_cutbce` and `keras_erase` import (one line naming the first that does not,
   not a traceback; with `--installed`: from the installed wheel, not the checkout, at the checkout's
   version) and print where every package came from;
3. unless `--dry-run`: that torch sees a CUDA device and that Triton compiles and runs a kernel
   on it (the driver, `ptxas` and the launcher, before any test needs them).

Usage: `python scripts/gpu_preflight.py [--dry-run] [--installed VERSION]`; exit 0 when the check
can run, 1 otherwise.
"""

import argparse
import importlib
import importlib.metadata
import os
import re
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

# distribution -> (minimum version, why). torch and keras are the lower bounds of pyproject.toml
# (tests/test_gpu_check.py checks they agree); Triton comes with torch's CUDA wheels.
MINIMUMS = {
    "keras": ("3.15", "keras_erase/_keras_private.py and the loss glue are checked against Keras 3.15"),
    "torch": ("2.11", "the oldest torch the project is tested on (the GPU machine's 2.11.0; CI runs "
                      "2.13.0); the ERASE step, CUDA Graphs and the profiler trace use nothing newer"),
    "triton": ("3.6", "the fused CutBCE kernels are compiled for sm_90 and compared under Triton 3.6.0 "
                      "and 3.7.1 (docs/cutbce.md); older releases are untested"),
}
PYTHON = (3, 11)  # pyproject.toml's requires-python
REPORTED = ("keras", "torch", "triton", "numpy", "jax", "namex", "optree", "keras-cutbce-erase")


def version_tuple(text):
    """`"2.11.0+cu130"` -> `(2, 11, 0)`: the leading release numbers (a local tag or suffix dropped)."""
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def installed_version(name):
    """The installed distribution's version, or `None`."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problems(versions, python=sys.version_info[:2], dry_run=False):
    """One line per requirement `versions` (name -> version or None) does not meet; [] if none.

    A dry run needs no Triton (the check then skips its CutBCE part), but not an old one.
    """
    problems = []
    if tuple(python) < PYTHON:
        problems.append(f"Python {'.'.join(map(str, PYTHON))} or newer is needed "
                        f"(pyproject.toml's requires-python); this is {'.'.join(map(str, python))}")
    for name, (minimum, why) in MINIMUMS.items():
        found = versions.get(name)
        if found is None and not (dry_run and name == "triton"):
            problems.append(f"{name} >= {minimum} is needed and not installed: {why}")
        elif found is not None and version_tuple(found) < version_tuple(minimum):
            problems.append(f"{name} >= {minimum} is needed, {found} is installed: {why}")
    return problems


def import_problems(modules=("torch", "keras", "keras_cutbce", "keras_erase")):
    """A line naming the first of `modules` that does not import (e.g. torch against the wrong CUDA),
    and its error's last line; [] if all import. The later ones import the earlier, so one line is all."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - the message is the answer
            last = str(error).strip().splitlines()[-1:] or [""]
            return [f"{module} does not import: {type(error).__name__}: {last[0]}"]
    return []


def _origin(module):
    path = getattr(importlib.import_module(module), "__file__", None) or "?"
    return os.path.dirname(path)


def _triton_runs():
    """Compiles and runs a one-line Triton kernel on the GPU; returns the compile target."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def twice(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0, mask=mask)

    x = torch.arange(5, device="cuda", dtype=torch.float32)
    twice[(1,)](x, 5, BLOCK=8)
    torch.cuda.synchronize()
    if x.tolist() != [0.0, 2.0, 4.0, 6.0, 8.0]:
        raise RuntimeError(f"a Triton kernel computed {x.tolist()}")
    return triton.runtime.driver.active.get_current_target()


def interpreter_problem():
    """Why Triton's interpreter cannot run the CutBCE kernels here (`None` if it can).

    It runs a kernel that loops over bounds made from `tl.program_id`, as the kernels do.
    Triton 3.6's interpreter converts such a bound with `int()` of a one-element array,
    which NumPy >= 2.4 refuses (TypeError; 2.3 runs it); Triton 3.7 does not. Only a dry run uses the
    interpreter; a GPU runs the compiled kernels.
    """
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported
    import numpy
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def count(x_ptr, n):
        start = tl.program_id(0) * n
        for i in range(start, start + n):
            tl.store(x_ptr + i, i * 1.0)

    x = torch.zeros(4)
    try:
        count[(2,)](x, 2)
    except Exception as error:  # noqa: BLE001 - the message is the answer
        return (f"Triton {triton.__version__}'s interpreter fails with NumPy {numpy.__version__}: "
                f"{type(error).__name__}: {error}")
    return None if x.tolist() == [0.0, 1.0, 2.0, 3.0] else f"it computed {x.tolist()}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: skip the CUDA checks")
    parser.add_argument("--installed", metavar="VERSION",
                        help="keras_cutbce must come from an installed wheel of this version")
    parser.add_argument("--triton-interpreter", action="store_true",
                        help="only say whether Triton's interpreter runs the kernels here")
    args = parser.parse_args(argv)
    if args.triton_interpreter:
        problem = interpreter_problem()
        print(f"gpu_preflight: Triton's interpreter: {problem or 'runs the kernels'}")
        return 1 if problem else 0
    versions = {name: installed_version(name) for name in REPORTED}
    print(f"gpu_preflight: Python {sys.version.split()[0]} at {sys.executable}")
    problems = version_problems(versions, dry_run=args.dry_run) or import_problems()
    if problems:
        for line in problems:
            print(f"gpu_preflight: STOP: {line}", file=sys.stderr)
        return 1
    for name, module in (("keras", "keras"), ("torch", "torch"), ("triton", "triton"),
                         ("numpy", "numpy"), ("keras-cutbce-erase", "keras_cutbce")):
        if versions[name] is not None:
            print(f"gpu_preflight: {name} {versions[name]} from {_origin(module)}")
    for name in ("jax", "namex", "optree"):
        print(f"gpu_preflight: {name} {versions[name] or '(not installed)'}")
    if args.installed:
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        origin = _origin("keras_cutbce")
        if origin.startswith(checkout + os.sep) or versions["keras-cutbce-erase"] != args.installed:
            print(f"gpu_preflight: STOP: keras_cutbce {versions['keras-cutbce-erase']} imports from "
                  f"{origin}, not from an installed wheel of version {args.installed}",
                  file=sys.stderr)
            return 1
    if args.dry_run:
        print("gpu_preflight: dry run: no CUDA check")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_preflight: STOP: torch sees no CUDA device (scripts/gpu_check.sh --dry-run runs "
              "on CPU)", file=sys.stderr)
        return 1
    print(f"gpu_preflight: {torch.cuda.get_device_name(0)}, capability "
          f"{torch.cuda.get_device_capability(0)}, CUDA {torch.version.cuda}")
    try:
        target = _triton_runs()
    except Exception as error:  # noqa: BLE001 - the message is the result
        print(f"gpu_preflight: STOP: Triton cannot compile and run a kernel here: "
              f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"gpu_preflight: Triton compiles and runs kernels for {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
