"""Cycles of the CutBCE Pallas kernels, read from the TPU compiler's final instruction schedule.

Nothing here runs on a TPU and nothing is timed. Each case (chip, dtype, ids
per row `L`, shape, path) is compiled deviceless for one chip of the
generation (value and gradients of the loss, `jax.set_mesh` of the target
so the kernels are tiled for its VMEM) in a child process whose libtpu dumps
every kernel's final bundles (`--xla_jf_dump_llo_text`, pass
`final_bundles`). A TPU core issues at most one bundle (VLIW instruction) a
cycle, so a kernel's bundle count on a path is a lower bound on its cycles
there (stalls on DMA, MXU results and the like come on top).

How a grid step is counted (`step_cost`): the grid is the kernel's outer loop
(bundles at loop depth 1); inner loops (depth 2) run their exit test's
constant trips (a piece loop, in earlier versions: the piece columns are
unrolled now) or, a loop whose trips are dynamic, `t` trips (`t` the
prefetched in-tile count of the step: the kernel's pass per id slot
building its hit bits). Kernels with inline picks (`tiling.fast_picks`,
earlier versions) have a fast and a crowded path, told apart by their
loops (a tile must span at least 3 piece columns): forward branches skip
the fast path's region when `t > fast_picks`, the crowded path's
otherwise, and the crowded hit-mask loop runs `t - fast_picks - 1` trips
(the first id past the inline ones is marked before it). A loop's guard
region is skipped when it runs no trip. A one-off `pl.when` region (first
vocabulary tile, first or last row tile) is weighted by how often it runs
over the grid (`grid_weights`): its branch compares a grid index with a
constant, and the grid loop's counters give that index's extent, so a
region run at one value of an axis of extent `n` weighs `1 / n` (`n - 1 /
n` for all values but one); a region whose predicate is anything else
(the pipeline's DMA and window-copy guards) counts on every step. Both
counts are reported: `step_cycles` (weighted) and `step_cycles_every`
(every region on every step, the count before). The step's bundles
are averaged over the distribution of `t` of uniformly drawn ids (the
kernels' own `in_tile_counts`). The steady step is the one of full
vocabulary tiles: each case is compiled with
`V` rounded up to whole tiles (the edge tile's masked copy of the body, run
once a pass, is left out); the number of steps is the real `V`'s.

Reported per case and kernel: bundles per grid step, per 1024 logits (one
float32 vector register), the estimated time of the call at the chip's
clock (cycles of the busiest TensorCore), and the bounds beside it:

- MXU: `2 D` FLOP per logit and matmul (1 forward, 3 with gradients) at the
  chip's bf16 peak, times `depth / D` when `D` is below the systolic array's
  depth (128 on v5e/v5p, 256 on v6e: every matmul here has `D` on its
  contraction or its output width). float32 operands are counted like
  bfloat16 (one pass at default precision): a first TPU run must confirm.
- VPU, transcendental unit (EUP), loads, stores: the step's ops of that
  class divided by the most of them the schedule ever packs in one bundle
  (the slots, read off the dump), i.e. the cycles a perfect schedule of
  these ops needs.
- HBM: the bytes the pipeline moves (the table once a pass, its gradient
  written once and, across row blocks, read back once) at the chip's
  bandwidth.

Usage (needs libtpu: `pip install ".[tpu-compile]"`; each case is a ~20-60 s
compile on one core, dumps are cached under `--cache`):

    python tools/pallas_cycles.py                           # the full grid
    python tools/pallas_cycles.py --chips v6e --dtypes float32 --ids 8
    python tools/pallas_cycles.py --repo ../before --json results/pallas_cycles_before.json
    python tools/pallas_cycles.py --shapes "16384,64,876000" --target unknown

`--target unknown` compiles without telling the trace the chip's generation
(tiles for any generation, as from a CPU host without `jax.set_mesh`).
"""

import argparse
import collections
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DUMP_FLAGS = ("--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true "
              "--xla_jf_dump_llo_pass_label_regex=final_bundles")


class Chip(NamedTuple):
    """What the bounds need to know about a TPU generation (public spec sheets)."""

    topology: str
    clock_hz: float
    bf16_flops: float  # peak dense bf16 FLOP/s of one TensorCore
    mxu_depth: int  # systolic array depth
    hbm_bytes_s: float  # HBM bandwidth of one chip
    cores: int  # TensorCores per device (megacore)


