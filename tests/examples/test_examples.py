"""The examples (SASRec with CutBCELoss, CTR with ERASE) end to end on tiny data.

Every test runs on the active Keras backend; the loaders are tested on small
files written here in the real formats.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from examples.ctr import data as ctr_data
from examples.sasrec import data as seq_data

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SASREC_KEYS = {"loss", "num_negatives", "train_loss", "hit@8", "ndcg@10", "recall@10",
               "popularity_hit@8", "steps_per_second", "peak_memory_mb", "num_items"}
CTR_KEYS = {"mode", "ne", "auc", "qps_p50", "qps_p90", "steps"}
TINY_SASREC = ["--num-users", "40", "--num-items", "150", "--epochs", "1",
               "--steps-per-epoch", "3", "--batch-size", "16", "--max-len", "12",
               "--dim", "16", "--blocks", "1", "--verbose", "0"]
TINY_CTR = ["--num-examples", "1200", "--batch-size", "128", "--buckets", "50",
            "--embedding-dim", "4", "--width", "16", "--depth", "2",
            "--steps-per-epoch", "4", "--warmup-steps", "1", "--verbose", "0"]


def _has_metrics():
    return importlib.util.find_spec("keras_cutbce.metrics") is not None


needs_metrics = pytest.mark.skipif(
    not _has_metrics(), reason="keras_cutbce.metrics (TopKRetrieval) not available yet"
)


# ----------------------------------------------------------------------------- SASRec data


def test_synthetic_sequences_ids_order_and_seed():
    a = seq_data.synthetic_sequences(num_users=50, num_items=300, seed=3)
    b = seq_data.synthetic_sequences(num_users=50, num_items=300, seed=3)
    c = seq_data.synthetic_sequences(num_users=50, num_items=300, seed=4)
    assert len(a) == 50
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))
    for s in a:
        assert s.dtype == np.int32 and s.min() >= 1 and s.max() <= 300
        assert len(np.unique(s)) == len(s)  # each user sees an item once


def test_synthetic_popularity_is_skewed():
    seqs = seq_data.synthetic_sequences(num_users=400, num_items=500, seed=0)
    counts = np.sort(seq_data.item_counts(seqs, 500)[1:])[::-1]
    assert counts[:50].sum() > 4 * counts[-50:].sum()  # top decile vs bottom decile (uniform: ~1x)


def test_split_training_and_evaluation_arrays():
    seq = np.arange(1, 21, dtype=np.int32)  # 20 items
    train, held = seq_data.split_leave_last_out([seq, np.array([5, 6], np.int32)], holdout=8)
    assert len(train) == 1  # the 2-item user is dropped
    np.testing.assert_array_equal(held[0], np.arange(13, 21))
    x, y, w = seq_data.training_arrays(train, max_len=5, num_targets=3)
    # windows from the end: [8..12], [3..7], [0, 0, 0, 1, 2]
    np.testing.assert_array_equal(x[0], [8, 9, 10, 11, 12])
    np.testing.assert_array_equal(x[2], [0, 0, 0, 1, 2])
    np.testing.assert_array_equal(y[0, 0], [9, 10, 11])
    np.testing.assert_array_equal(y[0, 3], [12, -1, -1])  # never a held-out item
    np.testing.assert_array_equal(y[0, 4], [-1, -1, -1])
    np.testing.assert_array_equal(w[0], [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(w[2], [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(y[1, -1], [8, 9, 10])  # targets cross the window
    assert y.max() <= 12
    inputs, held_out, seen = seq_data.evaluation_arrays(train, held, max_len=5)
    np.testing.assert_array_equal(inputs[0], [8, 9, 10, 11, 12])
    assert set(seen[0][seen[0] >= 0]) == set(range(0, 13))


def _write_ratings(tmp_path, kind):
    rows = [  # user, item, rating, time (out of order on purpose)
        (7, 50, 4.0, 300), (7, 10, 3.5, 100), (7, 30, 5.0, 200),
        (2, 30, 1.0, 20), (2, 999, 2.0, 10),
        (9, 10, 4.0, 5),
    ]
    if kind == "csv":
        path = tmp_path / "ratings.csv"
        path.write_text("userId,movieId,rating,timestamp\n"
                        + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows))
    else:
        sub = tmp_path / "ml-1m"
        sub.mkdir()
        path = sub / "ratings.dat"
        path.write_text("".join(f"{u}::{i}::{int(r)}::{t}\n" for u, i, r, t in rows))
    return tmp_path


@pytest.mark.parametrize("kind", ["csv", "dat"])
def test_movielens_loader(tmp_path, kind):
    folder = _write_ratings(tmp_path, kind)
    sequences, num_items = seq_data.load_movielens(str(folder), min_interactions=2)
    assert num_items == 4  # movies 10, 30, 50, 999 -> ids 1..4
    # users sorted by id: 2 then 7 (9 has a single rating and is dropped)
    assert [s.tolist() for s in sequences] == [[4, 2], [1, 2, 3]]


def test_movielens_download_fails_clearly_offline(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("Temporary failure in name resolution")

    monkeypatch.setattr(keras.utils, "get_file", offline)
    with pytest.raises(RuntimeError, match="--data-dir"):
        seq_data.load_movielens(None)


def test_yambda_loader(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        with pytest.raises(ImportError, match="pyarrow"):
            seq_data.load_yambda(str(tmp_path))
        return
    table = pa.table({"uid": [1, 1, 1, 2, 2], "item_id": [500, 7, 500, 7, 8],
                      "timestamp": [30, 10, 20, 2, 1], "played_ratio_pct": [1, 2, 3, 4, 5]})
    pq.write_table(table, tmp_path / "listens.parquet")
    sequences, num_items = seq_data.load_yambda(str(tmp_path), min_interactions=2)
    assert num_items == 3
    assert [s.tolist() for s in sequences] == [[1, 3, 3], [2, 1]]


# ----------------------------------------------------------------------------- SASRec model


@pytest.mark.slow
def test_sasrec_forward_shape_and_causality():
    from examples.sasrec.model import build_sasrec

    keras.utils.set_random_seed(0)
    model = build_sasrec(num_items=30, max_len=6, dim=8, num_blocks=1, dropout=0.0)
    a = np.array([[0, 0, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]], np.int32)
    b = a.copy()
    b[:, -1] = 29  # change the last item only
    ha = keras.ops.convert_to_numpy(model(a, training=False))
    hb = keras.ops.convert_to_numpy(model(b, training=False))
    assert ha.shape == (2, 6, 8)
    np.testing.assert_allclose(ha[:, :-1], hb[:, :-1], atol=1e-5)
    assert np.abs(ha[:, -1] - hb[:, -1]).max() > 1e-4
    assert model.get_layer("items").embeddings.shape == (31, 8)
    bias = keras.ops.convert_to_numpy(model.get_layer("item_bias").bias)
    np.testing.assert_allclose(bias, np.full(31, np.log(8 / 30)), rtol=1e-6)  # prior log-odds


@pytest.mark.slow
def test_padding_keys_are_masked():
    from examples.sasrec.model import build_sasrec

    keras.utils.set_random_seed(1)
    model = build_sasrec(num_items=30, max_len=5, dim=8, num_blocks=1, dropout=0.0)
    base = np.array([[0, 0, 3, 4, 5]], np.int32)
    # Item embeddings of row 0 change -> padded inputs must not see it.
    items = model.get_layer("items")
    before = keras.ops.convert_to_numpy(model(base, training=False))[0, 2:]
    table = keras.ops.convert_to_numpy(items.embeddings).copy()
    table[0] += 5.0
    items.embeddings.assign(table)
    after = keras.ops.convert_to_numpy(model(base, training=False))[0, 2:]
    np.testing.assert_allclose(before, after, atol=1e-5)


@pytest.mark.slow
def test_sasrec_with_cut_loss_round_trips_through_keras_file(tmp_path):
    from keras_cutbce import CutBCELoss

    from examples.sasrec.model import build_sasrec

    keras.utils.set_random_seed(2)
    model = build_sasrec(num_items=40, max_len=6, dim=8, num_blocks=1, dropout=0.0)
    bias = model.get_layer("item_bias").bias
    model.compile(optimizer="adam", loss=CutBCELoss(model.get_layer("items"), bias))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 41, size=(16, 6)).astype("int32")
    y = rng.integers(-1, 41, size=(16, 6, 8)).astype("int32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    trained_bias = keras.ops.convert_to_numpy(bias)
    assert np.abs(trained_bias - np.log(8 / 40)).max() > 1e-4  # the bias trains through the loss
    path = str(tmp_path / "sasrec.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded.get_layer("item_bias").bias), trained_bias
    )
    assert loaded.loss.bias is loaded.get_layer("item_bias").bias  # re-bound, not a copy
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded.evaluate(x, y, verbose=0, return_dict=True)["loss"]),
        keras.ops.convert_to_numpy(model.evaluate(x, y, verbose=0, return_dict=True)["loss"]),
        rtol=1e-5,
    )


@pytest.mark.parametrize("pos_weight,use_bias", [(1.0, False), (7.5, False), (3.0, True)])
def test_dense_loss_matches_cut_loss(pos_weight, use_bias):
    from keras_cutbce import CutBCELoss

    from examples.sasrec.model import DenseBCELoss

    rng = np.random.default_rng(0)
    items = keras.layers.Embedding(23, 6)
    items.build((None,))
    hidden = rng.normal(size=(3, 4, 6)).astype("float32")
    targets = rng.integers(-1, 23, size=(3, 4, 8)).astype("int32")
    targets[0, 0] = -1  # a position without targets
    targets[1, 1, :3] = 5  # duplicates count once
    weights = (rng.random((3, 4)) > 0.3).astype("float32")
    bias = keras.Variable(rng.normal(size=(23,)).astype("float32")) if use_bias else None
    dense = DenseBCELoss(items, bias=bias, pos_weight=pos_weight)
    cut = CutBCELoss(items, bias=bias, pos_weight=pos_weight)
    dense = dense(targets, hidden, sample_weight=weights)
    cut = cut(targets, hidden, sample_weight=weights)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(dense), keras.ops.convert_to_numpy(cut), rtol=1e-5, atol=1e-6
    )


# ----------------------------------------------------------------------------- popularity


def test_popularity_metrics_by_hand():
    from examples.sasrec.train import popularity_metrics

    counts = np.array([0, 50, 40, 30, 20, 10, 5, 4, 3, 2, 1, 0])  # id 0 = padding
    held = np.array([[2, 9], [4, -1]])
    seen = np.array([[0, 1, -1], [0, 2, 3]])
    # user 0 ranking: 2 3 4 5 6 7 8 9 10 11 ; user 1: 1 4 5 ...
    out = popularity_metrics(counts, held, seen, ks=(1, 8))
    assert out["hit@1"] == pytest.approx(0.5)  # user 0 hits at rank 1, user 1 misses
    assert out["hit@8"] == pytest.approx(1.0)
    assert out["recall@8"] == pytest.approx((2 / 2 + 1) / 2)
    ndcg0 = (1 + 1 / np.log2(9)) / (1 + 1 / np.log2(3))
    ndcg1 = (1 / np.log2(3)) / 1
    assert out["ndcg@8"] == pytest.approx((ndcg0 + ndcg1) / 2)


@needs_metrics
@pytest.mark.slow
def test_popularity_metrics_agree_with_top_k_retrieval():
    from keras_cutbce.metrics import TopKRetrieval

    from examples.sasrec.train import popularity_metrics

    seqs = seq_data.synthetic_sequences(num_users=60, num_items=200, seed=5)
    train, held = seq_data.split_leave_last_out(seqs)
    _, held_out, seen = seq_data.evaluation_arrays(train, held, max_len=10)
    counts = seq_data.item_counts(train, 200)
    ours = popularity_metrics(counts, held_out, seen)
    table = keras.Variable(counts.astype("float32")[:, None])
    metric = TopKRetrieval(table, k=(8, 10), exclude_ids=[0])
    metric.update_state(held_out, np.ones((len(held_out), 1), "float32"), exclude_ids=seen)
    theirs = {k: float(keras.ops.convert_to_numpy(v)) for k, v in metric.result().items()}
    for key in ("hit@8", "recall@8", "ndcg@10", "recall@10"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key


# ----------------------------------------------------------------------------- SASRec end to end


@needs_metrics
@pytest.mark.parametrize("loss", ["cutbce", "dense", "sampled", "softmax", "cutsoftmax", "sampledsoftmax"])
@pytest.mark.slow
def test_sasrec_end_to_end(tmp_path, loss):
    from examples.sasrec.train import main

    path = tmp_path / "sasrec.json"
    results = main(TINY_SASREC + ["--loss", loss, "--json", str(path)])
    written = json.loads(path.read_text())
    assert SASREC_KEYS <= set(written)
    assert written["loss"] == loss
    assert written["num_negatives"] == (1 if loss == "sampled" else None)
    assert written["num_items"] == 150 and written["steps"] == 3
    assert np.isfinite(written["train_loss"]) and written["train_loss"] > 0
    for key in ("hit@8", "hit@10", "mrr", "ndcg@10", "recall@10", "popularity_hit@8"):
        assert 0.0 <= written[key] <= 1.0
    assert written["peak_memory_mb"] > 10 and written["steps_per_second"] > 0
    assert results["hit@8"] == written["hit@8"]


@needs_metrics
@pytest.mark.slow
def test_sasrec_on_movielens_files(tmp_path):
    from examples.sasrec.train import main

    rng = np.random.default_rng(0)
    lines = ["userId,movieId,rating,timestamp"]
    for user in range(1, 25):
        for t, movie in enumerate(rng.choice(np.arange(1, 400, 3), size=20, replace=False)):
            lines.append(f"{user},{movie},4.0,{1000 + t}")
    (tmp_path / "ratings.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "ml.json"
    main(TINY_SASREC + ["--data", "movielens", "--data-dir", str(tmp_path), "--loss", "dense",
                        "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["data"] == "movielens" and written["num_items"] <= 133


# ----------------------------------------------------------------------------- CTR data


def test_synthetic_ctr_shapes_and_rate():
    data = ctr_data.synthetic_ctr(20000, buckets=100, seed=0)
    assert data["dense"].shape == (20000, 13) and data["dense"].dtype == np.float32
    assert data["sparse"].shape == (20000, 26)
    offsets = np.arange(26) * 100
    assert ((data["sparse"] >= offsets) & (data["sparse"] < offsets + 100)).all()
    ctr = data["label"].mean()
    assert 0.03 <= ctr <= 0.25
    again = ctr_data.synthetic_ctr(20000, buckets=100, seed=0)
    np.testing.assert_array_equal(again["sparse"], data["sparse"])
    np.testing.assert_array_equal(again["label"], data["label"])
    other = ctr_data.synthetic_ctr(20000, buckets=100, seed=1)
    assert abs(other["label"].mean() - ctr) < 0.02  # same teacher, same rate


def _write_criteo(path, rows=40, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for r in range(rows):
        fields = [str(int(rng.random() < 0.3))]
        for i in range(13):
            fields.append("" if rng.random() < 0.2 else str(int(rng.integers(-2, 500))))
        for i in range(26):
            fields.append("" if rng.random() < 0.2 else f"{rng.integers(0, 2**32):08x}")
        lines.append("\t".join(fields))
    path.write_text("\n".join(lines) + "\n")
    return lines


def test_criteo_loader_with_missing_values(tmp_path):
    lines = _write_criteo(tmp_path / "train.txt")
    data = ctr_data.load_criteo(str(tmp_path), buckets=64)
    assert data["dense"].shape == (40, 13) and data["sparse"].shape == (40, 26)
    first = lines[0].split("\t")
    assert data["label"][0, 0] == float(first[0])
    for i in range(13):
        raw = first[1 + i]
        expected = 0.0 if raw == "" else np.log1p(max(int(raw), 0))
        assert data["dense"][0, i] == pytest.approx(expected, rel=1e-6)
    for i in range(26):
        local = data["sparse"][0, i] - i * 64
        assert 0 <= local < 64
        assert (local == 0) == (first[14 + i] == "")
    # same string -> same bucket, deterministic across calls
    again = ctr_data.load_criteo(str(tmp_path / "train.txt"), buckets=64, max_rows=10)
    np.testing.assert_array_equal(again["sparse"], data["sparse"][:10])


def test_normalized_entropy_metric():
    from examples.ctr.model import NormalizedEntropy

    y = np.array([[1.0], [0.0], [0.0], [1.0], [0.0]], "float32")
    p = np.array([[0.8], [0.3], [0.1], [0.4], [0.2]], "float32")
    metric = NormalizedEntropy()
    metric.update_state(y[:2], p[:2])
    metric.update_state(y[2:], p[2:])
    ce = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    c = y.mean()
    expected = ce / -(c * np.log(c) + (1 - c) * np.log(1 - c))
    assert float(keras.ops.convert_to_numpy(metric.result())) == pytest.approx(expected, rel=1e-5)
    constant = NormalizedEntropy()
    constant.update_state(y, np.full_like(y, c))
    assert float(keras.ops.convert_to_numpy(constant.result())) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
def test_towers_shapes():
    from examples.ctr.model import TOWERS, Tower

    x = np.random.default_rng(0).normal(size=(5, 13 + 26 * 4)).astype("float32")
    for kind in TOWERS:
        out = Tower(kind, width=7, embedding_dim=4, depth=2)(x)
        assert tuple(out.shape) == (5, 7), kind


@pytest.mark.slow
def test_baseline_has_no_local_losses_and_same_layers():
    from examples.ctr.model import build_ctr_model

    base = build_ctr_model(detached=False, buckets=10, embedding_dim=4, width=8, depth=2)
    names = {layer.name for layer in base.layers}
    assert {"bottom_mlp", "cross_network", "wide_linear", "ctr"} <= names


# ----------------------------------------------------------------------------- CTR end to end


@pytest.mark.slow
def test_ctr_default_mode_is_erase_auto_and_runs_on_every_backend(tmp_path):
    from examples.ctr.train import main

    out = tmp_path / "ctr.json"
    main(TINY_CTR + ["--json", str(out)])  # no --mode: the default
    written = json.loads(out.read_text())
    assert CTR_KEYS <= set(written)
    assert written["mode"] == "erase-auto" and written["steps"] == 4
    assert written["timed_steps"] == 3  # 4 steps - 1 warm-up
    assert 0 < written["ne"] < 5 and 0 <= written["auc"] <= 1
    # Percentiles of per-step examples/s: p90 is the fast end.
    assert 0 < written["qps_p50"] <= written["qps_p90"]


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch.distributed ranks")
@pytest.mark.slow
def test_ctr_nproc_global_qps_is_the_slowest_rank_per_step(tmp_path):
    from keras_erase.throughput import global_step_seconds, throughput_percentiles

    from examples.ctr.train import main

    out = tmp_path / "ctr.json"
    main(TINY_CTR + ["--mode", "erase-threaded", "--nproc", "2", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["nproc"] == 2 and len(written["rank_qps_p50"]) == 2
    per_rank = written["rank_step_seconds"]
    # 896 training rows: 384 per rank, 3 steps of 128, 1 warm-up step
    assert len(per_rank) == 2 and len(per_rank[0]) == len(per_rank[1]) == 2
    expected = throughput_percentiles(global_step_seconds(per_rank), 2 * 128)
    assert written["qps_p50"] == pytest.approx(expected["p50"])
    assert written["qps_p90"] == pytest.approx(expected["p90"])
    assert 0 < written["ne"] < 5


@pytest.mark.slow
def test_ctr_compare_table_and_plot(tmp_path, capsys):
    from examples.ctr.train import available_modes, main

    plot = tmp_path / "ne.png"
    out = tmp_path / "compare.json"
    results = main(TINY_CTR + ["--compare", "--plot", str(plot), "--json", str(out)])
    modes = available_modes()
    assert [r["mode"] for r in results] == modes
    if BACKEND == "torch":
        assert {"erase-blocking", "erase-threaded"} <= set(modes)
    printed = capsys.readouterr().out
    table_rows = [line for line in printed.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip().split(" (")[0] for row in table_rows[1:]] == modes
    assert "QPS gain p90" in table_rows[0] and "NE gap" in table_rows[0]
    assert "erase-auto" in modes
    assert "90th percentile of per-step examples/s" in written_table(out)
    assert plot.exists() and plot.read_bytes()[:4] == b"\x89PNG"
    written = json.loads(out.read_text())
    assert [r["mode"] for r in written["runs"]] == modes
    for run in written["runs"]:
        assert CTR_KEYS <= set(run)
    # Detaching changes the model; the ERASE schedules do not change the math.
    by_mode = {r["mode"]: r for r in results}
    for mode in modes[2:]:
        assert by_mode[mode]["ne"] == pytest.approx(by_mode["detached"]["ne"], rel=1e-4)


@pytest.mark.slow
def test_ctr_seeds_report_mean_and_sd(tmp_path, capsys):
    from examples.ctr.train import main

    out = tmp_path / "ctr.json"
    (result,) = main(TINY_CTR + ["--mode", "detached", "--seeds", "2", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["seeds"] == [0, 1] and len(written["ne_per_seed"]) == 2
    assert written["ne"] == pytest.approx(np.mean(written["ne_per_seed"]))
    assert written["ne_sd"] == pytest.approx(np.std(written["ne_per_seed"], ddof=1))
    assert written["auc_sd"] == pytest.approx(np.std(written["auc_per_seed"], ddof=1))
    assert written["ne_per_seed"][0] != written["ne_per_seed"][1]  # the seeds differ
    assert written["timed_steps"] == 2 * 3  # both seeds' steps after warm-up
    printed = capsys.readouterr().out
    assert "| mode | seeds | NE |" in printed and "| detached | 2 |" in printed
    assert f"{written['ne']:.4f} ± {written['ne_sd']:.4f}" in printed


def test_ctr_gap_is_computed_on_the_means(tmp_path):
    from examples.ctr.seeds import aggregate
    from examples.ctr.train import compare_table, plot_ne

    def run(mode, seed, ne, auc):
        return {"mode": mode, "seed": seed, "ne": ne, "auc": auc, "step_seconds": [0.1, 0.2],
                "train_ne_per_step": [1.0, ne], "steps": 3, "timed_steps": 2}

    base = aggregate([run("baseline", 0, 0.70, 0.8), run("baseline", 1, 0.74, 0.7)], 100)
    other = aggregate([run("detached", 0, 0.75, 0.8), run("detached", 1, 0.73, 0.7)], 100)
    table = compare_table([base, other])
    gap = 100 * (0.74 / 0.72 - 1)  # means 0.72 and 0.74
    assert f"| detached | 2 | 0.7400 ± 0.0141 | 0.7500 ± 0.0707 |" in table
    assert f"{gap:+.2f}% |" in table
    assert other["train_ne_per_step"] == pytest.approx([1.0, 0.74])
    assert other["train_ne_sd_per_step"] == pytest.approx([0.0, np.std([0.75, 0.73], ddof=1)])
    plot = tmp_path / "ne.png"
    plot_ne([base, other], str(plot))
    assert plot.read_bytes()[:4] == b"\x89PNG"


def _alternating_result(mode, ne, repeats, seeds=(0,)):
    rates = [s for block in repeats for s in block]
    return {"mode": mode, "ne": ne, "auc": 0.7, "ne_per_seed": [ne] * len(seeds),
            "seeds": list(seeds), "ne_sd": 0.0, "auc_sd": 0.0, "repeats": repeats,
            "qps_p50": float(np.percentile(100 / np.array(rates), 50)),
            "qps_p90": float(np.percentile(100 / np.array(rates), 90)), "interleave_steps": 2}


def test_compare_marks_a_gain_inside_the_spread_as_no_gain_and_notes_cpu_rows():
    from examples.ctr.compare import gains, spread_gain
    from examples.ctr.train import CPU_NOTE, compare_table

    base = _alternating_result("baseline", 0.80, [[0.10, 0.10], [0.20, 0.20], [0.10, 0.10]],
                               seeds=(0, 1, 2))
    detached = _alternating_result("detached", 0.82, [[0.05, 0.05], [0.10, 0.10], [0.05, 0.05]])
    # faster in one repeat, slower in the next: the spread includes 0
    noisy = _alternating_result("erase-threaded", 0.82, [[0.05, 0.05], [0.40, 0.40], [0.10, 0.10]])
    rows = [base, detached, noisy]
    for r in rows:
        r["gain_p50"] = spread_gain(gains(r, base, 100, 50))
        r["gain_p90"] = spread_gain(gains(r, base, 100, 90))
    assert detached["gain_p50"][1:] == (1.0, 1.0, True)  # 2x in every repeat: a clear gain
    assert noisy["gain_p50"][1:3] == pytest.approx((-0.5, 1.0)) and not noisy["gain_p50"][3]
    table = compare_table(rows, cpu=True)
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "no gain" not in lines["detached"] and "(+100.0..+100.0)" in lines["detached"]
    assert "no gain: " in lines["erase-threaded"] and "(-50.0..+100.0)" in lines["erase-threaded"]
    assert CPU_NOTE in lines["erase-threaded"] and CPU_NOTE not in lines["detached"]
    assert "+0.00% vs detached" in lines["erase-threaded"]  # same gradients: its own reference
    assert "a gain whose spread includes 0 is marked 'no gain'" in table
    assert "3 repeats" in table and "2 steps each in turn" in table
    assert "| 3 | 0.8000 ± 0.0000 |" in lines["baseline"] and "| 1 | 0.8200 |" in lines["erase-threaded"]
    assert CPU_NOTE not in compare_table(rows, cpu=False)


@pytest.mark.slow
def test_compare_trains_every_mode_in_one_process_alternating(monkeypatch, tmp_path):
    from examples.ctr import compare
    from examples.ctr.train import _cuda_available, available_modes, main

    order = []
    build = compare.build_mode_model

    def recording_build(mode, *args):
        model = build(mode, *args)
        step = model.train_on_batch

        def train_on_batch(*a, **k):
            order.append(mode)
            return step(*a, **k)

        model.train_on_batch = train_on_batch
        return model

    monkeypatch.setattr(compare, "build_mode_model", recording_build)
    results = main(TINY_CTR + ["--compare", "--seeds", "2", "--interleave-steps", "2",
                               "--steps-per-epoch", "6", "--json", str(tmp_path / "c.json"),
                               "--plot", str(tmp_path / "c.png")])  # the last cap wins
    modes = available_modes()
    first = order[: 6 * len(modes)]  # the timed run: every mode, 2 steps each in turn
    blocks = [first[i:i + 2] for i in range(0, len(first), 2)]
    assert all(b[0] == b[1] for b in blocks)
    rounds = [[b[0] for b in blocks[i:i + len(modes)]] for i in range(0, len(blocks), len(modes))]
    assert [sorted(r) for r in rounds] == [sorted(modes)] * 3  # each round: every mode once
    assert rounds[0][0] != rounds[1][0]  # rotated: no mode always first
    # the second seed trains only the modes whose NE differs
    assert sorted(set(order[6 * len(modes):])) == ["baseline", "detached"]
    by_mode = {r["mode"]: r for r in results}
    assert by_mode["baseline"]["seeds"] == [0, 1] and by_mode["detached"]["seeds"] == [0, 1]
    assert by_mode["erase-auto"]["seeds"] == [0]
    if not _cuda_available():  # auto on a CPU (and JAX, TF): the standard step from step one
        assert by_mode["erase-auto"]["dispatch_choices"] == ["standard"]
    for r in results:  # warm-up (1 step) left out of the first repeat
        assert [len(b) for b in r["repeats"]] == [1, 2, 2]
        assert len(r["gain_p50"]) == 4


def test_main_job_runs_the_ctr_with_three_seeds():
    from examples import run_all

    assert run_all.build_parser().parse_args([]).ctr_seeds >= 3


def written_table(path):
    return json.loads(path.read_text())["table"]


def test_ctr_unavailable_mode_is_a_clear_error():
    from examples.ctr.train import available_modes, main

    missing = [m for m in ("erase-streams", "erase-graphs") if m not in available_modes()]
    if not missing:
        pytest.skip("every mode is available here")
    with pytest.raises(SystemExit, match="not available"):
        main(TINY_CTR + ["--mode", missing[0]])


def test_select_backend_sets_the_environment(monkeypatch):
    from examples import select_backend

    monkeypatch.setenv("KERAS_BACKEND", "jax")
    select_backend(["--epochs", "1", "--backend", "tensorflow", "--loss", "dense"])
    assert os.environ["KERAS_BACKEND"] == "tensorflow"
    select_backend(["--epochs", "1"])  # no flag: the environment decides
    assert os.environ["KERAS_BACKEND"] == "tensorflow"


@pytest.mark.slow
def test_backend_flag_selects_backend_before_import(tmp_path):
    other = "jax" if BACKEND != "jax" else "torch"
    env = dict(os.environ, KERAS_BACKEND=other, PYTHONPATH=ROOT)
    out = tmp_path / "ctr.json"
    proc = subprocess.run(
        [sys.executable, "-m", "examples.ctr", "--backend", BACKEND, "--mode", "baseline",
         "--json", str(out), *TINY_CTR, "--steps-per-epoch", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"backend={BACKEND}" in proc.stdout
    assert json.loads(out.read_text())["mode"] == "baseline"


# ----------------------------------------------------------------------------- SASRec losses


def _softplus(z):
    return np.logaddexp(0.0, z)


def _tiny_table(rows=23, dim=6, seed=0):
    items = keras.layers.Embedding(rows, dim)
    items.build((None,))
    table = np.random.default_rng(seed).normal(size=(rows, dim)).astype("float32")
    items.embeddings.assign(table)
    return items, table


def test_sampled_bce_matches_numpy():
    from examples.sasrec.losses import SampledBCELoss

    rng = np.random.default_rng(1)
    items, table = _tiny_table()
    bias = rng.normal(size=(23,)).astype("float32")
    hidden = rng.normal(size=(2, 3, 6)).astype("float32")
    targets = rng.integers(1, 23, size=(2, 3, 2)).astype("int32")
    targets[0, 0, 1] = -1  # padding target
    targets[1, 2] = -1  # a position without targets
    negatives = rng.integers(1, 23, size=(2, 3, 2 * 3)).astype("int32")
    loss = SampledBCELoss(items, keras.Variable(bias), num_targets=2, num_negatives=3,
                          reduction=None)
    got = keras.ops.convert_to_numpy(loss(np.concatenate([targets, negatives], -1), hidden))
    expected = np.zeros((2, 3))
    for b in range(2):
        for t in range(3):
            terms = []
            for j in range(2):
                if targets[b, t, j] < 0:
                    continue
                z = lambda i: hidden[b, t] @ table[i] + bias[i]  # noqa: E731
                negs = negatives[b, t, j * 3:(j + 1) * 3]
                terms.append((_softplus(-z(targets[b, t, j])) + sum(_softplus(z(n)) for n in negs))
                             / 4.0)
            expected[b, t] = np.mean(terms) if terms else 0.0
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cut", [False, True], ids=["dense", "cut"])
def test_softmax_cross_entropy_matches_numpy_and_excludes_padding_row(cut):
    from examples.sasrec import losses

    rng = np.random.default_rng(2)
    items, table = _tiny_table(seed=3)
    hidden = rng.normal(size=(2, 3, 6)).astype("float32")
    targets = rng.integers(1, 23, size=(2, 3, 2)).astype("int32")
    targets[0, 1, 0] = -1
    targets[1, 0] = [0, -1]  # only the padding row: no valid target
    cls = losses.CutSoftmaxCrossEntropyLoss if cut else losses.SoftmaxCrossEntropyLoss
    loss = cls(items, padding_id=0, reduction=None)
    got = keras.ops.convert_to_numpy(loss(targets, hidden))
    logits = hidden @ table.T
    logits[..., 0] = -np.inf  # the padding row is not a class
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                keepdims=True)) - logits.max(-1, keepdims=True)
    expected = np.zeros((2, 3))
    for b in range(2):
        for t in range(3):
            valid = [i for i in targets[b, t] if i > 0]
            expected[b, t] = -np.mean([log_probs[b, t, i] for i in valid]) if valid else 0.0
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_negative_sampling_batches_draw_fresh_uniform_negatives():
    from examples.sasrec.losses import NegativeSamplingBatches

    inputs = np.arange(10 * 4, dtype="int32").reshape(10, 4)
    targets = np.arange(10 * 4 * 2, dtype="int32").reshape(10, 4, 2)
    weights = np.ones((10, 4), "float32")
    batches = NegativeSamplingBatches(inputs, targets, weights, batch_size=4, num_items=50,
                                      num_negatives=3, seed=0)
    assert len(batches) == 3
    x, y, w = batches[0]
    assert x.shape == (4, 4) and y.shape == (4, 4, 2 + 6) and w.shape == (4, 4)
    rows = [int(np.argmax((inputs == r).all(axis=1))) for r in x]
    np.testing.assert_array_equal(y[..., :2], targets[rows])  # targets kept, same windows
    negatives = y[..., 2:]
    assert negatives.min() >= 1 and negatives.max() <= 50
    again = batches[0][1][..., 2:]
    assert not np.array_equal(negatives, again)  # fresh draws every batch
    seen = set()
    batches.on_epoch_end()
    for i in range(len(batches)):
        seen.update(int(r[0]) for r in batches[i][0])
    assert seen == set(inputs[:, 0].tolist())  # every window once per epoch


@needs_metrics
@pytest.mark.slow
def test_sasrec_eval_each_epoch_records_the_curve(tmp_path):
    from examples.sasrec.train import main

    args = TINY_SASREC.copy()
    args[args.index("--epochs") + 1] = "2"
    results = main(args + ["--loss", "sampled", "--num-negatives", "4", "--eval-each-epoch"])
    assert len(results["ndcg@10_per_epoch"]) == 2
    assert results["ndcg@10_per_epoch"][-1] == results["ndcg@10"]
    assert results["steps"] == 6 and results["num_negatives"] == 4


# ----------------------------------------------------------------------------- a new user's first hour


def _parsers():
    from examples import run_all
    from examples.ctr.train import build_parser as ctr_parser
    from examples.sasrec.train import build_parser as sasrec_parser

    return {"sasrec": sasrec_parser(), "ctr": ctr_parser(), "run_all": run_all.build_parser()}


@pytest.mark.parametrize("name,shown", [
    ("sasrec", ["(default: 2000)", "(default: 10)", "(default: 30)", "(default: cutbce)"]),
    ("ctr", ["(default: erase-auto)", "(default: 60000)", "(default: 10)", "(default: ctr_ne.png)"]),
    ("run_all", ["runs)"]),
])
def test_help_shows_every_default(name, shown):
    parser = _parsers()[name]
    assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    for action in parser._actions:  # every option has a help line, so its default is shown
        assert action.help, f"{name} {action.option_strings} has no help text"
    text = " ".join(parser.format_help().split())
    for fragment in shown:
        assert fragment in text, (name, fragment)


@pytest.mark.parametrize("argv", [
    ["--epochs", "0"], ["--batch-size", "0"], ["--max-len", "-1"], ["--num-negatives", "0"],
    ["--dropout", "1.5"], ["--learning-rate", "0"], ["--dim", "15"],
    ["--loss", "dense", "--num-negatives", "5"], ["--steps-per-epoch", "0"],
])
def test_sasrec_rejects_bad_arguments(argv, capsys):
    from examples.sasrec.train import main

    with pytest.raises(SystemExit) as error:
        main(argv)
    assert error.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--epochs", "0"], ["--batch-size", "0"], ["--warmup-steps", "-1"], ["--nproc", "0"],
    ["--num-examples", "0"], ["--steps-per-epoch", "0"],
])
def test_ctr_rejects_bad_arguments(argv, capsys):
    from examples.ctr.train import main

    with pytest.raises(SystemExit) as error:
        main(argv)
    assert error.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_ctr_refuses_to_time_only_warm_up_steps():
    from examples.ctr.train import main

    args = TINY_CTR.copy()
    args[args.index("--warmup-steps") + 1] = "4"  # 4 steps, 4 warm-up steps
    with pytest.raises(SystemExit, match="warm-up"):
        main(args)


def test_verbosity_is_one_line_per_epoch_off_a_terminal(monkeypatch):
    from examples.ctr.cli import build_parser as ctr_parser
    from examples.sasrec.cli import build_parser as sasrec_parser

    def defaults():
        return sasrec_parser().get_default("verbose"), ctr_parser().get_default("verbose")

    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert defaults() == (2, 2)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert defaults() == (1, 1)


def test_throughput_synchronizes_before_every_clock_read_and_reports_the_fast_end():
    from examples.ctr.train import Throughput, make_synchronizer

    calls = []
    meter = Throughput(batch_size=100, synchronize=lambda: calls.append(1))
    for step in range(3):
        meter.on_train_batch_begin(step)
        meter.on_train_batch_end(step)
    assert len(calls) == 6
    meter.seconds = [1.0, 0.1, 0.2, 0.4]  # first step: warm-up
    p50, p90 = meter.percentiles(warmup=1)
    assert p50 == pytest.approx(500.0)  # median of 1000, 500, 250 examples/s
    assert p90 == pytest.approx(900.0)  # the fast end
    if BACKEND != "torch":
        assert make_synchronizer() is None


@pytest.mark.skipif(BACKEND != "torch", reason="CUDA synchronization is a torch matter")
def test_synchronizer_is_cuda_synchronize_on_a_cuda_device(monkeypatch):
    import torch

    from examples.ctr.train import make_synchronizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make_synchronizer() is torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert make_synchronizer() is None


def _seeded_draws():
    import random

    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    dropped = keras.layers.Dropout(0.5)(np.ones((2, 8), "float32"), training=True)
    draws = [random.random(), np.random.rand(), keras.ops.convert_to_numpy(layer.kernel),
             keras.ops.convert_to_numpy(dropped)]
    if keras.backend.backend() == "torch":
        import torch

        draws.append(torch.rand(3).numpy())
    return draws


def test_set_random_seed_draws_as_keras_seeds():
    """The examples' seeding (no TensorFlow import on JAX and torch) gives Keras's seeded draws."""
    from examples import set_random_seed

    keras.utils.set_random_seed(7)
    expected = _seeded_draws()
    set_random_seed(7)
    got = _seeded_draws()
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)
    set_random_seed(8)
    assert _seeded_draws()[0] != got[0]


def test_run_all_docstring_and_output_folder():
    from examples import DEFAULT_OUTPUT_DIR, run_all

    assert "-- --epochs" not in run_all.__doc__
    assert "--sasrec-args" in run_all.__doc__
    default = run_all.build_parser().get_default("out")
    assert default == DEFAULT_OUTPUT_DIR == os.path.join(ROOT, "runs")
    assert ("sampled", ["--num-negatives", "1"]) in run_all.SASREC_RUNS
    runs = [loss for loss, _ in run_all.SASREC_RUNS]
    assert runs.index("cutsoftmax") == runs.index("softmax") + 1  # beside dense softmax


@needs_metrics
@pytest.mark.slow
def test_run_all_tables_and_printed_paths(tmp_path, monkeypatch, capsys):
    """The main job end to end at tiny size (each example in this process)."""
    from examples import run_all
    from examples.ctr.train import _cuda_available
    from examples.ctr.train import main as ctr_main
    from examples.sasrec.train import main as sasrec_main

    sasrec_runs = []

    def run_here(module, args, env):
        if module == "examples.sasrec":
            sasrec_runs.append(args)
        (sasrec_main if module == "examples.sasrec" else ctr_main)(args)
        return 1.0, 0.5

    monkeypatch.setattr(run_all, "_run", run_here)
    out = tmp_path / "out"
    ctr_args = " ".join(a for a in TINY_CTR if a not in ("--verbose", "0"))
    sasrec_args = " ".join(a for a in TINY_SASREC if a not in ("--verbose", "0"))
    result = run_all.main(["--out", str(out), "--verbose", "0",
                           "--sasrec-args", sasrec_args, "--ctr-args", ctr_args])
    printed = capsys.readouterr().out
    assert list(result["sasrec"]) == ["cutbce", "dense", "sampled (1 neg.)", "softmax", "cutsoftmax"]
    for cut, dense in (("cutbce", "dense"), ("cutsoftmax", "softmax")):  # the same training, without logits
        for key in ("hit@8", "ndcg@10", "recall@10"):
            assert result["sasrec"][cut][key] == pytest.approx(result["sasrec"][dense][key], abs=1e-6), key
    assert "| sampled (1 neg.) |" in printed and "| most popular |" in printed
    assert "| cutsoftmax |" in printed
    assert "| erase-auto (standard) |" in printed or _cuda_available()
    assert f"results go to {out}" in printed
    assert "sasrec cutbce 1 s (0 s)" in printed  # wall (user + sys CPU) per part
    for args in sasrec_runs:  # the main job's epochs, unless --sasrec-args names others (the last wins)
        epochs = [args[i + 1] for i, a in enumerate(args) if a == "--epochs"]
        assert epochs == [str(run_all.SASREC_EPOCHS), "1"], args
    assert all(r["epochs"] == 1 for r in result["sasrec"].values())
    for path in result["written"]:
        assert os.path.exists(path) and path in printed


# ----------------------------------------------------------------------------- the loss study


def test_loss_study_table_and_plot(tmp_path):
    sys.path.insert(0, ROOT)
    from benchmarks.sasrec_study import LOSSES, plot_curves, study_table, summarize

    assert ("sampled", 1) in LOSSES and ("sampled", 256) in LOSSES and len(LOSSES) == 6
    popular = {"popularity_hit@8": 0.19, "popularity_ndcg@10": 0.04, "popularity_recall@10": 0.04}
    rows = [
        {"dataset": "ml", "loss": "cutbce", "seed": 0, "status": "trained", "hit@8": 0.3,
         "ndcg@10": 0.08, "recall@10": 0.08, "steps_per_second": 3.1, "peak_memory_mb": 1279.0,
         "wall_seconds": 61.0, "ndcg@10_per_epoch": [0.04, 0.06, 0.08], **popular},
        {"dataset": "ml", "loss": "cutbce", "seed": 1, "status": "trained", "hit@8": 0.4,
         "ndcg@10": 0.06, "recall@10": 0.08, "steps_per_second": 2.9, "peak_memory_mb": 1281.0,
         "wall_seconds": 63.0, "ndcg@10_per_epoch": [0.02, 0.04, 0.06], **popular},
        {"dataset": "synthetic 1,000,000 items", "loss": "dense", "seed": 0,
         "status": "out of memory (cap 12 GiB)",
         "wall_seconds": 30.0, "error": "Out of memory allocating 38430615872 bytes."},
    ]
    summaries = summarize(rows)
    assert [s["seeds"] for s in summaries] == [[0, 1], []]
    assert summaries[0]["ndcg@10_per_epoch"] == pytest.approx([0.03, 0.05, 0.07])
    assert summaries[0]["hit@8_sd"] == pytest.approx(0.0707107, rel=1e-5)
    assert summaries[1]["error"].startswith("Out of memory")
    table = study_table(summaries).splitlines()
    assert table[0].startswith("| data | loss | status | seeds | hit@8 | ndcg@10 | recall@10")
    assert table[2] == ("| ml | cutbce | trained | 2 | 0.3500 +- 0.0707 | 0.0700 +- 0.0141 "
                        "| 0.0800 +- 0.0000 | 3 | 1,280 | 62 |")
    assert table[3] == ("| synthetic 1,000,000 items | dense | out of memory (cap 12 GiB) "
                        "|  |  |  |  |  |  | 30 |")
    assert table[4].startswith("| ml | most popular | - | - | 0.1900")
    path = plot_curves(summaries, str(tmp_path / "curves.png"), "ml")
    assert open(path, "rb").read(4) == b"\x89PNG"


def test_loss_study_caches_runs_and_resumes(tmp_path):
    sys.path.insert(0, ROOT)
    from benchmarks import sasrec_study

    calls = []

    def fake_run(dataset, loss, negatives, example_args, seed):
        calls.append((loss, negatives, seed))
        return {"dataset": dataset, "loss": sasrec_study.loss_name(loss, negatives),
                "seed": seed, "status": "trained", "hit@8": 0.1 * (seed + 1),
                "ndcg@10": 0.05, "recall@10": 0.05}

    runs = str(tmp_path / "runs")
    cases = [("synthetic 300 items", ["--num-items", "300"])]
    losses = sasrec_study.parse_losses("sampled:256,cutbce")
    sasrec_study.run_missing(runs, 2, cases, losses, fake_run)
    assert calls == [("sampled", 256, 0), ("cutbce", 1, 0), ("sampled", 256, 1), ("cutbce", 1, 1)]
    summaries = sasrec_study.summarize(sasrec_study.load_runs(runs))
    assert {s["loss"]: s["hit@8"] for s in summaries} == pytest.approx(
        {"sampled (256 neg.)": 0.15, "cutbce": 0.15})
    sasrec_study.run_missing(runs, 3, cases, losses, fake_run)
    assert len(calls) == 6 and {c[2] for c in calls[4:]} == {2}  # resumes: seed 2 only
    with pytest.raises(argparse.ArgumentTypeError):
        sasrec_study.parse_losses("sampled:7")
    script = [sys.executable, os.path.join(ROOT, "benchmarks", "sasrec_losses.py")]
    out = str(tmp_path / "study")  # the benchmark reports the cached runs, running none
    done = subprocess.run(script + ["--report-only", "--runs-dir", runs, "--out", out],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| synthetic 300 items | cutbce | trained | 3 |" in open(out + ".md").read()
    assert subprocess.run(script + ["--losses", "sampled:7"], capture_output=True).returncode == 2


def test_loss_speed_summaries_pair_each_round():
    sys.path.insert(0, ROOT)
    from benchmarks.sasrec_study import speed_summaries

    rows = [{"dataset": data, "rep": rep, "loss": loss, "load_1min": [1.0, 1.0],
             "cpu_s_per_step": cpu, "wall_s_per_step": 2 * cpu}
            for data, rep, loss, cpu in [("ml", 0, "softmax", 1.0), ("ml", 0, "cutsoftmax", 0.5),
                                         ("ml", 1, "softmax", 2.0), ("ml", 1, "cutsoftmax", 0.4),
                                         ("1e5", 0, "softmax", 1.0), ("1e5", 0, "cutsoftmax", 3.0)]]
    table = speed_summaries(rows, ["softmax", "cutsoftmax"])
    assert [(r["data"], r["loss"]) for r in table] == [
        ("1e5", "softmax"), ("1e5", "cutsoftmax"), ("ml", "softmax"), ("ml", "cutsoftmax")]
    # Ratios are taken within a round (0.5 and 0.2), not across rounds' medians (0.45 / 1.5).
    assert table[3]["CPU / first loss"] == "0.35 (0.2-0.5)"
    assert table[3]["cpu_s_per_step"]["median"] == pytest.approx(0.45)
    assert table[1]["wall / first loss"] == "3 (3-3)"


@pytest.mark.slow
def test_loss_speed_cell_times_the_training_steps(tmp_path):
    out = str(tmp_path / "speed")
    script = [sys.executable, os.path.join(ROOT, "benchmarks", "sasrec_losses.py")]
    done = subprocess.run(script + ["--speed", "--quick", "--losses", "cutsoftmax", "--rounds", "1",
                                    "--speed-steps", "2", "--warmup", "1", "--out", out],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.load(open(out + ".json"))
    (row,) = result["rows"]
    assert row["loss"] == "cutsoftmax" and row["steps"] == 2 and row["threads"] == 1
    assert row["cpu_s_per_step"] > 0 and row["wall_s_per_step"] > 0
    assert "| synthetic 300 items | cutsoftmax |" in open(out + ".md").read()
