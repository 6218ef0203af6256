"""CutBCE's fused Triton kernels on a CUDA GPU: the GPU check's sections (`SECTIONS`, run by `cutbce_triton.py
--gpu`; docs/gpu.md says what each measures). Both families (`FAMILIES`), per `VARIANTS`; a section is skipped
when its estimate does not fit the budget left, listed as an error when it raises (`common.Budget`).
`--cpu-dry-run`: tiny CPU shapes in the Triton interpreter (fp32 at IEEE only): it checks the code.
"""

import contextlib
import functools
import inspect
import itertools
import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")  # (cutbce_triton.py imports this: the repository is on the path)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import Budget, alternate, cuda_clock, cuda_sync, paired, release_memory  # noqa: E402
from keras_cutbce import CutBCELoss, CutSoftmaxLoss  # noqa: E402
from keras_cutbce import cut_binary_crossentropy, cut_categorical_crossentropy  # noqa: E402
from keras_cutbce.backends.torch.triton import config  # noqa: E402
from keras_cutbce.math import reference  # noqa: E402
from keras_cutbce.math.tiling import default_tile  # noqa: E402
from tools import nsight_compute  # noqa: E402

# variant -> (operand dtype, torch's fp32 matmul precision)
VARIANTS = {"bf16": ("bfloat16", "highest"), "tf32": ("float32", "high"),
            "ieee": ("float32", "highest")}
SMALL, PAPER = (4096, 64, 100_000), (16384, 64, 876_000)
TARGETS = (1, 8, 40)
REPEATS = 5
FAMILIES = ("bce", "softmax")
# max |got - float64| / max |float64| per variant (loss and each gradient); above both this and
# twice the dense implementation's own error under the variant: an error.
PARITY_LIMITS = {"ieee": 1e-5, "tf32": 2e-2, "bf16": 2e-2}
# (rows block, columns block) tile candidates of the sweep, after the family's static table's tiles.
SWEEP = (((128, 64, 8, 2), (128, 64, 8, 2)), ((64, 64, 4, 2), (64, 64, 4, 2)),
         ((128, 128, 8, 2), (128, 128, 8, 2)), ((64, 128, 4, 2), (128, 64, 4, 2)))
# full fp32: the table's tiles, and the rows tile Triton 3.6 compiles without spilling (docs/benchmarks.md)
SWEEP_IEEE = (SWEEP[0], ((64, 64, 8, 2), (128, 64, 8, 2)))
FAMILY_OPS = {"bce": cut_binary_crossentropy, "softmax": cut_categorical_crossentropy}
DRY_RUN = dict(small=(48, 16, 200), paper=(64, 16, 400), parity=(40, 16, 203),
               variants=("ieee",), targets=(1, 8), repeats=2, families=FAMILIES)


class Run(Budget):
    """Where the sections run (`device`), their sizes, the budget and what they found (`report`)."""

    def __init__(self, budget, dry_run=False):
        super().__init__(budget, release=lambda: release_memory(not dry_run))
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        sizes = DRY_RUN if dry_run else dict(small=SMALL, paper=PAPER, parity=(1000, 64, 5003),
                                             variants=tuple(VARIANTS), targets=TARGETS,
                                             repeats=REPEATS, families=FAMILIES)
        self.__dict__.update(sizes)
        self.ours = ("chunked",) if dry_run else ("triton", "chunked")  # the interpreter's fp16/bf16 are not a GPU's
        self.reserved = 0.0  # seconds the sections after the running one are left (`measure`)
        self.peer_errors = {}  # (family, variant) -> implementation -> its error against float64

    def sync(self):
        cuda_sync(self.device == "cuda")

    def spent(self, label, seconds):
        """Whether `seconds` and the later sections' reserve no longer fit (then `label` is listed as skipped)."""
        if self.left() >= seconds + self.reserved:
            return False
        self.report["skipped"].append(f"{label}: budget spent")
        return True


