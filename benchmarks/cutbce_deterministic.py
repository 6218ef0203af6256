"""What the deterministic positives' gradients cost: `index_put_` (accumulate) against `index_add_`, torch CPU.

The positives' table and bias gradients are summed by `chunked.add_rows`
(`index_put_` with `accumulate`: sorted and summed in a fixed order on CUDA,
where `index_add_` adds with atomics). On CPU both are deterministic; this
times what the change costs there: one chunked BCE training step (loss,
then every gradient) and the positives' part alone (`sparse_terms`), each
way, alternating, at (M, D, V) = (4096, 64, 32768), L = 8, one thread.

    KERAS_BACKEND=torch python benchmarks/cutbce_deterministic.py --repeats 5
"""

import argparse
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
os.environ.setdefault("KERAS_BACKEND", "torch")

from benchmarks.common import alternate, fmt_spread, machine_info, markdown_table, write_results  # noqa: E402


def index_add_rows(out, index, values):
    """The former sum: `index_add_` (atomics on CUDA)."""
    out.index_add_(0, index, values)


def main(argv=None):
    import torch

    from keras_cutbce.backends.torch import chunked, math
    from keras_cutbce.math.coefficients import bce_coefficients
    from keras_cutbce.math.tiling import vocab_tiles

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(4096, 64, 32768))
    parser.add_argument("--targets", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results", "cutbce_deterministic"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, dim, vocab = args.shape
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, dim, generator=gen) * 0.3).requires_grad_()
    e = (torch.randn(vocab, dim, generator=gen) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).requires_grad_()
    ids = torch.randint(0, vocab, (rows, args.targets), generator=gen)
    tiles = vocab_tiles(vocab, args.chunk_size)
    positives = chunked.Positives(ids, tiles)
    family = math.BCE(bce_coefficients())
    scale = torch.rand(rows, generator=gen)

    def step():
        for x in (h, e, b):
            x.grad = None
        chunked.cut_bce(h, e, ids, b, chunk_size=args.chunk_size).mean().backward()
        return e.grad

    def positives_part():
        grads = (torch.zeros(rows, dim), torch.zeros(dim, vocab).T, torch.zeros(vocab))
        chunked.sparse_terms(h.detach(), e.detach(), b.detach(), positives, family, loss=True,
                             row_scale=scale, grads=grads)
        return grads

    results, grads = {}, {}
    for name, add in (("index_add_", index_add_rows), ("index_put_", chunked.add_rows)):
        def cell(fn, add=add):
            def run():
                before, chunked.add_rows = chunked.add_rows, add
                try:
                    return fn()
                finally:
                    chunked.add_rows = before
            return run
        results[f"step {name}"] = cell(step)
        results[f"positives {name}"] = cell(positives_part)
        grads[name] = [g.clone() for g in cell(positives_part)()]
    timed = alternate(results, args.repeats)
    equal = all(torch.equal(x, y) for x, y in zip(grads["index_add_"], grads["index_put_"]))
    table_rows = [dict(cell=name, wall_ms=fmt_spread(t["wall"], 1e3), cpu_ms=fmt_spread(t["cpu"], 1e3))
                  for name, t in timed.items()]
    what = (f"Wall and process CPU ms, median (min-max) of {args.repeats} alternating rounds after a warm-up, "
            f"torch CPU, {args.threads} thread(s), (M, D, V) = {tuple(args.shape)}, L = {args.targets}, "
            f"chunk {args.chunk_size}: `step` is one chunked BCE training step (loss and every "
            "gradient), `positives` the positives' terms and gradients alone (`sparse_terms`), "
            f"summed by `index_add_` (the former way) or `index_put_` (now). The gradients of the two "
            f"ways are bitwise equal: {equal}.")
    info = machine_info(threads=args.threads)
    write_results(args.out, "Deterministic positives' gradients: what they cost on CPU", what, None, info,
                  markdown_table(table_rows, ["cell", "wall_ms", "cpu_ms"]),
                  dict(rows=table_rows, timings={k: {"wall": v["wall"], "cpu": v["cpu"]} for k, v in timed.items()},
                       bitwise_equal=equal))
    print(what)
    print(markdown_table(table_rows, ["cell", "wall_ms", "cpu_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
