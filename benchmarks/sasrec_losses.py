"""Which loss should SASRec train with, and what does it cost? `python -m examples.sasrec` per (seed, dataset,
loss) in capped processes, runs cached (docs/benchmarks.md); `--speed`: the training step side by side;
`--sampled`: `SampledSoftmaxLoss`'s `--variants` beside the exact losses.

    KERAS_BACKEND=jax python benchmarks/sasrec_losses.py --movielens-dir DIR --epochs 20 --seeds 3
    KERAS_BACKEND=jax python benchmarks/sasrec_losses.py --speed|--sampled --movielens-dir DIR
    python benchmarks/sasrec_losses.py --quick     # smoke run, tiny data, results in /tmp
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import REPO, RESULTS, emit_row, machine_info, markdown_table, read_json, run_capped  # noqa: E402
from benchmarks.common import run_cell, set_threads, step_clock, thread_env, write_json, write_results  # noqa: E402
from benchmarks.sasrec_study import load_runs, loss_name, parse_losses, plot_curves, run_missing  # noqa: E402
from benchmarks.sasrec_study import speed_summaries, study_table, summarize  # noqa: E402

RESULT_KEYS = ("hit@8", "ndcg@10", "recall@10", "steps_per_second", "peak_memory_mb", "steps", "epochs",
               "num_items", "num_users", "eval_users", "ndcg@10_per_epoch", "hit@8_per_epoch", "popularity_hit@8",
               "popularity_ndcg@10", "popularity_recall@10", "train_loss")
TINY = ["--num-items", "300", "--num-users", "60", "--max-len", "12", "--dim", "16", "--blocks", "1"]


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
            result = read_json(path)
            row.update({k: result.get(k) for k in RESULT_KEYS}, status="trained")
    return row


def datasets(args):
    """`[(name, example arguments)]` of the study (`--quick`: a tiny synthetic one)."""
    if args.quick:
        return [("synthetic 300 items", TINY + ["--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "16",
                                                "--eval-each-epoch"])]
    batch, out = ["--batch-size", str(args.batch_size)], []
    if args.movielens_dir:
        out.append(("ml-latest-small", ["--data", "movielens", "--data-dir", os.path.abspath(args.movielens_dir),
                                        "--max-len", str(args.max_len), "--epochs", str(args.epochs),
                                        "--eval-each-epoch", *batch]))
    for num_items, steps in ((100_000, args.steps_1e5), (1_000_000, args.steps_1e6)):
        if steps:
            out.append((f"synthetic {num_items:,} items", [
                "--num-items", str(num_items), "--num-users", str(args.num_users), "--max-len", "30", "--epochs",
                "1", "--steps-per-epoch", str(steps), "--eval-users", str(args.eval_users), *batch]))
    return out


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
    clock = step_clock()
    load = os.getloadavg()[0]
    example = [a for a in args.example_args if a != "--"]
    result = run(parse_args(example + ["--verbose", "0"]), callbacks=[clock])
    (cpu0, wall0), (cpu1, wall1) = clock.ends[args.warmup - 1], clock.ends[-1]
    steps = len(clock.ends) - args.warmup
    emit_row({"loss": result["loss"], "steps": steps, "cpu_s_per_step": (cpu1 - cpu0) / steps,
              "wall_s_per_step": (wall1 - wall0) / steps, "threads": args.threads,
              "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
              "train_loss": result["train_loss"]})


def speed_cases(args):
    """`[(name, example arguments)]` of `--speed`: the study's settings, a fixed step count."""
    steps = ["--epochs", "1", "--steps-per-epoch", str(args.warmup + args.speed_steps),
             "--batch-size", str(args.batch_size)]
    if args.quick:
        return [("synthetic 300 items", TINY + steps + ["--eval-users", "4"])]
    out = []
    if args.movielens_dir:
        out.append(("ml-latest-small", ["--data", "movielens", "--data-dir", os.path.abspath(args.movielens_dir),
                                        "--max-len", str(args.max_len), *steps, "--eval-users", "8"]))
    if args.steps_1e5:
        out.append(("synthetic 100,000 items", ["--num-items", "100000", "--num-users", str(args.num_users),
                                                "--max-len", "30", *steps, "--eval-users", "8"]))
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