CHIPS = {
    "v5e": Chip("v5e:2x2", 1.5e9, 197e12, 128, 819e9, 1),
    "v6e": Chip("v6e:2x2", 1.75e9, 918e12, 256, 1640e9, 1),
    "v5p": Chip("v5p:2x2x1", 1.75e9, 459e12 / 2, 128, 2765e9, 2),
}
SHAPES = ((4096, 64, 876_000), (16384, 64, 100_000))  # (rows M, dim D, vocabulary V)
PATHS = ("fused", "per_row")  # weighted_loss_sum's one pass; per-row loss, then its gradients
# `--paths softmax`: the softmax weighted sum (its statistics pass, then its gradient pass).
FORWARD_KERNELS = ("cutbce_forward", "cutsoftmax_stats")

_BUNDLE = re.compile(r"^\s*0x([0-9a-f]+)\s+([A-Z]*):\s*(>*)\s*\{(.*)", re.S)
_OP = re.compile(r"= ([a-z][\w.]*)")
_BRANCH = re.compile(r"sbr\.rel[^;}]*target = \$region(\d+)")
_REGION = re.compile(r"Start region (\d+)")
TRANSCENDENTAL = ("vpow2", "vlog2", "vrcp", "vexp", "vtanh", "vrsqrt", "vsqrt", "vlog")


def op_class(op):
    """The issue slot class of a bundle op: mxu, xlu, eup(_pop), mask, load, store, valu, scalar."""
    if op.startswith("vpop.eup"):
        return "eup_pop"  # a result popped from the transcendental unit (its own slot)
    if ".mxu" in op or op.startswith("vmat"):
        return "mxu"
    if "xlu" in op or op.startswith(("vxpose", "vperm", "vrot")):
        return "xlu"
    if op.split(".")[0] in TRANSCENDENTAL:
        return "eup"
    if op.startswith(("vmmov", "vmand", "vmor", "vmxor", "vmnot")):
        return "mask"  # a mask-register move or logic op: not a vector ALU slot
    if op.startswith("vld"):
        return "load"
    if op.startswith("vst"):
        return "store"
    if op.startswith("v") and op not in ("vphi", "vsyncpa", "vsyncadd", "vdelay"):
        return "valu"
    return "scalar"


class Bundle(NamedTuple):
    addr: int
    marker: str  # "LB": a loop body's first bundle, "PF": where a skipped region lands
    depth: int
    ops: tuple
    branch_to: object  # region number of a relative branch, or None
    predicate: object  # the branch's predicate register, or None
    negated: bool  # the branch is taken when its predicate is false


_PREDICATE = re.compile(r"sbr\.rel \((!?)%(p\w+)\)")
_LOOP_EXIT = re.compile(r"%(p\w+) = scmp\.\w+\.s32\.totalorder %s\w+, (\d+) /\* loop exit test")


def read_bundles(path):
    """The bundles of a `*-final_bundles.txt` dump, `{region: first address}`, loop bounds, defs.

    Loop bounds: `{predicate: trips}` of the loops whose exit test compares
    with a constant (`fori_loop` with static bounds); defs: `_definitions`.
    """
    bundles, starts, bounds = [], {}, {}
    texts = []  # one bundle's text may span lines (comments with newlines)
    with open(path) as f:
        for line in f:
            if _BUNDLE.match(line):
                texts.append(line)
            elif texts:
                texts[-1] += line
    for text in texts:
        for name, trips in _LOOP_EXIT.findall(text):
            bounds[name] = int(trips)
        found = _BUNDLE.match(text)
        addr = int(found.group(1), 16)
        for region in _REGION.findall(text):
            starts.setdefault(int(region), addr)
        target, predicate = _BRANCH.search(text), _PREDICATE.search(text)
        bundles.append(Bundle(addr, found.group(2), len(found.group(3)),
                              tuple(_OP.findall(found.group(4))),
                              int(target.group(1)) if target else None,
                              predicate.group(2) if predicate else None,
                              bool(predicate and predicate.group(1))))
    return bundles, starts, bounds, _definitions(texts)


_DEF = re.compile(r"%([sp]\w+) = ([a-z][\w.]*) ([^;}]*)")
_SPILL = re.compile(r"= sst \[smem:\[#(\w+)\]\] (?:\([^)]*\) )?%(s\w+)")