@contextlib.contextmanager
def precision(variant):
    """torch's fp32 matmul precision of `variant` (what the kernels' `tl.dot` follows)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(VARIANTS[variant][1])
    try:
        yield getattr(torch, VARIANTS[variant][0])
    finally:
        torch.set_float32_matmul_precision(before)


def problem(run, shape, dtype, targets=8, seed=0, logit_range=None):
    """`(hidden, table, bias, ids)` on the run's device; `logit_range` spreads |z| up to it."""
    rows, dim, vocab = shape
    gen = torch.Generator(device=run.device).manual_seed(seed)
    kw = dict(device=run.device, generator=gen)
    h = torch.randn(rows, dim, **kw) * 0.3
    e = torch.randn(vocab, dim, **kw) * 0.3
    b = torch.randn(vocab, **kw) * 0.1
    if logit_range is not None:  # row i's largest |z| about logit_range * (i + 1) / rows
        reach = torch.linspace(1.0 / rows, 1.0, rows, device=run.device) * logit_range
        h = h * (reach / (h @ e.T).abs().amax(dim=1))[:, None]
    ids = torch.randint(0, vocab, (rows, targets), device=run.device, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (h, e, b)] + [ids]


def step(implementation, h, e, b, ids, family="bce"):
    """One training step of `family`'s loss: the mean loss and its gradients (into `.grad`)."""
    for x in (h, e, b):
        x.grad = None
    if implementation == "dense":
        y, z = reference.multi_hot(ids, e.shape[0]), reference.logits(h, e, b)
        if family == "softmax":
            loss = keras.losses.categorical_crossentropy(y / y.sum(-1, keepdim=True), z, from_logits=True)
        else:
            loss = keras.losses.binary_crossentropy(y, z, from_logits=True)
    else:
        loss = FAMILY_OPS[family](h, e, ids, b, implementation=implementation)
    loss.mean().backward()
    return loss.detach()


def float64_reference(h, e, b, ids, family="bce"):
    """The contract's per-row loss and its gradients for the mean, in float64 (dense; every id valid)."""
    h64, e64, b64 = (None if x is None else x.detach().double().requires_grad_() for x in (h, e, b))
    z = h64 @ e64.T + (0.0 if b is None else b64)
    hot = torch.zeros_like(z).scatter_(1, ids, 1.0)
    if family == "softmax":
        loss = torch.logsumexp(z, dim=1) - (hot / hot.sum(1, keepdim=True) * z).sum(1)
    else:
        loss = (torch.nn.functional.softplus(z) - hot * z).mean(dim=1)
    loss.mean().backward()
    return loss.detach(), [None if x is None else x.grad for x in (h64, e64, b64)]


def rel_error(got, want):
    """max |got - want| / max |want| (`want` in float64)."""
    return float((got.double() - want).abs().max() / want.abs().max())


def jit_latency(run):
    """The first call's compile time, and whether the first (cold) and second steps give the same bits."""
    rows = []
    for family, variant in itertools.product(run.families, run.variants):
        with precision(variant) as dtype:
            inputs = problem(run, run.small, dtype)
            outputs = []  # round 0 compiles (cold cache), round 1 is the second call
            grads = lambda loss: (run.sync(), outputs.append([loss] + [x.grad for x in inputs[:3]]))  # noqa: E731
            timed = alternate({"triton": functools.partial(step, "triton", *inputs, family=family)}, 1, block=grads)
            times = [1e3 * timed["triton"]["first_s"], 1e3 * timed["triton"]["times_s"][0]]
        rows.append(dict(family=family, variant=variant, first_call_ms=times[0], second_call_ms=times[1],
                         jit_ms=times[0] - times[1], same_bits=all(map(torch.equal, *outputs))))
    return rows


ERRORS = ("loss_rel", "grad_h_rel", "grad_table_rel", "grad_bias_rel")