SAMPLED = ["--loss", "sampledsoftmax", "--num-negatives"]
VARIANTS = {  # uniform without logQ is uniform with it: a constant shift of every logit
    "cutsoftmax": ["--loss", "cutsoftmax"],
    "cutbce": ["--loss", "cutbce"],
    "s256-uniform": SAMPLED + ["256"],
    "s4096-uniform": SAMPLED + ["4096"],
    "s256-popularity": SAMPLED + ["256", "--sampler", "popularity"],
    "s256-popularity-nologq": SAMPLED + ["256", "--sampler", "popularity", "--no-logq-correction"],
    "s4096-popularity": SAMPLED + ["4096", "--sampler", "popularity"],
    "s4096-popularity-nologq": SAMPLED + ["4096", "--sampler", "popularity", "--no-logq-correction"],
    "in-batch": SAMPLED + ["0", "--in-batch-negatives"],
}
SAMPLED_COLUMNS = ["variant", "epochs", "hit@10", "ndcg@10", "mrr", "hit@8", "steps/s", "peak RSS (MiB)",
                   "wall (s)", "load before", "load after"]


def sampled_run(name, args, path):
    """One `--sampled` variant's example run (its JSON, with the load before and after), cached at `path`."""
    if os.path.exists(path):
        return read_json(path)
    if args.synthetic_items:
        data = ["--data", "synthetic", "--num-items", str(args.synthetic_items), "--num-users", "300",
                "--steps-per-epoch", str(args.synthetic_steps), "--eval-users", "50"]
    else:
        data = ["--data", "movielens", "--data-dir", os.path.abspath(args.movielens_dir)]
    command = [sys.executable, "-m", "examples.sasrec", *data, *VARIANTS[name], "--epochs", str(args.epochs),
               "--max-len", str(args.max_len), "--seed", "0", "--json", path]
    before = os.getloadavg()[0]
    done = run_capped(command, args.memory_cap_gib, args.timeout)
    if done["status"] != "ok":
        print(done.get("error", ""), file=sys.stderr)
        return {"variant": name, "status": done["status"]}
    row = dict(read_json(path), variant=name, load_before=before, load_after=os.getloadavg()[0])
    write_json(path, row)
    return row


def sampled_table_row(row):
    if "status" in row:
        return {"variant": row["variant"], "epochs": row["status"]}
    return {"variant": row["variant"], "epochs": row["epochs"], "hit@10": round(row["hit@10"], 4),
            "ndcg@10": round(row["ndcg@10"], 4), "mrr": round(row["mrr"], 4),
            "hit@8": round(row["hit@8"], 4), "steps/s": round(row["steps_per_second"], 3),
            "peak RSS (MiB)": round(row["peak_memory_mb"]), "wall (s)": round(row["wall_seconds"]),
            "load before": round(row.get("load_before", float("nan")), 1),
            "load after": round(row.get("load_after", float("nan")), 1)}


def sampled(args):
    """`--sampled`: every variant, one after the other (cached runs kept); writes the table."""
    prefix = args.out + (f"_{args.synthetic_items}" if args.synthetic_items else "")
    os.makedirs(prefix + "_runs", exist_ok=True)
    rows = []
    for name in args.variants:
        start = time.time()
        rows.append(sampled_run(name, args, os.path.join(prefix + "_runs", name + ".json")))
        print(f"[sampled] {name}: {time.time() - start:.0f} s", sampled_table_row(rows[-1]), flush=True)
    data = f"synthetic {args.synthetic_items} items" if args.synthetic_items else "ml-latest-small"
    what = (f"SASRec on {data}, one seed (0), {args.epochs} epoch(s), batch 64, max-len {args.max_len}, "
            "jax; hit@k / ndcg@10 / MRR over the whole catalogue (seen items excluded), exact metrics; "
            "steps/s: 1 / median step time after 2 warm-up steps; load: 1-minute load average.")
    write_results(prefix, "Sampled softmax vs the exact losses (SASRec)", what, None, machine_info(),
                  markdown_table([sampled_table_row(r) for r in rows], SAMPLED_COLUMNS), {"runs": rows})