def _definitions(texts):
    """`{register: (op, operand text)}` of the dump's scalar and predicate definitions.

    A scalar spilled to and reloaded from scalar memory reads, at its
    reload (`sld`), as a `sphi` of the registers stored to that slot.
    """
    found, spills = {}, collections.defaultdict(list)
    for text in texts:
        for slot, reg in _SPILL.findall(text):
            spills[slot].append("%" + reg)
        for name, op, operands in _DEF.findall(text):
            if op.startswith(("s", "p")):
                found.setdefault(name, (op, operands.split("/*")[0].strip()))
    for name, (op, operands) in found.items():
        slot = re.fullmatch(r"\[smem:\[#(\w+)\]\]", operands)
        if op == "sld" and slot and spills.get(slot.group(1)):
            found[name] = ("sphi", ", ".join(spills[slot.group(1)]))
    return found


def grid_extents(defs):
    """`{register: extent}` of the grid indices, from the grid loop's counters.

    A counter steps as `next = sadd 1, index` and wraps where `next >= n`
    (the compare may read `next` through a predicated `smov`); `sphi` and
    `smov` copies of an index (the index of the step being executed, a
    pipeline stage behind) share its extent.
    """
    steps = {dest: operands.split(", ")[1] for dest, (op, operands) in defs.items()
             if op == "sadd.s32" and operands.startswith("1, %")}
    extents = {}
    for op, operands in defs.values():
        found = re.fullmatch(r"%(s\w+), (\d+)", operands)
        if not (op.startswith("scmp.ge.s32") and found):
            continue
        reg, n = found.group(1), int(found.group(2))
        sources = [reg] + re.findall(r"%(s\w+)", defs.get(reg, ("", ""))[1])
        for source in sources:
            if source in steps:
                extents[steps[source].lstrip("%")] = n
    changed = True
    while changed:  # copies of an index
        changed = False
        for dest, (op, operands) in defs.items():
            if dest in extents or op not in ("smov", "sphi"):
                continue
            known = {extents[x] for x in re.findall(r"%(s\w+)", operands) if x in extents}
            if len(known) == 1 and "(" not in operands:
                extents[dest] = known.pop()
                changed = True
    return extents


def grid_weights(bundles, defs):
    """`{branch address: share of the grid steps that run its region}` (`pl.when` regions).

    A branch on `index != c` (taken: the region is skipped) runs its region
    at one value of an index of extent `n`: `1 / n` of the steps; `index ==
    c` or a negated branch the other way round. Branches whose predicate is
    not such a compare are left out (their regions count on every step).
    """
    extents, weights = grid_extents(defs), {}
    for b in bundles:
        if b.branch_to is None or b.predicate is None or b.depth != 1:
            continue
        op, operands = defs.get(b.predicate, ("", ""))
        found = re.fullmatch(r"%(s\w+), (\d+)", operands)
        kind = re.match(r"scmp\.(eq|ne)\.s32", op)
        if not (found and kind) or found.group(1) not in extents:
            continue
        n, value = extents[found.group(1)], int(found.group(2))
        if value >= n:
            continue
        skipped_when_equal = (kind.group(1) == "eq") != b.negated
        weights[b.addr] = 1 - 1 / n if skipped_when_equal else 1 / n
    return weights


class Loop(NamedTuple):
    first: int
    last: int
    size: int  # bundles of one trip
    trips: object  # a constant, or None: the step's in-tile count
    path: str  # "both", "fast" (steps with few ids in the tile) or "crowded"


def _loops(bundles, bounds, split=True):
    """The inner loops, their trips and the path they belong to.

    `split`: the kernel has a fast and a crowded path (inline picks); else
    every loop belongs to both.

    A loop starts at a depth-2 "LB" bundle and holds the depth-2 bundles up
    to the next loop or to a run of 16 depth-1 bundles (the scheduler
    interleaves a loop's last bundles with the code after it).
    """
    spans, gap = [], 0
    for b in bundles:
        if b.depth >= 2 and b.marker == "LB":
            spans.append([b])
            gap = 0
        elif spans and gap < 16:
            if b.depth >= 2:
                spans[-1].append(b)
                gap = 0
            else:
                gap += 1
    found = []
    for run in spans:
        exits = [b.predicate for b in run if b.predicate is not None]
        found.append((run[0].addr, run[-1].addr, len(run),
                      bounds.get(exits[-1]) if exits else None))
    found = [x for x in found if x[2] >= 16]  # tiny loops (a few bundles) cost next to nothing
    dynamic = [first for first, _, _, trips in found if trips is None]
    loops = []
    for first, last, size, trips in found:
        # The kernel traces the fast path first, then the crowded one (its hit
        # mask loop: the only loop whose trips are the in-tile count).
        if not split or not dynamic or not any(trips is not None for *_, trips in found):
            path = "both"
        elif trips is None or first > dynamic[0]:
            path = "crowded"
        else:
            path = "fast"
        loops.append(Loop(first, last, size, trips, path))
    return loops