def parity(run):
    """Loss and gradients of dense, chunked and triton against float64, |z| up to 80, against their limits."""
    rows = []
    for family, variant in itertools.product(run.families, run.variants):
        with precision(variant) as dtype:
            inputs = problem(run, run.parity, dtype, logit_range=80.0)
            h, e, b, ids = inputs
            z_max = float((h.float() @ e.float().T + b.float()).abs().max())
            want, grads = float64_reference(*inputs, family=family)
            found = {}
            for implementation in ("dense", "chunked", "triton"):
                got = step(implementation, *inputs, family=family)
                errors = [rel_error(got, want)] + [rel_error(x.grad, g) for x, g in zip((h, e, b), grads)]
                found[implementation] = dict(zip(ERRORS, errors))
            # each error's limit: the variant's, or twice the dense model's own under the variant
            limits = {k: max(PARITY_LIMITS[variant], 2 * found["dense"][k]) for k in ERRORS}
            for implementation, errors in found.items():
                rows.append(dict(family=family, variant=variant, implementation=implementation, z_max=z_max,
                                 **errors, worst_over_limit=max(errors[k] / limits[k] for k in ERRORS),
                                 within_limit=all(errors[k] <= limits[k] for k in ERRORS)))
    bad = [r for r in rows if not r["within_limit"] and r["implementation"] != "dense"]
    if bad:
        run.report["errors"].append(
            "parity: " + "; ".join(f"{r['family']} {r['variant']} {r['implementation']}: "
                                   f"{r['worst_over_limit']:.2f}x its limit" for r in bad))
    return rows