def study(args, backend):
    """The study: every missing (seed, dataset, loss) run, then the table and curves of all cached runs."""
    cases = datasets(args)
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
        memory_cap_gib=args.memory_cap_gib, runs=len(rows), total_seconds=round(time.perf_counter() - start),
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


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--movielens-dir", default=None,
                        help="folder of ml-latest-small (ratings.csv); None skips MovieLens")
    for flag, default, what in (
            ("--epochs", 4, "MovieLens epochs (every loss)"), ("--max-len", 50, "MovieLens sequence length"),
            ("--batch-size", 64, "windows per step"), ("--num-users", 1200, "synthetic users"),
            ("--steps-1e5", 20, "training steps at 10^5 items (0 skips)"),
            ("--steps-1e6", 6, "training steps at 10^6 items (0 skips)"),
            ("--eval-users", 200, "synthetic: users evaluated (quality there is not a result)"),
            ("--seeds", 1, "runs per (dataset, loss), seeds 0..N-1; the table gives mean +- sd"),
            ("--timeout", None, "seconds per run (None: 900; --sampled: 3600)"),
            ("--rounds", 3, "--speed: rounds of every cell"), ("--speed-steps", 10, "--speed: timed steps a cell"),
            ("--warmup", 2, "--speed: untimed steps first (compilation)"),
            ("--threads", 1, "--speed: intra-op threads of every cell (0: the backend's default)"),
            ("--synthetic-items", 0, "--sampled: a synthetic catalogue of N items instead of MovieLens"),
            ("--synthetic-steps", 6, "--sampled --synthetic-items: training steps")):
        parser.add_argument(flag, type=int, default=default, help=what)
    parser.add_argument("--losses", type=parse_losses,
                        default=parse_losses("cutbce,dense,sampled:1,sampled:256,softmax"), help="losses to run, in this order (sampled:K = K negatives)")
    parser.add_argument("--runs-dir", default=None, help="cache of per-run JSON rows (resume; default: OUT_runs)")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report the cached runs")
    parser.add_argument("--memory-cap-gib", type=float, default=12.0, help="address-space cap of every run")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run, results in /tmp")
    parser.add_argument("--speed", action="store_true", help="no study: the training step's CPU time per loss, "
                                                             "fresh processes, alternating (default softmax,cutsoftmax)")
    parser.add_argument("--sampled", action="store_true",
                        help="no study: sampled softmax variants beside the exact losses (one seed)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                        help="--sampled: the variants, in this order")
    parser.add_argument("--out", default=os.path.join(RESULTS, "sasrec_losses"),
                        help="output path without extension (.md, .json, .png)")
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--speed-cell"]:
        return speed_cell(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "jax")
    args.timeout = args.timeout or (3600 if args.sampled else 900)
    default_out = args.out == parser.get_default("out")
    if args.sampled:
        if not (args.movielens_dir or args.synthetic_items):
            parser.error("--sampled needs --movielens-dir or --synthetic-items")
        args.out = os.path.join(RESULTS, "sasrec_sampled") if default_out else args.out
        return sampled(args)
    if args.speed:
        if args.losses == parser.get_default("losses"):
            args.losses = parse_losses("softmax,cutsoftmax")
        if default_out:
            args.out = "/tmp/sasrec_losses_speed_quick" if args.quick else args.out + "_speed"
        return speed(args, backend)
    if args.quick and default_out:
        args.out = "/tmp/sasrec_losses_quick"
    return study(args, backend)


if __name__ == "__main__":
    main()
