"""The command line of `python -m examples.ctr`, without Keras.

Parsing imports no backend, so `--help` and usage errors are immediate
(`examples/ctr/__main__.py` parses before it imports the training code,
`train.py`, which re-exports `MODES` and `build_parser`).
"""

from examples import (add_run_arguments, example_parser, non_negative_int, output_path,
                      positive_float, positive_int)

DESCRIPTION = "Train the CTR model with ERASE: `python -m examples.ctr`."

MODES = (
    "baseline",
    "detached",
    "erase-auto",
    "erase-blocking",
    "erase-threaded",
    "erase-streams",
    "erase-graphs",
)


def build_parser():
    parser = example_parser("python -m examples.ctr", DESCRIPTION)
    parser.add_argument("--mode", choices=MODES, default="erase-auto",
                        help="model and schedule: baseline (no detachment), detached (standard "
                             "step), erase-auto (every backend: on CUDA times the schedules and "
                             "keeps the fastest, elsewhere the standard step), erase-blocking and "
                             "erase-threaded (torch), erase-streams and erase-graphs (torch + CUDA)")
    parser.add_argument("--compare", action="store_true",
                        help="run every available mode and print the comparison table")
    parser.add_argument("--plot", type=output_path, default="ctr_ne.png",
                        help="--compare: PNG of the training NE per step and mode; a relative "
                             "path is inside the output folder runs/ at the repository root")
    parser.add_argument("--data", choices=["synthetic", "criteo"], default="synthetic",
                        help="dataset")
    parser.add_argument("--data-dir", default=None, help="Criteo TSV file or folder")
    parser.add_argument("--num-examples", type=positive_int, default=60_000,
                        help="synthetic examples (train + test), or max Criteo rows")
    parser.add_argument("--buckets", type=positive_int, default=1000,
                        help="hashed ids per feature")
    parser.add_argument("--embedding-dim", type=positive_int, default=16,
                        help="categorical embedding width")
    parser.add_argument("--width", type=positive_int, default=128, help="tower width")
    parser.add_argument("--depth", type=positive_int, default=3, help="tower depth")
    parser.add_argument("--batch-size", type=positive_int, default=512, help="examples per step")
    parser.add_argument("--epochs", type=positive_int, default=1, help="training epochs")
    parser.add_argument("--steps-per-epoch", type=positive_int, default=None,
                        help="cap on steps per epoch (None: the whole training split)")
    parser.add_argument("--learning-rate", type=positive_float, default=1e-3,
                        help="Adam learning rate")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10,
                        help="first steps left out of the throughput (must be fewer than the "
                             "training steps)")
    parser.add_argument("--seeds", type=positive_int, default=1,
                        help="training runs per mode (seeds --seed, --seed + 1, ...; same data): "
                             "NE and AUC reported as mean +- sd, the NE gap on the means")
    parser.add_argument("--interleave-steps", type=positive_int, default=10,
                        help="--compare: steps each mode trains in turn (one repeat) while "
                             "all modes train in one process, timed alternating")
    parser.add_argument("--nproc", type=positive_int, default=1,
                        help="torch: N local gloo ranks, data parallel; global QPS per step is "
                             "N * batch / the slowest rank's step time")
    add_run_arguments(parser)
    return parser
