"""Train the CTR model with ERASE: `python -m examples.ctr`.

Modes (the same network and initial weights in every mode):

| mode | model and schedule |
|---|---|
| `baseline` | no detachment, Keras's standard step (the quality baseline) |
| `detached` | `EraseModel(dispatch="standard")`: detached towers, standard step |
| `erase-auto` | `EraseModel(dispatch="auto")` (every backend; the default): on CUDA it times its first steps and keeps the fastest schedule; on a CPU, JAX and TensorFlow it is the standard step |
| `erase-blocking` | early backward of each tower, inline (torch) |
| `erase-threaded` | early backward on a worker thread (torch) |
| `erase-streams` | early backward on CUDA streams (torch + CUDA) |
| `erase-graphs` | streams with each tower captured as a CUDA Graph (torch + CUDA) |

Reported: normalized entropy (NE) and AUC on a held-out split (with
`--seeds N`, the mean +- sample sd over N training seeds `--seed`, `--seed + 1`,
...: initial weights and shuffling change, the data set stays the one made
from `--seed`), and the
training throughput after `--warmup-steps`: examples/s of every step (from
`on_train_batch_begin` to `on_train_batch_end`, CUDA synchronized before each
clock read on a CUDA device), p50 and p90 over steps as the ERASE paper
reports them (`keras_erase.throughput`: p90 is the 90th percentile of
per-step examples/s, the fast end). With `--nproc N` a global step lasts as
long as its slowest rank: global QPS is `N * batch / max over ranks` per step,
then percentiles (per-rank percentiles are never summed). `--compare` runs
every mode available here and prints one table with each mode's QPS gain and
NE gap against `baseline`, and saves a plot of the training NE per step;
it trains every mode in one process, timed alternating, and prints each gain
with its spread over the repeats (`examples.ctr.compare`).

Example:

```
python -m examples.ctr --backend jax --json runs/ctr.json      # --mode erase-auto
python -m examples.ctr --backend torch --mode erase-threaded --json runs/ctr.json
python -m examples.ctr --backend torch --compare --seeds 3 --plot runs/ctr_ne.png
```
"""

import json
import math
import os
import sys
import time

import keras
import numpy as np

from examples.ctr.cli import MODES, build_parser  # noqa: F401 (re-exported: the command line)
from examples.ctr import data as data_lib
from examples.ctr.compare import build_mode_model, compare_modes
from examples.ctr.seeds import aggregate, mean_sd
from keras_erase.throughput import global_step_seconds, throughput_percentiles

ERASE_OPTIONS = {
    "detached": {"dispatch": "standard"},
    "erase-auto": {"dispatch": "auto"},
    "erase-blocking": {"dispatch": "blocking"},
    "erase-threaded": {"dispatch": "threaded"},
    "erase-streams": {"dispatch": "streams"},
    "erase-graphs": {"dispatch": "streams", "cuda_graphs": True},
}


def _cuda_available():
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.cuda.is_available()


def available_modes():
    """Modes that run on this backend and device.

    `erase-auto` runs everywhere (on JAX and TensorFlow `EraseModel` trains
    with the standard step); the fixed early-backward schedules exist on torch
    only; streams and CUDA Graphs need CUDA.
    """
    modes = ["baseline", "detached", "erase-auto"]
    if keras.backend.backend() == "torch":
        modes += ["erase-blocking", "erase-threaded"]
        if _cuda_available():
            modes += ["erase-streams", "erase-graphs"]
    return modes


def make_synchronizer():
    """`torch.cuda.synchronize` when training on a CUDA device (torch), else None.

    CUDA kernels run asynchronously: without a synchronize before each clock
    read a step's time would be the time to *launch* its kernels.
    """
    if _cuda_available():
        import torch

        return torch.cuda.synchronize
    return None


class Throughput(keras.callbacks.Callback):
    """Per-step seconds (`on_train_batch_begin` to `_end`) and the running NE per step.

    Args:
        batch_size: examples per step.
        synchronize: called before each clock read (e.g. `torch.cuda.synchronize`).
    """

    def __init__(self, batch_size, synchronize=None):
        super().__init__()
        self.batch_size = batch_size
        self.synchronize = synchronize
        self.seconds = []
        self.ne = []

    def _clock(self):
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        self._start = self._clock()

    def on_train_batch_end(self, batch, logs=None):
        self.seconds.append(self._clock() - self._start)
        if logs and "ne" in logs:
            self.ne.append(float(logs["ne"]))

    def timed_seconds(self, warmup):
        """Step seconds after the first `warmup` steps."""
        return self.seconds[warmup:]

    def percentiles(self, warmup):
        """`(p50, p90)` of per-step examples/s after `warmup` steps (p90: the fast end)."""
        stats = throughput_percentiles(self.timed_seconds(warmup), self.batch_size)
        return stats["p50"], stats["p90"]


