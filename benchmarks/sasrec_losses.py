"""Which loss should SASRec train with, and what does it cost? Every loss, one model.

Runs `python -m examples.sasrec` once per (dataset, loss), each in its own process (so peak memory is its own)
under an address-space cap (`--memory-cap-gib`, default 12 GiB), with the same model, seed, batch and
evaluation for every loss:

- `cutbce` (exact full-catalogue BCE, no logits), `dense` (the same BCE through the logits), `sampled` with 1
  negative per target (the original SASRec / keras-rs recipe) and with 256, `softmax` (full-catalogue softmax
  cross-entropy), `cutsoftmax` (the same softmax without logits);
- on MovieLens `ml-latest-small` (`--movielens-dir`, read in place) for `--epochs` epochs, evaluated after
  every epoch (leave-last-8-out, whole catalogue, seen items excluded): the quality comparison;
- on synthetic catalogues of 10^5 and 10^6 items for a few training steps: the cost comparison (steps/s, peak
  RSS, whether it runs at all under the cap). Quality after so few steps is not a result.

Writes a markdown table and JSON to `benchmarks/results/sasrec_losses.{md,json}` and the ndcg@10-per-epoch
curves to `benchmarks/results/sasrec_losses.png`.

With `--seeds N` every (dataset, loss) runs with seeds 0..N-1 and the table gives mean +- sd over the seeds
that trained; each run's row is cached as JSON in `--runs-dir` (default: the output path + `_runs/`), so an
interrupted study resumes where it stopped and the cached runs are the study's raw record.

With `--speed` it runs no study: the training step of dense `softmax` against `cutsoftmax` (and any
`--losses`), side by side, at the study's settings on ml-latest-small and at 10^5 synthetic items. Every cell
is a fresh process (`run_cell`) training `--speed-steps` steps after `--warmup` warm-up steps (compilation),
at `--threads` intra-op threads; its figure is the process CPU seconds per training step (all threads), with
wall seconds per step and the load average beside it. The losses alternate within each round, so load from
other jobs hits each alike; CPU time is less sensitive to that load than wall time. `--steps-1e5 0` leaves out
the synthetic catalogue, no `--movielens-dir` MovieLens. Results:
`benchmarks/results/sasrec_losses_speed.{md,json}`.

Usage (hold the benchmark lock; the 20-epoch seeded study takes hours on 2 cores):

    KERAS_BACKEND=jax python benchmarks/sasrec_losses.py \\
        --movielens-dir ../shared/data/ml-latest-small --epochs 20 --seeds 3
    python benchmarks/sasrec_losses.py --quick     # smoke run, tiny data, results in /tmp
    KERAS_BACKEND=jax python benchmarks/sasrec_losses.py --speed \\
        --movielens-dir ../shared/data/ml-latest-small --rounds 3
"""

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.common import emit_row, machine_info, markdown_table, run_capped, run_cell  # noqa: E402
from benchmarks.common import set_threads, thread_env, write_results  # noqa: E402
from benchmarks.sasrec_study import load_runs, loss_name, parse_losses, plot_curves, run_missing  # noqa: E402
from benchmarks.sasrec_study import speed_summaries, study_table, summarize  # noqa: E402


