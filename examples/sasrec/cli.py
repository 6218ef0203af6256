"""The command line of `python -m examples.sasrec`, without Keras.

Parsing imports no backend, so `--help` and usage errors are immediate
(`examples/sasrec/__main__.py` parses before it imports the training code,
`train.py`).
"""

import os

from examples import (
    add_run_arguments,
    example_parser,
    positive_float,
    positive_int,
    unit_interval,
)

LOSSES = ("cutbce", "dense", "sampled", "softmax", "cutsoftmax", "sampledsoftmax")
DESCRIPTION = (
    "Train and evaluate the multi-label SASRec: every non-padding position predicts its next "
    "8 items; each user's last 8 items are held out and ranked against the whole catalogue, "
    "beside the most-popular-items baseline."
)


def build_parser():
    parser = example_parser("python -m examples.sasrec", DESCRIPTION)
    parser.add_argument("--loss", choices=LOSSES, default="cutbce",
                        help="cutbce: exact full-catalogue BCE without logits; dense: the same "
                             "BCE through the full logits; sampled: BCE on each positive and "
                             "--num-negatives uniform negatives; softmax: full-catalogue "
                             "softmax cross-entropy; cutsoftmax: that softmax without "
                             "logits (keras_cutbce's CutSoftmaxLoss op); sampledsoftmax: "
                             "keras_cutbce.SampledSoftmaxLoss, --num-negatives shared negatives")
    parser.add_argument("--num-negatives", type=int, default=1,
                        help="--loss sampled: negatives per target (1: the SASRec recipe); "
                             "sampledsoftmax: negatives per step (0: in-batch only)")
    parser.add_argument("--sampler", choices=["uniform", "popularity"], default="uniform",
                        help="--loss sampledsoftmax: uniform, or by training frequency")
    parser.add_argument("--no-logq-correction", action="store_true",
                        help="--loss sampledsoftmax: no logQ correction")
    parser.add_argument("--in-batch-negatives", action="store_true",
                        help="--loss sampledsoftmax: the batch's targets are negatives too")
    parser.add_argument("--data", choices=["synthetic", "movielens", "yambda"],
                        default="synthetic", help="dataset")
    parser.add_argument("--data-dir", default=None,
                        help="folder with the real data files (movielens: None downloads "
                             "ml-latest-small)")
    parser.add_argument("--num-items", type=positive_int, default=2000,
                        help="synthetic catalogue size")
    parser.add_argument("--num-users", type=positive_int, default=1200, help="synthetic users")
    parser.add_argument("--epochs", type=positive_int, default=10, help="training epochs")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="windows per step")
    parser.add_argument("--max-len", type=positive_int, default=30,
                        help="sequence length (items per input window)")
    parser.add_argument("--dim", type=positive_int, default=64,
                        help="embedding and hidden width (even: 2 attention heads)")
    parser.add_argument("--blocks", type=positive_int, default=2, help="transformer blocks")
    parser.add_argument("--learning-rate", type=positive_float, default=5e-3,
                        help="Adam learning rate")
    parser.add_argument("--pos-weight", type=positive_float, default=1.0,
                        help="weight of the positive BCE terms (cutbce and dense)")
    parser.add_argument("--dropout", type=unit_interval, default=0.2, help="dropout rate")
    parser.add_argument("--steps-per-epoch", type=positive_int, default=None,
                        help="cap on steps per epoch (quick runs; None: the whole data)")
    parser.add_argument("--eval-each-epoch", action="store_true",
                        help="evaluate after every epoch (adds the per-epoch metrics to --json)")
    parser.add_argument("--eval-users", type=positive_int, default=None,
                        help="evaluate the first N users only (None: all)")
    add_run_arguments(parser)
    return parser


def parse_args(argv=None):
    """Parses and checks the arguments (errors exit with a usage message)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dim % 2:
        parser.error(f"--dim must be even (two attention heads), got {args.dim}")
    sampled = args.loss in ("sampled", "sampledsoftmax")
    if not sampled and args.num_negatives != 1:
        parser.error("--num-negatives applies to --loss sampled and sampledsoftmax only")
    if args.num_negatives < (0 if args.in_batch_negatives else 1):
        parser.error(f"--num-negatives must be >= 1 (0 with --in-batch-negatives), got {args.num_negatives}")
    if args.data == "synthetic" and args.num_items < 2:
        parser.error("--num-items must be >= 2")
    if args.data == "yambda" and args.data_dir is None:
        parser.error("--data yambda needs --data-dir DIR (a folder of Yambda parquet files)")
    if args.data != "synthetic" and args.data_dir is not None and not os.path.isdir(args.data_dir):
        parser.error(f"--data-dir must be an existing folder, got {args.data_dir!r}")
    return args