def training_steps(args, num_train):
    """Steps `fit` will run: epochs x (steps per epoch, or batches in the training split)."""
    per_epoch = math.ceil(num_train / args.batch_size)
    if args.steps_per_epoch is not None:
        per_epoch = min(per_epoch, args.steps_per_epoch)
    return args.epochs * per_epoch


def check_warmup(args, num_train):
    """Refuses a run whose throughput would be measured on warm-up steps only."""
    per_rank = (num_train // (args.nproc * args.batch_size)) * args.batch_size
    steps = training_steps(args, per_rank if args.nproc > 1 else num_train)
    if steps <= args.warmup_steps:
        raise SystemExit(
            f"Only {steps} training steps for --warmup-steps {args.warmup_steps}: the "
            "throughput would time nothing after warm-up. Train more steps (--epochs, "
            "--steps-per-epoch, --num-examples) or lower --warmup-steps."
        )
    return steps


def load_data(args):
    """`(train, test)` dicts; the train size is a multiple of the batch size."""
    if args.data == "synthetic":
        data = data_lib.synthetic_ctr(args.num_examples, buckets=args.buckets, seed=args.seed)
    else:
        if args.data_dir is None:
            raise SystemExit("--data criteo needs --data-dir (a Criteo TSV file or folder).")
        data = data_lib.load_criteo(args.data_dir, buckets=args.buckets, max_rows=args.num_examples)
    train, test = data_lib.split(data)
    usable = (len(train["label"]) // args.batch_size) * args.batch_size
    if usable == 0:
        raise SystemExit(
            f"Only {len(train['label'])} training examples for --batch-size {args.batch_size}."
        )
    train = {k: v[:usable] for k, v in train.items()}
    return train, test


def run_mode(mode, args, train, test, seed=None):
    """Trains one mode from the initial weights of `seed` (default `--seed`); returns its results."""
    if mode not in available_modes():
        raise SystemExit(
            f"--mode {mode} is not available on backend {keras.backend.backend()!r} "
            f"here; available: {', '.join(available_modes())}."
        )
    seed = args.seed if seed is None else seed
    model = build_mode_model(mode, args, train, seed, ERASE_OPTIONS)
    meter = Throughput(args.batch_size, synchronize=make_synchronizer())
    features = {"dense": train["dense"], "sparse": train["sparse"]}
    print(f"[ctr] backend={keras.backend.backend()} mode={mode} seed={seed} "
          f"train={len(train['label'])} test={len(test['label'])} "
          f"ctr={train['label'].mean():.3f}")
    model.fit(
        features,
        train["label"],
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        shuffle=True,
        callbacks=[meter],
        verbose=args.verbose,
    )
    scores = model.evaluate(
        {"dense": test["dense"], "sparse": test["sparse"]},
        test["label"],
        batch_size=max(args.batch_size, 2048),
        return_dict=True,
        verbose=0,
    )
    qps_p50, qps_p90 = meter.percentiles(args.warmup_steps)
    print(f"[ctr] mode={mode} seed={seed}: held-out NE {float(scores['ne']):.4f} "
          f"AUC {float(scores['auc']):.4f}, QPS p50 {qps_p50:.0f}", flush=True)
    return {
        "mode": mode,
        "seed": seed,
        "dispatch_choice": getattr(model, "dispatch_choice", None),
        "ne": float(scores["ne"]),
        "auc": float(scores["auc"]),
        "qps_p50": qps_p50,
        "qps_p90": qps_p90,
        "steps": len(meter.seconds),
        "timed_steps": len(meter.timed_seconds(args.warmup_steps)),
        "step_seconds": meter.timed_seconds(args.warmup_steps),
        "train_ne_per_step": meter.ne,
        "backend": keras.backend.backend(),
    }


TABLE_NOTE = (
    "QPS: training examples/s of each step after warm-up (CPU: wall clock; CUDA: synchronized); "
    "p50 = median step, p90 = 90th percentile of per-step examples/s (the fast end, as the "
    "ERASE paper reports it); gains and NE gap are relative to the first mode (baseline). "
    "NE and AUC: held-out split, lower NE is better; with several seeds mean ± sample sd over "
    "the seeds, and the NE gap is that of the means. erase-auto (its choice in brackets): on CUDA "
    "it tries each candidate schedule during its first steps, and those past the warm-up count in "
    "its QPS; on a CPU it is the standard step from the first step, without measuring."
)

COMPARE_NOTE = (
    "--compare: every mode trained in one process, {block} steps each in turn (a repeat = one "
    "block per mode, adjacent in time; modes rotate, so none always runs first), the same "
    "batches, the same torch intra-op threads (erase-threaded splits them between its main and "
    "worker threads: equal thread budgets). QPS gain: of the pooled timed steps; in brackets the "
    "spread (min..max) of the per-repeat gains over {repeats} repeats; a gain whose spread "
    "includes 0 is marked 'no gain'. NE: baseline and detached over the seeds; every erase-* "
    "schedule computes the detached model's gradients, so its NE (first seed, 'seeds' column) "
    "must equal detached's first seed, and its NE gap is against detached's first seed."
)

CPU_NOTE = "CPU: ERASE's gain is a GPU matter"
CPU_EXPLANATION = (
    "On CPU the early backward and the forward pass share the same cores, so an erase-* row "
    "shows what the schedule costs here, not ERASE's speed-up: that needs a GPU, where a "
    "block's backward overlaps later blocks' forward on CUDA streams."
)


def _gain_cell(gain, pooled):
    if gain is None:
        return f"{pooled:+.1f}%"
    median, low, high, clear = gain
    cell = f"{pooled:+.1f}% ({100 * low:+.1f}..{100 * high:+.1f})"
    return cell if clear else f"no gain: {cell}"


def compare_table(results, cpu=None):
    """Markdown table of the modes' results with gains against `baseline` (+ a note).

    With `--compare`'s results (per-repeat gains `gain_p50`, `gain_p90`) each
    gain gets its spread over the repeats, and one inside it reads "no gain".
    `cpu` (default: no CUDA here) adds the CPU note to the erase-* rows.
    """
    cpu = not _cuda_available() if cpu is None else cpu
    base = next((r for r in results if r["mode"] == "baseline"), results[0])
    by_mode = {r["mode"]: r for r in results}
    alternating = "gain_p50" in base
    lines = [
        "| mode | seeds | NE | AUC | QPS p50 | QPS p90 | QPS gain p50 | QPS gain p90 | NE gap "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        seeds = r.get("seeds", [r.get("seed")])
        gain50 = 100.0 * (r["qps_p50"] / base["qps_p50"] - 1.0)
        gain90 = 100.0 * (r["qps_p90"] / base["qps_p90"] - 1.0)
        reference = base
        if alternating and r["mode"].startswith("erase-") and "detached" in by_mode:
            reference = by_mode["detached"]  # the same gradients: compare on the first seed
            gap = 100.0 * (r["ne_per_seed"][0] / reference["ne_per_seed"][0] - 1.0)
        else:
            gap = 100.0 * (r["ne"] / reference["ne"] - 1.0)
        name = r["mode"]
        choices = r.get("dispatch_choices") or [r.get("dispatch_choice")]
        distinct = list(dict.fromkeys(c for c in choices if c))  # each seed's choice, in order
        if r["mode"] == "erase-auto":
            name += f" ({'/'.join(distinct) if distinct else 'still measuring'})"
        if r is base:
            cells = ["baseline", "baseline"]
        else:
            cells = [_gain_cell(r.get("gain_p50"), gain50), _gain_cell(r.get("gain_p90"), gain90)]
        note = CPU_NOTE if cpu and r["mode"].startswith("erase-") else ""
        gap_cell = f"{gap:+.2f}%" + (" vs detached" if reference is not base else "")
        lines.append(
            f"| {name} | {len(seeds)} | {mean_sd(r['ne'], r.get('ne_sd', 0.0), seeds)} "
            f"| {mean_sd(r['auc'], r.get('auc_sd', 0.0), seeds)} | {r['qps_p50']:.0f} "
            f"| {r['qps_p90']:.0f} | {cells[0]} | {cells[1]} | {gap_cell} | {note} |"
        )
    notes = [TABLE_NOTE]
    if alternating:
        block = len(base["repeats"][0]) if base.get("repeats") else 0
        notes.append(COMPARE_NOTE.format(block=base.get("interleave_steps", block),
                                         repeats=len(base.get("repeats", []))))
    if cpu and any(r["mode"].startswith("erase-") for r in results):
        notes.append(CPU_EXPLANATION)
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes)


def plot_ne(results, path):
    """Saves the training NE (running, per step) of every mode to a PNG.

    With several seeds: the mean over seeds per step, and a band of +- one sd.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for r in results:
        ne = r["train_ne_per_step"]
        steps = np.arange(1, len(ne) + 1)
        (line,) = axis.plot(steps, ne, label=r["mode"], linewidth=1.2)
        sd = r.get("train_ne_sd_per_step")
        if sd and len(r.get("seeds", ())) > 1:
            low, high = np.array(ne) - np.array(sd), np.array(ne) + np.array(sd)
            axis.fill_between(steps, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
    axis.set_xlabel("training step")
    seeds = len(results[0].get("seeds", ())) if results else 0
    axis.set_ylabel("normalized entropy (running, train)"
                    + (f"\nmean ± sd over {seeds} seeds" if seeds > 1 else ""))
    axis.set_title(f"CTR: NE per step ({keras.backend.backend()})")
    axis.grid(alpha=0.3)
    axis.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return os.path.abspath(path)


def shard(train, rank, world, batch_size):
    """Rank `rank`'s equal share of the training rows (every rank takes the same steps)."""
    per_rank = (len(train["label"]) // (world * batch_size)) * batch_size
    if per_rank == 0:
        raise SystemExit(
            f"Too few training examples for --nproc {world} x --batch-size {batch_size}."
        )
    return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in train.items()}


def run_rank(rank, world, mode, args, seed=None):
    """One rank of `--nproc`: trains `mode` on its shard (weights broadcast from rank 0)."""
    train, test = load_data(args)  # same seed: the same data on every rank
    if rank > 0:
        args.verbose = 0
    return run_mode(mode, args, shard(train, rank, world, args.batch_size), test, seed)


def run_distributed(mode, args, seed=None):
    """`--nproc N`: N local gloo ranks; NE/AUC of rank 0; QPS of the global steps.

    A global step ends when its slowest rank ends: per step, global examples/s
    is `N * batch / max over ranks(step seconds)` (`global_step_seconds`), and
    p50/p90 are taken over those global steps, never summed over ranks.
    """
    from keras_erase.torch.launch import run_local

    if keras.backend.backend() != "torch":
        raise SystemExit("--nproc needs --backend torch (torch.distributed, gloo).")
    ranks = run_local(run_rank, args.nproc, args=(mode, args, seed))
    result = dict(ranks[0])
    per_rank = [r["step_seconds"] for r in ranks]
    global_seconds = global_step_seconds(per_rank)
    stats = throughput_percentiles(global_seconds, args.nproc * args.batch_size)
    result.update(
        step_seconds=global_seconds,
        nproc=args.nproc,
        qps_p50=stats["p50"],
        qps_p90=stats["p90"],
        rank_qps_p50=[r["qps_p50"] for r in ranks],
        rank_step_seconds=per_rank,
    )
    return result


def _run(mode, args, train, test):
    """`mode` trained with each of the `--seeds` training seeds, summarised (`seeds.aggregate`)."""
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        if args.nproc > 1:
            runs.append(run_distributed(mode, args, seed))
        else:
            runs.append(run_mode(mode, args, train, test, seed))
    return aggregate(runs, args.nproc * args.batch_size)


def _summary(result):
    curves = ("train_ne_per_step", "train_ne_sd_per_step", "step_seconds", "repeats")
    return {k: v for k, v in result.items() if k not in curves}


def main(argv=None):
    args = build_parser().parse_args(argv)
    train, test = load_data(args)
    check_warmup(args, len(train["label"]))
    if args.compare:
        if args.nproc > 1:  # every rank a process: the modes run one after the other
            results = [_run(mode, args, train, test) for mode in available_modes()]
        else:
            results = compare_modes(available_modes(), args, train, test, ERASE_OPTIONS,
                                    make_synchronizer(), aggregate)
            for r in results:
                r["interleave_steps"] = args.interleave_steps
        table = compare_table(results)
        print(table)
        if args.plot:
            print(f"[ctr] NE per step plot written to {plot_ne(results, args.plot)}")
        output = {"runs": [_summary(r) for r in results], "table": table}
    else:
        result = _run(args.mode, args, train, test)
        print(compare_table([result]))
        output = _summary(result)
        results = [result]
    if args.json:
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(output, f, indent=2)
        print(f"[ctr] results written to {path}")
    return results