def run_case(dataset, loss, num_negatives, example_args, args, backend, seed=0):
    """One example run (one seed) in a capped subprocess; returns its results row."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        command = [sys.executable, "-m", "examples.sasrec", "--loss", loss, *example_args,
                   "--json", path, "--verbose", "2", "--seed", str(seed)]
        if loss == "sampled":
            command += ["--num-negatives", str(num_negatives)]
        print("$ " + " ".join(command[1:]), flush=True)
        row = {"dataset": dataset, "loss": loss_name(loss, num_negatives), "seed": seed,
               **run_capped(command, args.memory_cap_gib, args.timeout, dict(os.environ, KERAS_BACKEND=backend))}
        if row["status"] == "ok":
            with open(path) as f:
                result = json.load(f)
            row.update({k: result.get(k) for k in (
                "hit@8", "ndcg@10", "recall@10", "steps_per_second", "peak_memory_mb", "steps",
                "epochs", "num_items", "num_users", "eval_users", "ndcg@10_per_epoch",
                "hit@8_per_epoch", "popularity_hit@8", "popularity_ndcg@10",
                "popularity_recall@10", "train_loss",
            )}, status="trained")
    return row


def datasets(args):
    """`[(name, example arguments)]` of the study."""
    common = ["--batch-size", str(args.batch_size)]
    out = []
    if args.movielens_dir:
        out.append(("ml-latest-small", [
            "--data", "movielens", "--data-dir", os.path.abspath(args.movielens_dir),
            "--max-len", str(args.max_len), "--epochs", str(args.epochs), "--eval-each-epoch",
            *common]))
    for num_items, steps in ((100_000, args.steps_1e5), (1_000_000, args.steps_1e6)):
        if steps:
            out.append((f"synthetic {num_items:,} items", [
                "--num-items", str(num_items), "--num-users", str(args.num_users),
                "--max-len", "30", "--epochs", "1", "--steps-per-epoch", str(steps),
                "--eval-users", str(args.eval_users), *common]))
    return out


# ------------------------------------------------------------------ speed ---
# `--speed`: the parent runs cells; `--speed-cell` (one fresh process) trains and times one.


def speed_cell(argv):
    """One timed example run (`--speed-cell ... -- EXAMPLE ARGS`): prints its `ROW`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("example_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    threads = args.threads or None  # 0: the backend's default
    os.environ.update(thread_env(os.environ, threads))  # before the backend starts
    import keras

    from examples.sasrec.train import parse_args, run

    set_threads(keras.backend.backend(), threads)

    class Clock(keras.callbacks.Callback):
        """Process CPU and wall seconds from the end of the warm-up steps to the last step's end."""

        def __init__(self):
            super().__init__()
            self.marks = []

        def on_train_batch_end(self, batch, logs=None):  # logs arrive as numbers: the step is done
            self.marks.append((time.process_time(), time.perf_counter()))

    clock = Clock()
    load = os.getloadavg()[0]
    example = [a for a in args.example_args if a != "--"]
    result = run(parse_args(example + ["--verbose", "0"]), callbacks=[clock])
    (cpu0, wall0), (cpu1, wall1) = clock.marks[args.warmup - 1], clock.marks[-1]
    steps = len(clock.marks) - args.warmup
    emit_row({"loss": result["loss"], "steps": steps, "cpu_s_per_step": (cpu1 - cpu0) / steps,
              "wall_s_per_step": (wall1 - wall0) / steps, "threads": args.threads,
              "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
              "train_loss": result["train_loss"]})


def speed_cases(args):
    """`[(name, example arguments)]` of `--speed`: the study's settings, a fixed step count."""
    steps = ["--epochs", "1", "--steps-per-epoch", str(args.warmup + args.speed_steps),
             "--batch-size", str(args.batch_size), "--eval-users", "8"]
    if args.quick:
        return [("synthetic 300 items", ["--num-items", "300", "--num-users", "60",
                                         "--max-len", "12", "--dim", "16", "--blocks", "1",
                                         *steps[:-2], "--eval-users", "4"])]
    out = []
    if args.movielens_dir:
        out.append(("ml-latest-small", ["--data", "movielens", "--data-dir",
                                        os.path.abspath(args.movielens_dir),
                                        "--max-len", str(args.max_len), *steps]))
    if args.steps_1e5:
        out.append(("synthetic 100,000 items", ["--num-items", "100000", "--num-users",
                                                str(args.num_users), "--max-len", "30", *steps]))
    return out


def speed(args, backend):
    """`--speed`: every (dataset, loss) cell in fresh processes, the losses alternating; writes the tables."""
    cases = dict(speed_cases(args))
    losses = [loss for loss, _ in args.losses]
    rows = []
    for rep in range(args.rounds):
        for dataset in cases:
            for loss in losses[rep % len(losses):] + losses[:rep % len(losses)]:  # the order rotates
                argv = [os.path.abspath(__file__), "--speed-cell", "--warmup", str(args.warmup), "--threads",
                        str(args.threads), "--", "--loss", loss, *cases[dataset]]
                rows.append(dict(run_cell(argv, dict(os.environ, KERAS_BACKEND=backend)), dataset=dataset, rep=rep))
                print(json.dumps(rows[-1]), flush=True)
    summaries = speed_summaries(rows, losses)
    columns = ["data", "loss", "CPU s / step", "wall s / step", "load (1 min)", "CPU / first loss",
               "wall / first loss", "rounds"]
    threads = (f"{args.threads} intra-op thread(s)" if args.threads
               else "the backend's default intra-op threads")
    info = machine_info(backend=backend, threads=args.threads or "default", warmup_steps=args.warmup,
                        timed_steps=args.speed_steps, batch_size=args.batch_size, rounds=args.rounds)
    write_results(
        args.out, "SASRec training step: dense softmax vs cutsoftmax, side by side",
        f"Each cell a fresh process (`python -m examples.sasrec`'s training, {threads}) "
        f"timing {args.speed_steps} training steps after {args.warmup} "
        "warm-up steps (compilation excluded). CPU s / step: the process's CPU seconds (all "
        "threads) per step, median (min-max) over the rounds; wall s / step likewise; load: "
        "the 1-minute load average at each cell's start, median (min-max). The losses "
        "alternate within every round, so other jobs' load hits each alike; CPU time "
        "is the fair figure on the shared machine. X / first loss: the median over rounds of "
        f"each round's ratio to `{losses[0]}`.",
        None, info, markdown_table(summaries, columns), {"summaries": summaries, "rows": rows})
    return summaries


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--speed-cell"]:
        return speed_cell(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--movielens-dir", default=None,
                        help="folder of ml-latest-small (ratings.csv); None skips MovieLens")
    parser.add_argument("--epochs", type=int, default=4, help="MovieLens epochs (every loss)")
    parser.add_argument("--max-len", type=int, default=50, help="MovieLens sequence length")
    parser.add_argument("--batch-size", type=int, default=64, help="windows per step")
    parser.add_argument("--steps-1e5", type=int, default=20,
                        help="training steps at 10^5 items (0 skips)")
    parser.add_argument("--steps-1e6", type=int, default=6,
                        help="training steps at 10^6 items (0 skips)")
    parser.add_argument("--num-users", type=int, default=1200, help="synthetic users")
    parser.add_argument("--eval-users", type=int, default=200,
                        help="synthetic: users evaluated (quality there is not a result)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per (dataset, loss), seeds 0..N-1; the table gives mean +- sd")
    parser.add_argument("--losses", type=parse_losses,
                        default=parse_losses("cutbce,dense,sampled:1,sampled:256,softmax"),
                        help="losses to run, in this order (sampled:K = K negatives)")
    parser.add_argument("--runs-dir", default=None,
                        help="cache of per-run JSON rows (resume; default: OUT_runs)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report the runs cached in --runs-dir")
    parser.add_argument("--memory-cap-gib", type=float, default=12.0,
                        help="address-space cap of every run")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, results in /tmp")
    parser.add_argument("--speed", action="store_true",
                        help="no study: the training step's CPU time per loss, fresh processes, "
                             "alternating (--losses default softmax,cutsoftmax)")
    parser.add_argument("--rounds", type=int, default=3, help="--speed: rounds of every cell")
    parser.add_argument("--speed-steps", type=int, default=10,
                        help="--speed: timed training steps per cell")
    parser.add_argument("--warmup", type=int, default=2,
                        help="--speed: untimed steps first (compilation)")
    parser.add_argument("--threads", type=int, default=1,
                        help="--speed: intra-op threads of every cell (0: the backend's default)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results",
                                                      "sasrec_losses"),
                        help="output path without extension (.md, .json, .png)")
    args = parser.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "jax")
    if args.speed:
        if args.losses == parser.get_default("losses"):
            args.losses = parse_losses("softmax,cutsoftmax")
        if args.out == parser.get_default("out"):
            args.out = "/tmp/sasrec_losses_speed_quick" if args.quick else args.out + "_speed"
        return speed(args, backend)
    cases = datasets(args)
    if args.quick:
        cases = [("synthetic 300 items", ["--num-items", "300", "--num-users", "60",
                                          "--max-len", "12", "--dim", "16", "--blocks", "1",
                                          "--epochs", "2", "--steps-per-epoch", "3",
                                          "--batch-size", "16", "--eval-each-epoch"])]
        if args.out == parser.get_default("out"):
            args.out = "/tmp/sasrec_losses_quick"
    runs_dir = args.runs_dir or args.out + "_runs"
    start = time.perf_counter()
    if not args.report_only:
        run_missing(runs_dir, args.seeds, cases, args.losses,
                    lambda dataset, loss, negatives, example_args, seed:
                    run_case(dataset, loss, negatives, example_args, args, backend, seed))
    rows = load_runs(runs_dir)
    summaries = summarize(rows)
    info = machine_info(
        backend=backend, epochs=args.epochs, max_len=args.max_len, batch_size=args.batch_size,
        seeds=args.seeds, steps_1e5=args.steps_1e5, steps_1e6=args.steps_1e6,
        memory_cap_gib=args.memory_cap_gib, runs=len(rows),
        total_seconds=round(time.perf_counter() - start),
        run_seconds=round(sum(r.get("wall_seconds", 0) for r in rows)))
    what = (
        "hit@8, ndcg@10, recall@10: leave-last-8-out (each user's last 8 items held out, the "
        "whole catalogue ranked, items the user has seen excluded), after the last epoch; mean "
        "+- sample sd over the seeds that trained (seeds: how many). train steps/s: 1 / median "
        "step time after 2 warm-up steps; steps/s, peak RSS (the whole process, host) and wall "
        "time (start-up, data, training, evaluation) are medians over the seeds. Each run in its "
        f"own process, capped at {args.memory_cap_gib:g} GiB of address space. On the synthetic "
        "catalogues a run is only a few steps: its metrics are not a quality result, only its "
        "cost and whether it runs. Every run's row (seed, load average at its end) is in "
        f"`{os.path.relpath(runs_dir, REPO)}/`.")
    errors = [f"- {r['dataset']}, {r['loss']}: `{r['error']}`" for r in summaries if "error" in r]
    table = study_table(summaries) + ("\n\nErrors:\n\n" + "\n".join(errors) if errors else "")
    write_results(args.out, "SASRec: every loss, same model, same data, same evaluation", what, None, info, table,
                  {"summaries": summaries, "runs": rows})
    curves = [r["dataset"] for r in summaries if r.get("ndcg@10_per_epoch")]
    if curves:
        print(f"wrote {plot_curves(summaries, args.out + '.png', curves[0])}")
    return summaries


if __name__ == "__main__":
    main()