def slot_widths(bundles):
    """The most ops of each class one bundle holds (the issue slots, read off the schedule)."""
    slots = collections.Counter()
    for b in bundles:
        for cls, n in collections.Counter(map(op_class, b.ops)).items():
            slots[cls] = max(slots[cls], n)
    return dict(slots)


def forward_regions(bundles, starts):
    """`(branch address, landing address)` of the grid loop's forward branches (skipped regions).

    A branch lands at its target region's first bundle when the dump names
    it, else at the matching "PF" (fallthrough) bundle: regions nest, so
    each fallthrough closes the latest open branch.
    """
    regions, open_branches = [], []
    for b in bundles:
        if b.depth != 1:
            continue
        if b.marker == "PF" and open_branches:
            regions.append((open_branches.pop(), b.addr))
        if b.branch_to is not None:
            target = starts.get(b.branch_to)
            if target is None:
                open_branches.append(b.addr)
            elif target > b.addr:
                regions.append((b.addr, target))
    return regions


def step_cost(bundles, starts, bounds, weights, in_tile, fast_picks, classify=op_class):
    """Returns `(bundles, ops by class)` of one grid step whose in-tile count is `in_tile`.

    `classify`: an op's class (`op_class`; the identity counts opcodes).

    Depth-1 bundles count when every forward-branch region holding them runs,
    times the share of the grid steps that run them (`weights`: what
    `grid_weights` returns; `{}`, every region on every step): a region runs when it
    holds a loop that runs, or no loop (the one-off `pl.when` regions), or
    encloses a smaller region
    with the same loops (it is not their guard). A loop runs its constant trips,
    or `in_tile` trips (the dynamic loop), `in_tile - fast_picks - 1` for
    the crowded hit-mask loop of a kernel with inline picks, whose fast
    path's loops run when `in_tile <= fast_picks`, the crowded path's
    otherwise.
    """
    loops = _loops(bundles, bounds, split=fast_picks is not None)
    crowded = any(x.path == "crowded" for x in loops) and in_tile > (fast_picks or 0)

    def trips(loop):
        if loop.path == ("fast" if crowded else "crowded"):
            return 0
        if loop.trips is not None:
            return loop.trips
        return in_tile if fast_picks is None else max(0, in_tile - fast_picks - 1)

    spans = forward_regions(bundles, starts)

    def loops_in(start, end):
        return {x for x in loops if start < x.first and x.last < end}

    regions = []
    for start, end in spans:
        inside = loops_in(start, end)
        # A region around a smaller one with the same loops encloses it (it
        # is not that loop's guard): it runs.
        encloses = any(start <= a and b <= end and (a, b) != (start, end)
                       and loops_in(a, b) == inside for a, b in spans)
        runs = not inside or encloses or any(trips(x) > 0 for x in inside)
        regions.append((start, end, runs))
    total, ops = 0.0, collections.Counter()
    for b in bundles:
        if b.depth != 1:
            continue
        share = 1.0
        for lo, hi, runs in regions:
            if lo < b.addr < hi:
                share *= weights.get(lo, 1.0) if runs else 0.0
        if share:
            total += share
            for cls in map(classify, b.ops):
                ops[cls] += share
    for x in loops:
        n = trips(x)
        total += n * x.size
        for b in bundles:
            if x.first <= b.addr <= x.last and b.depth >= 2:
                for cls in map(classify, b.ops):
                    ops[cls] += n
    return total, ops


def kernel_dumps(directory):
    """`{kernel name: final-bundles path}` of the CutBCE kernels in a dump directory."""
    found = {}
    for path in glob.glob(os.path.join(directory, "*-01-final_bundles.txt")):
        name = re.search(r"(cutbce_(?:fused|grads|forward)|cutsoftmax_(?:stats|grads))",
                         os.path.basename(path))
        if name:
            found[name.group(1)] = path
    return found


# ---------------------------------------------------------------- the child: compile one case


