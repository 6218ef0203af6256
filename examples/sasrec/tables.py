"""Markdown table of SASRec results (no Keras import, used by `run_all`)."""


def run_name(results):
    """Row name of a run: its loss, with the negatives for `sampled`.

    Example:

    >>> run_name({"loss": "sampled", "num_negatives": 1})
    'sampled (1 neg.)'
    """
    if results.get("loss") == "sampled":
        return f"sampled ({results['num_negatives']} neg.)"
    if results.get("loss") == "sampledsoftmax":
        return results["variant"]
    return results.get("loss", results.get("loss_kind"))


def sasrec_table(results_by_loss):
    """One row per loss run plus the most-popular baseline of the first run.

    Args:
        results_by_loss: `{"cutbce": results, "dense": results, ...}`, each
            a `--json` results dict of `examples.sasrec`.

    Returns:
        A markdown table: hit@8, ndcg@10, recall@10 of the leave-last-8-out
        evaluation (whole catalogue, seen items excluded), training steps/s
        (1 / median step time after 2 warm-up steps) and the process's peak host RSS.

    Example:

    ```python
    print(sasrec_table({"cutbce": json.load(open("runs/sasrec_cutbce.json"))}))
    ```
    """
    lines = [
        "| loss | hit@8 | ndcg@10 | recall@10 | train steps/s | peak RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results_by_loss.items():
        lines.append(
            f"| {name} | {r['hit@8']:.4f} | {r['ndcg@10']:.4f} | {r['recall@10']:.4f} "
            f"| {r['steps_per_second']:.2f} | {r['peak_memory_mb']:.0f} |"
        )
    first = next(iter(results_by_loss.values()))
    lines.append(
        f"| most popular | {first['popularity_hit@8']:.4f} | {first['popularity_ndcg@10']:.4f} "
        f"| {first['popularity_recall@10']:.4f} | - | - |"
    )
    return "\n".join(lines)