def kernel_times_ms(run, inputs, family):
    """Device time of each Triton kernel in one triton step (`None` without CUDA)."""
    if run.device != "cuda":
        return {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step("triton", *inputs, family=family)
        run.sync()
    times = {}
    for event in prof.key_averages():
        for kernel in ("rows_kernel", "columns_kernel"):
            if kernel in event.key:
                total = getattr(event, "device_time_total", None)
                if total is None:
                    total = event.cuda_time_total
                times[f"{kernel}_ms"] = times.get(f"{kernel}_ms", 0.0) + total / 1e3
    return times


def warm_up(run, calls, catch=False):
    """Each call once, alone (it compiles): name -> its peak MiB (`peak_mib`, None off CUDA), or with `catch`
    the error of one that raised (`note`: out of memory, a peer refusing)."""
    found = {}
    for name, call in calls.items():
        try:
            if run.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            call()
            run.sync()
            found[name] = dict(peak_mib=torch.cuda.max_memory_allocated() / 2**20 if run.device == "cuda" else None)
        except Exception as error:  # noqa: BLE001 - listed in the row
            if not catch:
                raise
            found[name] = dict(note=f"{type(error).__name__}: {str(error)[:160]}")
            run.release()
    return found


def timed(run, names, inputs, repeats, family="bce"):
    """Median step ms and peak MiB of each implementation, alternating (`common.alternate`)."""
    cells = {n: functools.partial(step, n, *inputs, family=family) for n in names}
    peaks = warm_up(run, cells)
    times = alternate(cells, repeats, block=lambda _: run.sync(), warmups=0)
    return {n: dict(median_ms=1e3 * t["wall"]["median"], min_ms=1e3 * t["wall"]["min"], **peaks[n])
            for n, t in times.items()}


def timings(run):
    rows = []
    # L = 8 first (the small shape, then the paper's), each family in turn; then the other L
    by_l = sorted(run.targets, key=lambda t: (t != 8, t))
    order = [(shape, t, family) for t in by_l for shape in (run.small, run.paper)
             for family in run.families]
    for shape, targets, family in order:
        repeats = run.repeats if shape == run.small else max(2, run.repeats - 2)
        if run.spent(f"timings {family} {shape} L={targets}", 4):
            continue
        for variant in run.variants:
            with precision(variant) as dtype:
                inputs = problem(run, shape, dtype, targets=targets)
                free = torch.cuda.mem_get_info()[0] if run.device == "cuda" else 2**30
                dense_fits = 4 * shape[0] * shape[2] * 4 < 0.8 * free
                names = (["dense"] if dense_fits else []) + ["chunked", "triton"]
                measured = timed(run, names, inputs, repeats, family)
                kernels = kernel_times_ms(run, inputs, family)
            for name, m in measured.items():
                rows.append(dict(family=family, rows=shape[0], dim=shape[1], vocab=shape[2],
                                 targets=targets, variant=variant, implementation=name,
                                 repeats=repeats, **m, **(kernels if name == "triton" else {})))
            del inputs
            run.release()
    return rows


# -- `peers`: what a user would run instead, side by side ------------------------------------------------
PEER_REPEATS = 10  # timed rounds after 2 warm-ups (the peak memory pass, then one untimed round)
WIDE = (8192, 256, 1_000_000)  # a wide recommendation table: last, where the budget allows
PEERS_MIN_S = 20  # its first cell; the rest run while the budget lasts
_COMPILED = {}  # family -> its torch.compile'd dense step (one per process: shapes re-specialise)


def _dense_loss(h, e, b, ids, softmax):
    """The tuned dense step: bf16/TF32 logits by `F.linear`, targets `scatter_`ed into `[M, V]` (never `[M, L, V]`)."""
    z = F.linear(h, e, b)
    if softmax and ids.shape[1] == 1:
        return F.cross_entropy(z, ids[:, 0])
    y = torch.zeros_like(z).scatter_(1, ids, 1.0)
    if softmax:  # soft targets over the distinct ids
        return F.cross_entropy(z, y / y.sum(1, keepdim=True))
    return F.binary_cross_entropy_with_logits(z, y)


def _liger_chunk_mem_const(rows, dim, vocab, chunk_rows=2048):
    """Liger's `chunk_mem_const` for chunks of about `chunk_rows` rows, at most 2**30 logits (its default sizes
    a chunk's logits like its input, `BT H` elements: at D = 64 a chunk is a few rows)."""
    chunk_rows = max(1, min(chunk_rows, 2**30 // vocab))
    return max(1, -(-vocab * chunk_rows // (dim * rows)))


def side_by_side(run, family, shape, dtype, e, b, peers=True):
    """name -> `loss(h, e, b, ids)` (the rows' mean) of each implementation, or a string saying why it does not
    run; peers (softmax, one target, no bias: CCE has none) only with `peers`; dense where `[M, V]` x 3 fits."""
    cuda, softmax = run.device == "cuda", family == "softmax"
    rows, dim, vocab = shape
    free = torch.cuda.mem_get_info()[0] if cuda else 2**34
    # logits, targets and the logits' gradient (bf16 at the paper's shape: 3 x 28.7 GB, an H200's); an
    # allocation past them fails as out of memory, and the row says so
    dense_bytes = 3 * rows * vocab * torch.empty((), dtype=dtype).element_size()
    impls = {}
    if dense_bytes < 0.9 * free:
        impls["dense"] = lambda h, e, b, ids: _dense_loss(h, e, b, ids, softmax)
        if family not in _COMPILED:  # inductor on CUDA; the CPU dry run checks the wrapper only
            _COMPILED[family] = torch.compile(_dense_loss, backend="inductor" if cuda else "aot_eager")
        impls["dense_compiled"] = lambda h, e, b, ids: _COMPILED[family](h, e, b, ids, softmax)
    else:
        impls["dense"] = f"[M, V] x 3 = {dense_bytes / 2**30:.0f} GiB does not fit ({free / 2**30:.0f} GiB free)"
    if peers and softmax:
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except ImportError as error:
            impls["cce_exact"] = f"cut-cross-entropy does not import: {error}"
        else:  # its Triton kernels need CUDA; its torch.compile implementation runs anywhere
            impl = "cce" if cuda else "torch_compile"
            impls["cce_exact"] = lambda h, e, b, ids: cce(h, e, ids[:, 0], impl=impl, filter_eps=None)
            impls["cce_filtered (approximate)"] = (
                (lambda h, e, b, ids: cce(h, e, ids[:, 0], impl="cce")) if cuda
                else "its gradient filter is in its CUDA kernels only")
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger
        except ImportError as error:
            impls["liger"] = f"liger-kernel does not import: {error}"
        else:
            impls["liger"] = lambda h, e, b, ids: liger(h, e, ids[:, 0], bias=b, accum_dtype=torch.float32)
            if "chunk_mem_const" in inspect.signature(liger).parameters:  # `_liger_chunk_mem_const`
                const = _liger_chunk_mem_const(*shape)
                impls["liger_2048_row_chunks"] = lambda h, e, b, ids: liger(
                    h, e, ids[:, 0], bias=b, accum_dtype=torch.float32, chunk_mem_const=const)
        if hasattr(F, "linear_cross_entropy"):
            impls["torch_linear_cross_entropy"] = lambda h, e, b, ids: F.linear_cross_entropy(
                h, e, ids[:, 0], linear_bias=b)
        else:
            impls["torch_linear_cross_entropy"] = f"not in torch {torch.__version__}"
    implementation = "auto" if cuda else "triton"
    impls["ours_op"] = lambda h, e, b, ids: FAMILY_OPS[family](h, e, ids, b, implementation=implementation).mean()
    keras_loss = (CutSoftmaxLoss if softmax else CutBCELoss)(e, b, implementation=implementation)
    impls["ours_keras_loss"] = lambda h, e, b, ids: keras_loss(ids, h)
    return impls


def _train(loss_fn, h, e, b, ids):
    """One step: the loss and its gradients into `.grad`."""
    for x in (h, e, b):
        if x is not None:
            x.grad = None
    loss = loss_fn(h, e, b, ids)
    loss.backward()
    return loss


def _sm_clock_mhz(run):
    """The SM clock now (`nvidia-smi --query-gpu=clocks.sm`), or None."""
    if run.device != "cuda":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _peer_cells(run):
    """(family, shape, variant, peers) in priority order: bf16 with peers first, then ours and dense at TF32/fp32."""
    first, *others = run.variants
    shapes = (run.small,) if run.dry_run else (run.small, run.paper)  # the interpreter is slow
    cells = [(f, s, first, True) for s in shapes for f in ("softmax", "bce")]
    cells += [(f, s, v, False) for v in others for s in shapes for f in ("bce", "softmax")]
    return cells + ([] if run.dry_run else [(f, WIDE, first, True) for f in ("softmax", "bce")])


def peer_errors(run, family, variant, dtype, targets, with_peers):
    """name -> each implementation's largest error (loss, gradients) against float64 at the parity shape, or
    the string saying why it does not run."""
    h, e, b, ids = problem(run, run.parity, dtype, targets=targets)
    b = None if family == "softmax" else b
    want, grads = float64_reference(h, e, b, ids, family)
    exact = [want.mean()] + [g for g in grads if g is not None]
    errors = {}
    for name, fn in side_by_side(run, family, run.parity, dtype, e, b, with_peers).items():
        try:
            got = [_train(fn, h, e, b, ids).detach()] + [x.grad for x in (h, e, b) if x is not None]
            errors[name] = max(rel_error(x, w) for x, w in zip(got, exact))
        except Exception as error:  # noqa: BLE001 - the row says so (a string: it does not run)
            errors[name] = fn if isinstance(fn, str) else f"{type(error).__name__}: {str(error)[:120]}"
    return errors


def peers(run):
    """Each implementation's error against float64 (the parity shape), then step times, side by side."""
    rows = []
    cuda = run.device == "cuda"
    for family, shape, variant, with_peers in _peer_cells(run):
        targets = 1 if family == "softmax" else 8
        if run.spent(f"peers {family} {variant} {shape} L={targets}", 30 if shape[0] * shape[2] > 10**9 else 12):
            continue
        with precision(variant) as dtype:
            if (family, variant) not in run.peer_errors:  # once per family and variant
                run.peer_errors[(family, variant)] = peer_errors(run, family, variant, dtype, targets, with_peers)
            errors = run.peer_errors[(family, variant)]
            h, e, b, ids = problem(run, shape, dtype, targets=targets)
            b = None if family == "softmax" else b
            calls = side_by_side(run, family, shape, dtype, e, b, with_peers)
            found = {name: dict(note=fn) if isinstance(fn, str) else {} for name, fn in calls.items()}
            found.update(warm_up(run, {name: functools.partial(_train, fn, h, e, b, ids)
                                       for name, fn in calls.items() if not isinstance(fn, str)}, catch=True))
            cells = {name: functools.partial(_train, calls[name], h, e, b, ids)
                     for name, entry in found.items() if "peak_mib" in entry}
            clock = [_sm_clock_mhz(run)]
            # cuda_clock's stop waits for its end event: no sync between the call and it
            timed = alternate(cells, max(PEER_REPEATS, run.repeats) if cuda else run.repeats, warmups=1,
                              clock=cuda_clock if cuda else None)
            clock.append(_sm_clock_mhz(run))
        exact_peers = [n for n in timed if not n.startswith("ours") and "approximate" not in n]
        best = min(exact_peers, key=lambda n: timed[n]["wall"]["median"], default=None)
        for name, entry in found.items():
            row = dict(family=family, variant=variant, rows=shape[0], dim=shape[1], vocab=shape[2],
                       targets=targets, implementation=name, best_peer=best, sm_mhz=clock,
                       error_vs_float64=errors.get(name), **entry)
            if name in timed:
                t = timed[name]["wall"]
                row.update(median_ms=1e3 * t["median"], min_ms=1e3 * t["min"], max_ms=1e3 * t["max"],
                           repeats=t["n"])
                if best:
                    ratio = paired(timed, name, best)
                    row.update(vs_best_peer=ratio["median"], vs_best_peer_range=f"{ratio['min']:.3g}-{ratio['max']:.3g}")
            if name == "liger_2048_row_chunks":
                row["note"] = f"chunk_mem_const={_liger_chunk_mem_const(*shape)}"
            rows.append(row)
        del h, e, b, ids, cells, timed
        run.release()
    return rows


CHUNK_TILES = (256, 1024, 4096, 16384, 65536)  # beside the rule's; the dry run's tiny V: (32, 64)


def _chunked_mean(h, e, b, ids, op, chunk_size):
    return op(h, e, ids, b, implementation="chunked", chunk_size=chunk_size).mean()


def chunked_tiles(run):
    """The chunked loop's tile rule on CUDA (`tiling.tile_budget_bytes`) against other tiles and tuned dense."""
    rows, cuda = [], run.device == "cuda"
    for shape, family in itertools.product((run.small, run.paper), run.families):
        with precision(run.variants[0]) as dtype:
            if run.spent(f"chunked_tiles {family} {shape}", 30 if shape == run.paper else 10):
                continue
            h, e, b, ids = problem(run, shape, dtype, targets=1 if family == "softmax" else 8)
            rule = default_tile("torch", "gpu" if cuda else "cpu", shape[0], shape[2], shape[1], family)
            op, cells = FAMILY_OPS[family], {}
            for tile in dict.fromkeys((rule, *((32, 64) if run.dry_run else CHUNK_TILES))):
                if tile < shape[2] or tile == rule:
                    loss = functools.partial(_chunked_mean, op=op, chunk_size=tile)
                    cells[f"chunked {tile}"] = functools.partial(_train, loss, h, e, b, ids)
            dense = side_by_side(run, family, shape, dtype, e, b, peers=False)["dense"]
            if callable(dense):
                cells["dense"] = lambda: _train(dense, h, e, b, ids)
            timed = alternate(cells, run.repeats, warmups=1, clock=cuda_clock if cuda else None)
        for name in timed:
            row = dict(family=family, variant=run.variants[0], rows=shape[0], vocab=shape[2], cell=name,
                       rule=name == f"chunked {rule}", median_ms=1e3 * timed[name]["wall"]["median"])
            if "dense" in timed:
                row["vs_dense"] = paired(timed, name, "dense")["median"]
            rows.append(row)
        del h, e, b, ids, cells, timed
        run.release()
    return rows


def float16_zeros(run):
    shape = run.small
    rows = []
    # the interpreter's half-precision products are not the GPU's
    for family, implementation in itertools.product(run.families, run.ours):
        grads = {}
        for dtype in (torch.float16, torch.float32):
            with precision("ieee"):
                h, e, b, ids = problem(run, shape, dtype)
                step(implementation, h, e, b, ids, family=family)
                grads[dtype] = e.grad.float()
        half, full = grads[torch.float16], grads[torch.float32]
        rows.append(dict(family=family, implementation=implementation, rows=shape[0], vocab=shape[2],
                         zero_fraction_float16=float((half == 0).float().mean()),
                         zero_fraction_float32=float((full == 0).float().mean()),
                         underflow_fraction=float(((half == 0) & (full != 0)).float().mean()),
                         max_abs_float32=float(full.abs().max())))
    return rows


class ItemModel(keras.Model):
    """`hidden = Dense(features)`, with the item table the loss trains (`items`)."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.dense = keras.layers.Dense(dim)
        self.items = keras.layers.Embedding(vocab, dim, name="items")

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.items.build((None,))

    def call(self, x):
        return self.dense(x)


def mixed_bfloat16_fit(run):
    losses_of = {"bce": CutBCELoss, "softmax": CutSoftmaxLoss}
    rows_, dim, vocab = run.small
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows_, dim)).astype("float32")
    y = rng.integers(0, vocab, size=(rows_, 8)).astype("int32")
    results = []
    previous = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_bfloat16")
        for family, implementation in itertools.product(run.families, run.ours):
            keras.utils.set_random_seed(0)
            model = ItemModel(vocab, dim)
            model.build((None, dim))
            model.compile(keras.optimizers.Adam(1e-3),
                          losses_of[family](model.items, implementation=implementation))
            losses = []  # round 0 (untimed) compiles
            timed = alternate({"fit": lambda: model.train_on_batch(x, y)}, run.repeats,
                              block=lambda loss: (losses.append(float(loss)), run.sync()))["fit"]
            results.append(dict(family=family, implementation=implementation, rows=rows_, vocab=vocab,
                                step_ms=1e3 * timed["wall"]["median"], last_loss=losses[-1],
                                finite=bool(np.isfinite(losses).all())))
            del model
    finally:
        keras.config.set_dtype_policy(previous)
    if not all(r["finite"] for r in results):
        run.report["errors"].append(f"mixed_bfloat16: a loss was not finite: {results}")
    return results


def graph_breaks(run):
    rows = []
    for family, implementation in itertools.product(run.families, run.ours):
        h, e, b, ids = problem(run, run.parity, torch.float32)
        op = FAMILY_OPS[family]

        def loss(h, e, b, ids):
            return op(h, e, ids, b, implementation=implementation).sum()

        torch._dynamo.reset()
        try:
            explained = torch._dynamo.explain(loss)(h, e, b, ids)
        except Exception as error:  # noqa: BLE001 - dynamo failing on it is the finding
            rows.append(dict(family=family, implementation=implementation, graphs=None, graph_breaks=None,
                             reasons=f"explain raised {type(error).__name__}: "
                                     + " ".join(str(error).split())[:300]))
            continue
        reasons = [str(getattr(r, "reason", r)).splitlines()[0][:160]
                   for r in explained.break_reasons]
        if explained.graph_break_count and not reasons:  # the first break, from a full graph
            torch._dynamo.reset()
            try:
                torch.compile(loss, fullgraph=True, backend="eager")(h, e, b, ids)
            except Exception as error:  # noqa: BLE001 - the break is the answer
                reasons = [" ".join(str(error).split())[:300]]
        rows.append(dict(family=family, implementation=implementation, graphs=explained.graph_count,
                         graph_breaks=explained.graph_break_count,
                         reasons=" | ".join(dict.fromkeys(reasons)) or "-"))
    torch._dynamo.reset()
    return rows


NCU_S = 30  # the `ncu` section's estimate


def sweep(run):
    arch = config.device_arch(torch.device(run.device))
    rows = []
    variants = ("bf16", "tf32", "ieee") if not run.dry_run else ("ieee",)
    for variant, family in itertools.product(variants, run.families):
        with precision(variant) as dtype:
            inputs = problem(run, run.paper, dtype)
            table = config.choose(run.paper[1], dtype, interpret=False, arch=arch,
                                  precision="ieee" if variant == "ieee" else "tf32", family=family)
            candidates = SWEEP_IEEE if variant == "ieee" else SWEEP
            if family == "softmax" and (variant != "ieee" or run.dry_run):
                # Triton 3.6 copies part of the columns kernel's tile in 4-byte pieces at 2 stages
                # (docs/benchmarks.md): its 1-stage twin issues fewer instructions; a GPU weighs it.
                candidates = ((table[0], (*table[1][:3], 1)), *candidates)
            for rows_block, columns_block in dict.fromkeys([tuple(table), *candidates]):
                if run.spent(f"sweep {family} {variant} {rows_block}", 5):  # `ncu`'s reserve after it
                    continue
                try:
                    with config.overridden((rows_block, columns_block)):
                        m = timed(run, ["triton"], inputs, 2, family)["triton"]
                except Exception as error:  # a configuration that does not compile or fit
                    m = dict(error=repr(error)[:200])
                rows.append(dict(family=family, variant=variant, rows_block=rows_block,
                                 columns_block=columns_block, **m))
        del inputs
        run.release()
    return rows


def nsight(run):
    tool = nsight_compute.ncu_tool()
    if run.dry_run or tool is None:
        return [dict(ran=False, why="dry run" if run.dry_run else "ncu is not installed")]
    command = [tool, "--clock-control", "none", "--target-processes", "all", "--csv", "--page", "raw",
               "--print-units", "base", "-k", "regex:rows_kernel|columns_kernel", "--launch-skip", "3",
               "--launch-count", "3", "--metrics", ",".join(nsight_compute.NCU_METRICS),
               sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cutbce_triton.py"),
               "--ncu-child"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=max(30, run.left()), check=False)
    if done.returncode != 0:
        return [dict(ran=False, why=f"ncu exit {done.returncode}: {(done.stderr or done.stdout)[-400:]}")]
    rows, _, vocab = run.small
    return nsight_compute.parse_ncu_csv(done.stdout, rows * vocab)


def ncu_child():
    """Two bf16 training steps at the small shape, L = 8 (ncu profiles the second's kernels)."""
    run = Run(budget=60.0)
    with precision("bf16") as dtype:
        inputs = problem(run, run.small, dtype)
        for _ in range(2):
            step("triton", *inputs)
            run.sync()


SECTIONS = ("peers", "chunked_tiles", "jit", "parity", "timings", "float16_zeros", "mixed_bfloat16", "graph_breaks",
            "sweep", "ncu")


def measure(budget, dry_run=False, sections=SECTIONS):
    """The `sections` (all by default, in the order given) within `budget` seconds, each leaving the sections
    after it their estimates (`Run.spent`); returns the report."""
    run = Run(budget, dry_run)
    run.report["device"] = torch.cuda.get_device_name() if not dry_run else "cpu (dry run)"
    run.report["budget_s"] = budget
    families = len(run.families)
    plan = {"peers": (PEERS_MIN_S, peers), "chunked_tiles": (10, chunked_tiles), "jit": (10 + 6 * len(run.variants) * families, jit_latency),
            "parity": (10 * families, parity), "timings": (30, timings),
            "float16_zeros": (4 * families, float16_zeros),
            "mixed_bfloat16": (6 * families, mixed_bfloat16_fit), "graph_breaks": (15, graph_breaks),
            "sweep": (10 * families, sweep), "ncu": (NCU_S, nsight)}
    chosen = [name for name in sections if name in plan]  # in the order given
    for position, name in enumerate(chosen):
        estimate, fn = plan[name]
        run.reserved = sum(plan[later][0] for later in chosen[position + 1:])
        run.section(name, estimate, lambda fn=fn: fn(run))
    run.report["wall_s"] = run.elapsed()
    return run.report