def compile_case(case, dump_dir):
    """Compiles one case (libtpu must dump into `dump_dir`), returns its steps' facts as a dict."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.append(ROOT)
    from tools import tpu_aot
    from keras_cutbce.backends.jax import pallas
    from keras_cutbce.backends.jax import compile_platform
    from keras_cutbce.backends.jax.pallas import api

    tiling = getattr(pallas, "tiling", None) or api  # the tile rule (in `api` in later checkouts)

    chip = CHIPS[case["chip"]]
    device = tpu_aot.topology_devices(chip.topology)[0]
    m, d, v, num_ids = case["rows"], case["dim"], case["vocab"], case["ids"]
    dtype = case["dtype"]
    known = case.get("target", "known") == "known"
    info = compile_platform.chip_info(device.device_kind)
    capacity, cores = (info.vmem_bytes, info.cores) if known else (None, 1)
    # The tiles' budget (`vmem_budget_bytes` in checkouts before `tile_budget_bytes`).
    budget = getattr(tiling, "tile_budget_bytes", tiling.vmem_budget_bytes)(capacity)
    row_tile, tile = tiling.choose_tiles(m, v, d, dtype, budget)
    cfg = SimpleNamespace(vocab_size=v, tile=tile, row_tile=row_tile, num_ids=num_ids,
                          vmem_capacity=capacity, cores=cores, dv_view=d % 128 != 0,
                          mm_dtype=dtype, table_dtype=dtype)
    aligned = -(-v // (tile * cfg.cores)) * tile * cfg.cores  # whole tiles: no edge copy

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.SingleDeviceSharding(device))

    args = (spec((m, d), dtype), spec((aligned, d), dtype), spec((m, num_ids), jnp.int32),
            spec((m,), jnp.float32), spec((aligned,), jnp.float32))
    loss = {"softmax": lambda h, t, ids, b, w: pallas.cut_softmax_weighted_sum(h, t, ids, b, w),
            "fused": lambda h, t, ids, b, w: pallas.cut_bce_weighted_sum(h, t, ids, b, w),
            "per_row": lambda h, t, ids, b, w: jnp.vdot(w, pallas.cut_bce(h, t, ids, b))
            }[case["path"]]

    def fn(h, t, ids, w, b):  # with `bias`: the gradient wrt the bias too
        if not case.get("bias"):
            return jax.value_and_grad(lambda h, t: loss(h, t, ids, None, w), argnums=(0, 1))(h, t)
        return jax.value_and_grad(lambda h, t, b: loss(h, t, ids, b, w), argnums=(0, 1, 2))(h, t, b)
    if known:  # the trace knows the generation; else it is decided at lowering
        with jax.set_mesh(jax.sharding.Mesh([device], ("cutbce_target",))):
            jax.jit(fn).lower(*args).compile()
    else:
        jax.jit(fn).lower(*args).compile()
    # The real V's grid and in-tile counts (the kernels' own rule), on the host.
    with jax.default_device(jax.devices("cpu")[0]):
        rng = np.random.default_rng(0)
        ids = rng.integers(0, v, size=(m, num_ids)).astype(np.int32)
        facts = {}
        rows_ids = _sorted_ids(api, jnp.asarray(ids), v)
        cfg.num_tiles = -(-v // tile)
        for with_grads in (True, False):
            count, block_rows = tiling.row_blocks(m, d, np.dtype(dtype).itemsize, cfg, with_grads)
            _, ids_t, _ = api.row_inputs(jnp.zeros((m, d)), rows_ids, None, count * block_rows,
                                         cfg)
            counts = np.asarray(api.in_tile_counts(ids_t, cfg))
            row_tiles = block_rows // cfg.row_tile
            if counts.shape[0] * row_tiles > api.MAX_PREFETCHED_COUNTS:  # one count a tile
                counts = counts.reshape(counts.shape[0], count, row_tiles).max(axis=2)
                counts = np.repeat(counts, row_tiles, axis=1)
            per_core = -(-counts.shape[0] // tiling.cores_used(cfg))
            facts["grads" if with_grads else "forward"] = dict(
                blocks=count, block_rows=block_rows, row_tile=cfg.row_tile, tile=tile,
                cores=tiling.cores_used(cfg), steps_per_core=per_core * counts.shape[1],
                trips=float(counts.mean()),
                in_tile={int(t): float((counts == t).mean()) for t in np.unique(counts)})
    picks = getattr(tiling, "fast_picks", None)  # None: a kernel without inline picks
    facts["fast_picks"] = None if picks is None else picks(v, tile, row_tile, num_ids)
    return dict(facts=facts, aligned_vocab=aligned, dumps=kernel_dumps(dump_dir))


def _sorted_ids(api, ids, vocab):
    """The ids `api.row_inputs` takes: each row's sorted (`api.sorted_positives`), or as given (older checkouts)."""
    sort = getattr(api, "sorted_positives", None)
    return ids if sort is None else sort(ids, vocab)[0]


