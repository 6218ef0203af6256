"""SASRec with its item table split over torch.distributed ranks: `torchrun -m examples.sasrec.torch_distributed`.

Each rank joins the process group torchrun set up (gloo on CPU, NCCL with a
GPU per rank), builds the model with `vocab_parallel=True` (the table and
its bias a `keras_cutbce.ItemEmbedding` split over the ranks: rank r holds
rows `[r*S, min(V, (r+1)*S))`, `S = ceil(V / R)`; the model an `EraseModel`,
whose step averages the other weights' gradients) and runs the example's
training (`examples.sasrec.train.run`) on its part of every global batch of
`--batch-size` windows; the metrics count every rank's users. Rank 0 prints
the results as one JSON line (with `ranks` and `table_rows_per_rank`).

Example (2 CPU ranks; the arguments are `python -m examples.sasrec`'s, loss
`cutbce`):

```
KERAS_BACKEND=torch torchrun --nproc-per-node 2 -m examples.sasrec.torch_distributed --epochs 3
```
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")


def main(argv=None):
    from examples.sasrec.cli import parse_args

    args = parse_args(sys.argv[1:] if argv is None else argv)  # `--help` before any backend
    import keras
    import torch
    import torch.distributed as dist

    from examples.sasrec.train import run

    if keras.backend.backend() != "torch" or args.loss != "cutbce":
        raise SystemExit("examples.sasrec.torch_distributed runs the torch backend with "
                         f"--loss cutbce. Received: {keras.backend.backend()!r}, {args.loss!r}")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results = run(args, ranks=(rank, world))
        vocab = results["num_items"] + 1
        results["ranks"] = world
        results["table_rows_per_rank"] = -(-vocab // world)
        if rank == 0:
            print(json.dumps(results))
    finally:
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