def source_digest(repo):
    """A digest of the JAX backend's sources of `repo` (what the compiled kernels depend on)."""
    digest = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(repo, "keras_cutbce", "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, repo).encode() + f.read())
    return digest.hexdigest()


def _run_child(case, cache, repo):
    key = hashlib.sha1(json.dumps([case, source_digest(repo)], sort_keys=True).encode())
    key = key.hexdigest()[:16]
    dump_dir = os.path.join(cache, key)
    done = os.path.join(dump_dir, "facts.json")
    if os.path.exists(done):
        with open(done) as f:
            return dict(json.load(f), dumps=kernel_dumps(dump_dir))
    os.makedirs(dump_dir, exist_ok=True)
    env = dict(os.environ, KERAS_BACKEND="jax", TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=os.path.abspath(repo),
               LIBTPU_INIT_ARGS=DUMP_FLAGS.format(dir=dump_dir))
    env["JAX_PLATFORMS"] = ""  # JAX's own choice (scripts/quiet_start.pth pins the CPU)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case),
                          dump_dir], capture_output=True, text=True, env=env, timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("FACTS ")]
    if not lines:
        raise RuntimeError(f"case {case} failed:\n{out.stderr[-3000:]}")
    with open(done, "w") as f:
        f.write(lines[-1][len("FACTS "):])
    with open(done) as f:
        return json.load(f)


# ---------------------------------------------------------------- the table


def kernel_row(case, name, schedule, fact, fast_picks, chip, slots):
    """One kernel's figures: cycles per step and per 1024 logits, ms, and the bounds (ms)."""
    logits_per_step = fact["row_tile"] * fact["tile"]
    bundles, starts, bounds, defs = schedule
    weights = grid_weights(bundles, defs)  # the same for every in-tile count
    step, every, ops, opcodes = 0.0, 0.0, collections.Counter(), collections.Counter()
    for in_tile, share in fact["in_tile"].items():
        cycles, counts = step_cost(bundles, starts, bounds, weights, int(in_tile), fast_picks)
        step += share * cycles
        every += share * step_cost(bundles, starts, bounds, {}, int(in_tile), fast_picks)[0]
        for cls, n in counts.items():
            ops[cls] += share * n
        named = step_cost(bundles, starts, bounds, weights, int(in_tile), fast_picks, str)[1]
        for op, n in named.items():
            opcodes[op] += share * n
    steps = fact["steps_per_core"]  # every row block's steps
    per_vreg = 1024 / logits_per_step

    def ms(cycles_per_step):
        return round(cycles_per_step * steps / chip.clock_hz * 1e3, 2)

    d = case["dim"]
    matmuls = 1 if name in FORWARD_KERNELS else 3
    mxu_step = (matmuls * 2 * d * logits_per_step * max(1, chip.mxu_depth / d)
                / (chip.bf16_flops / chip.clock_hz))
    itemsize = 2 if case["dtype"] == "bfloat16" else 4
    table = case["vocab"] * d * itemsize
    blocks = fact["blocks"]  # the table is read once a pass, its gradient written and carried
    hbm = table * blocks + (0 if matmuls == 1 else table * (2 * blocks - 1))
    row = dict(
        kernel=name, steps_per_core=steps, row_tile=fact["row_tile"], tile=fact["tile"],
        blocks=fact["blocks"], trips=round(fact["trips"], 2),
        step_cycles=round(step), cycles_per_1024=round(step * per_vreg, 2), est_ms=ms(step),
        step_cycles_every=round(every), cycles_per_1024_every=round(every * per_vreg, 2),
        est_ms_every=ms(every),
        mxu_ms=ms(mxu_step), hbm_ms=round(hbm / chip.hbm_bytes_s * 1e3, 2),  # the chip's HBM
        ops_per_1024={cls: round(ops[cls] * per_vreg, 2)
                      for cls in ("valu", "eup", "load", "store", "mxu", "xlu")},
        opcodes_per_1024={op: round(n * per_vreg, 3) for op, n in opcodes.most_common()
                          if n * per_vreg >= 0.005},
    )
    for cls, label in (("valu", "vpu_ms"), ("eup", "eup_ms"), ("load", "load_ms"),
                       ("store", "store_ms")):
        row[label] = ms(ops[cls] / max(1, slots.get(cls, 1)))
    row["slots"] = slots
    return row


def case_row(case, result):
    """The table row of one compiled case (`result`: what `compile_case` returned)."""
    chip = CHIPS[case["chip"]]
    kernels = []
    for name, path in sorted(result["dumps"].items()):
        schedule = read_bundles(path)
        fact = result["facts"]["forward" if name in FORWARD_KERNELS else "grads"]
        kernels.append(kernel_row(case, name, schedule, fact, result["facts"]["fast_picks"],
                                  chip, slot_widths(schedule[0])))
    total = {k: round(sum(x[k] for x in kernels), 2)
             for k in ("est_ms", "est_ms_every", "mxu_ms", "vpu_ms", "eup_ms", "load_ms",
                       "store_ms", "hbm_ms")}
    return dict(case, kernels=kernels, **total, x_mxu=round(total["est_ms"] / total["mxu_ms"], 2),
                x_mxu_every=round(total["est_ms_every"] / total["mxu_ms"], 2))


def measure(cases, cache, repo):
    """The rows of the cases that compile (a case that does not is reported and left out)."""
    rows = []
    for case in cases:
        try:
            result = _run_child(case, cache, repo)
        except RuntimeError as error:
            print(f"not compiled: {str(error)[:300]}", flush=True)
            continue
        rows.append(case_row(case, result))
        print(_line(rows[-1]), flush=True)
    return rows


HEADER = ("| chip | dtype | L | M | D | V | path | kernel | cycles / step | cycles / 1024 logits "
          "| (every step) | est. ms | MXU ms | VPU ms | EUP ms | ld / st ms | HBM ms "
          "| x MXU floor | (every step) |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: | ---: | ---: | ---: |")


def path_label(case):
    """The path, and "+ bias" when compiled with a bias."""
    return case["path"] + (" + bias" if case.get("bias") else "")


def chip_label(case):
    """The chip, and "(unknown)" when compiled with its generation unknown."""
    return case["chip"] + (" (unknown)" if case.get("target", "known") != "known" else "")


def _line(r):
    out = []
    for k in r["kernels"]:
        out.append(
            f"| {chip_label(r)} | {r['dtype']} | {r['ids']} | {r['rows']} | {r['dim']} | "
            f"{r['vocab']:,} | {path_label(r)} | {k['kernel']} | {k['step_cycles']:,} "
            f"| {k['cycles_per_1024']} | {k.get('cycles_per_1024_every', '-')} | {k['est_ms']} "
            f"| {k['mxu_ms']} | {k['vpu_ms']} | {k['eup_ms']} | {k['load_ms']} / {k['store_ms']} "
            f"| {k['hbm_ms']} | {round(k['est_ms'] / k['mxu_ms'], 2)} "
            f"| {round(k.get('est_ms_every', k['est_ms']) / k['mxu_ms'], 2)} |")
    return "\n".join(out)


def markdown(rows, commit):
    intro = (
        f"Cycles of the CutBCE Pallas kernels from the TPU compiler's final bundles (commit "
        f"`{commit}`; libtpu deviceless compile, nothing ran: bundle counts are a lower bound on "
        "cycles). Value and gradients of the loss, ids drawn uniformly. est. ms: the call's "
        "steps x cycles a step at the chip's clock; the bounds are the cycles the step's MXU "
        "FLOPs, VALU / EUP / load / store ops (per slot) and HBM bytes need. The one-off "
        "`pl.when` regions are weighted by how often they run over the grid; \"every step\": "
        "the count with every region on every step (the earlier count). "
        "See `tools/pallas_cycles.py` for the method.")
    return "\n".join([intro, "", HEADER] + [_line(r) for r in rows]) + "\n"


def compare_markdown(before, after):
    """A before/after table of two runs' JSON (cases in both; the kernels of a path summed)."""
    def key(r):
        return (chip_label(r), path_label(r)) + tuple(r[k] for k in ("dtype", "ids", "rows",
                                                                     "dim", "vocab"))

    def per_1024(r):
        return round(sum(k["cycles_per_1024"] for k in r["kernels"]), 2)

    old = {key(r): r for r in before["rows"]}
    lines = [
        f"Before (`{before['commit']}`) and after (`{after['commit']}`): cycles per 1024 logits "
        "(the path's kernels summed) and the estimated ms at the chip's clock, from the TPU "
        "compiler's final bundles (no run). x MXU: est. ms / the MXU floor.", "",
        "| chip | dtype | L | (M, D, V) | path | cycles / 1024 before | after | est. ms before "
        "| after | x MXU before | after | MXU floor ms | bound (after) |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in after["rows"]:
        b = old.get(key(r))
        if b is None:
            continue
        bounds = {"MXU": r["mxu_ms"], "VPU": r["vpu_ms"], "EUP": r["eup_ms"],
                  "load": r["load_ms"], "store": r["store_ms"], "HBM": r["hbm_ms"]}
        lines.append(
            f"| {chip_label(r)} | {r['dtype']} | {r['ids']} "
            f"| ({r['rows']}, {r['dim']}, {r['vocab']:,}) | {path_label(r)} | {per_1024(b)} "
            f"| {per_1024(r)} | {b['est_ms']} | {r['est_ms']} "
            f"| {b['x_mxu']} | {r['x_mxu']} | {r['mxu_ms']} | {max(bounds, key=bounds.get)} |")
    return "\n".join(lines) + "\n"


def commit_label(repo):
    def git(*cmd):
        return subprocess.run(["git", "-C", repo, *cmd], capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "keras_cutbce").strip()
    return head + ("+" + hashlib.sha1(git("diff", "--", "keras_cutbce").encode()).hexdigest()[:8]
                   if dirty else "")


def parse_shapes(text):
    """`"M,D,V;M,D,V"` -> `((M, D, V), ...)`."""
    return tuple(tuple(int(x) for x in shape.split(",")) for shape in text.split(";") if shape)


def cases_of(args):
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    target = {} if args.target == "known" else {"target": args.target}
    target.update({"bias": True} if args.bias else {})
    cases = [dict(chip=chip, dtype=dtype, ids=ids, rows=m, dim=d, vocab=v, path=path, **target)
             for chip in args.chips.split(",") for dtype in args.dtypes.split(",")
             for ids in map(int, args.ids.split(",")) for (m, d, v) in shapes
             for path in args.paths.split(",")
             if not args.vocab or v in map(int, args.vocab.split(","))]
    if args.trim:  # v6e: all but L = 1 per row; elsewhere float32, L = 8, the fused path
        cases = [c for c in cases if (c["chip"] == "v6e" and (c["ids"], c["path"]) != (1, "per_row"))
                 or (c["dtype"], c["ids"], c["path"]) == ("float32", 8, "fused")]
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default="v6e,v5e,v5p")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--ids", default="8,1")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--vocab", default="", help="only these V of SHAPES (comma-separated)")
    parser.add_argument("--shapes", default="", help='"M,D,V;..." instead of SHAPES')
    parser.add_argument("--target", default="known", choices=("known", "unknown"),
                        help="the trace knows the chip's generation, or not (tiled for any)")
    parser.add_argument("--bias", action="store_true", help="with a bias (and its gradient)")
    parser.add_argument("--trim", action="store_true",
                        help="v6e: all but L = 1 per row; v5e / v5p: float32, L = 8, fused")
    parser.add_argument("--repo", default=ROOT, help="checkout whose keras_cutbce is measured")
    parser.add_argument("--cache", default=os.path.join("/tmp", "pallas_cycles_cache"))
    parser.add_argument("--json", default=os.path.join(RESULTS, "pallas_cycles.json"))
    parser.add_argument("--label", default=None, help="what the table names the code (default: "
                        "the checkout's commit)")
    parser.add_argument("--compare", default=None, metavar="BEFORE_JSON",
                        help="also write a before/after table against this earlier JSON")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "DUMP_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        case, dump_dir = json.loads(args.child[0]), args.child[1]
        print("FACTS " + json.dumps(compile_case(case, dump_dir)), flush=True)
        return 0
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        print("libtpu is not installed (pip install '.[tpu-compile]'): no TPU compiler.")
        return 2
    commit = args.label or commit_label(args.repo)
    rows = measure(cases_of(args), args.cache, args.repo)
    with open(args.json, "w") as f:
        json.dump({"commit": commit, "rows": rows}, f, indent=1)
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(markdown(rows, commit))
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        text = compare_markdown(before, {"commit": commit, "rows": rows})
        print(text)
        with open(os.path.splitext(args.json)[0] + "_compare.md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
