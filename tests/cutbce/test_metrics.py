"""`TopKRetrieval`, `MeanReciprocalRank` and `ThresholdConfusion` against dense NumPy, on every backend.

Inputs are small multiples of 1/4, so every logit is exact in float32 and the
retrieved ids (ties included) must match a dense stable sort.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops

from keras_cutbce import cut_top_k
from keras_cutbce.metrics import MeanReciprocalRank, ThresholdConfusion, TopKRetrieval
from tests.backend_utils import to_numpy


def quantized(rng, shape, scale=4):
    return (rng.integers(-4, 5, size=shape) / scale).astype("float32")


def dense_logits(hidden, table, bias=None):
    z = hidden.astype(np.float64) @ table.astype(np.float64).T
    return z if bias is None else z + bias


def numpy_ranking(z, row, vocab_size, exclude=None, constant=()):
    """The dense ranking of row `row` of logits `z`: ids by logit descending, ties to the lower id."""
    scores = z[row].copy()
    dropped = list(constant) + ([] if exclude is None else list(exclude[row]))
    scores[[i for i in dropped if 0 <= i < vocab_size]] = -np.inf
    return [i for i in np.argsort(-scores, kind="stable") if scores[i] > -np.inf]


def numpy_retrieval(hidden, table, targets, ks, weights, bias=None, exclude=None, constant=(),
                    empty="skip"):
    """Weighted means of hit@k, recall@k, ndcg@k, precision@k, one position a row."""
    vocab_size = table.shape[0]
    z = dense_logits(hidden, table, bias)
    sums = {f"{m}@{k}": 0.0 for k in ks for m in ("hit", "recall", "ndcg", "precision")}
    total = 0.0
    for row in range(len(z)):
        ranking = numpy_ranking(z, row, vocab_size, exclude, constant)
        wanted = {int(t) for t in targets[row] if 0 <= t < vocab_size and t not in constant}
        if not wanted:
            total += weights[row] if empty == "zero" else 0.0  # counted as 0, or skipped
            continue
        total += weights[row]
        for k in ks:
            top = ranking[:k]
            hits = sum(i in wanted for i in top)
            dcg = sum(1.0 / math.log2(r + 2) for r, i in enumerate(top) if i in wanted)
            ideal = sum(1.0 / math.log2(r + 2) for r in range(min(len(wanted), k)))
            sums[f"hit@{k}"] += weights[row] * (hits > 0)
            sums[f"recall@{k}"] += weights[row] * hits / len(wanted)
            sums[f"ndcg@{k}"] += weights[row] * dcg / ideal
            sums[f"precision@{k}"] += weights[row] * hits / k
    return {key: value / total for key, value in sums.items()}


def numpy_mrr(hidden, table, targets, weights, bias=None, exclude=None, constant=(), empty="skip"):
    """Weighted mean of 1 / the rank of each row's first target in its dense ranking."""
    vocab_size = table.shape[0]
    z = dense_logits(hidden, table, bias)
    total = value = 0.0
    for row in range(len(z)):
        wanted = {int(t) for t in targets[row] if 0 <= t < vocab_size and t not in constant}
        if not wanted and empty == "skip":
            continue
        total += weights[row]
        ranking = numpy_ranking(z, row, vocab_size, exclude, constant)
        first = next((r for r, i in enumerate(ranking) if i in wanted), None)
        value += 0.0 if first is None else weights[row] / (first + 1)
    return {"mrr": value / total}


def numpy_confusion(hidden, table, targets, threshold, weights, bias=None):
    """Weighted TP, FP, FN, TN of the dense logits at a probability threshold."""
    vocab_size = table.shape[0]
    z = dense_logits(hidden, table, bias)
    predicted = 1.0 / (1.0 + np.exp(-z)) >= threshold
    counts = np.zeros(4)
    for row in range(len(z)):
        truth = np.zeros(vocab_size, bool)
        truth[[t for t in targets[row] if 0 <= t < vocab_size]] = True
        p = predicted[row]
        counts += weights[row] * np.array(
            [np.sum(p & truth), np.sum(p & ~truth), np.sum(~p & truth), np.sum(~p & ~truth)]
        )
    return counts


def table_variable(table):
    return keras.Variable(table, name="items")


def results(metric):
    return {key: float(to_numpy(value)) for key, value in metric.result().items()}


def assert_results(got, want):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_top_k_retrieval_matches_numpy(rng):
    batch, steps, depth, vocab_size = 4, 3, 4, 37
    table = quantized(rng, (vocab_size, depth))
    bias = quantized(rng, (vocab_size,), scale=8)
    hidden = quantized(rng, (batch, steps, depth))
    targets = rng.integers(-2, vocab_size + 2, size=(batch, steps, 4)).astype("int32")
    targets[0, 0] = [-1, -1, vocab_size, -1]  # no valid target: weight 0
    targets[1, 1] = [5, 5, 5, 6]  # duplicates count once
    targets[2, 2] = [0, 0, -1, -1]  # only the constant exclusion: weight 0
    exclude = rng.integers(-1, vocab_size, size=(batch, steps, 6)).astype("int32")
    sample_weight = np.array([1.0, 0.5, 2.0, 0.0], "float32")
    ks = (1, 3, 10, vocab_size)  # 10 > tile, the last is the whole vocabulary

    metric = TopKRetrieval(
        table_variable(table), k=ks, exclude_ids=[0], bias=keras.Variable(bias), chunk_size=8
    )
    metric.update_state(targets, hidden, sample_weight=sample_weight, exclude_ids=exclude)
    weights = np.repeat(sample_weight, steps)
    want = numpy_retrieval(
        hidden.reshape(-1, depth),
        table,
        targets.reshape(-1, 4),
        ks,
        weights,
        bias=bias,
        exclude=exclude.reshape(-1, 6),
        constant=(0,),
    )
    assert_results(results(metric), want)
    assert 0.0 < want["hit@10"] < 1.0 and want["ndcg@3"] > 0.0  # not a trivial case
    np.testing.assert_allclose(want[f"hit@{vocab_size}"], 1.0)

    # A second batch accumulates; reset_state clears.
    metric.update_state(targets[:2, :, 0], hidden[:2], sample_weight=[3.0, 1.0])
    both = numpy_retrieval(
        np.concatenate([hidden.reshape(-1, depth), hidden[:2].reshape(-1, depth)]),
        table,
        np.concatenate([targets.reshape(-1, 4), np.pad(targets[:2, :, :1].reshape(-1, 1), ((0, 0), (0, 3)), constant_values=-1)]),
        ks,
        np.concatenate([weights, np.repeat([3.0, 1.0], steps)]),
        bias=bias,
        exclude=np.concatenate([exclude.reshape(-1, 6), -np.ones((2 * steps, 6), int)]),
        constant=(0,),
    )
    assert_results(results(metric), both)
    metric.reset_state()
    assert all(v == 0.0 for v in results(metric).values())
    # The table and bias are read, never owned: reset_state leaves them alone.
    assert len(metric.variables) == 4 * len(ks) + 1
    np.testing.assert_array_equal(to_numpy(metric.embeddings), table)
    np.testing.assert_array_equal(to_numpy(metric.bias), bias)


def test_top_k_retrieval_ties_and_masks(rng):
    vocab_size, depth = 20, 3
    base = quantized(rng, (5, depth))
    table = np.concatenate([base] * 4)  # every item has three twins
    hidden = quantized(rng, (2, 5, depth))
    targets = rng.integers(0, vocab_size, size=(2, 5, 2)).astype("int32")
    mask = np.array([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], bool)

    metric = TopKRetrieval(table_variable(table), k=(2, 4), chunk_size=4)
    tensor = ops.convert_to_tensor(hidden)
    try:
        tensor._keras_mask = ops.convert_to_tensor(mask)
    except AttributeError:  # tensors that take no attributes
        keras.src.backend.common.masking.set_keras_mask(tensor, ops.convert_to_tensor(mask))
    metric.update_state(targets, tensor)
    want = numpy_retrieval(
        hidden.reshape(-1, depth), table, targets.reshape(-1, 2), (2, 4), mask.reshape(-1) * 1.0
    )
    assert_results(results(metric), want)


@pytest.mark.parametrize("empty", ["skip", "zero"])
def test_mean_reciprocal_rank_and_empty_positions_match_numpy(rng, empty):
    """MRR is 1 / the exact rank of the first target (no cut-off); both empty-position conventions."""
    batch, steps, depth, vocab_size = 3, 4, 4, 41
    base = quantized(rng, (vocab_size // 2 + 1, depth))
    table = np.concatenate([base, base])[:vocab_size]  # twins: ties everywhere
    bias = quantized(rng, (vocab_size,), scale=8)
    hidden = quantized(rng, (batch, steps, depth))
    targets = rng.integers(-1, vocab_size, size=(batch, steps, 3)).astype("int32")
    targets[0, 0] = [-1, -1, -1]  # empty: skipped, or 0 at its weight
    targets[1, 2] = [0, 0, -1]  # only the constant exclusion: empty too
    targets[2, 1] = [7, 7, 30]  # duplicates count once
    exclude = rng.integers(-1, vocab_size, size=(batch, steps, 5)).astype("int32")
    exclude[2, 3, :3] = targets[2, 3]  # every target excluded here: a miss (0)
    sample_weight = np.array([1.0, 0.5, 2.0], "float32")
    weights = np.repeat(sample_weight, steps)
    flat = dict(hidden=hidden.reshape(-1, depth), table=table, targets=targets.reshape(-1, 3),
                weights=weights, bias=bias, exclude=exclude.reshape(-1, 5), constant=(0,),
                empty=empty)

    mrr = MeanReciprocalRank(table_variable(table), exclude_ids=[0], bias=keras.Variable(bias),
                             chunk_size=8, empty_positions=empty)
    mrr.update_state(targets, hidden, sample_weight=sample_weight, exclude_ids=exclude)
    want = numpy_mrr(**flat)
    assert_results(results(mrr), want)
    assert 0.0 < want["mrr"] < 1.0
    retrieval = TopKRetrieval(table_variable(table), k=(1, 5), exclude_ids=[0],
                              bias=keras.Variable(bias), chunk_size=8, empty_positions=empty)
    retrieval.update_state(targets, hidden, sample_weight=sample_weight, exclude_ids=exclude)
    assert_results(results(retrieval), numpy_retrieval(ks=(1, 5), **flat))
    # Every rank: each position's MRR is at least 1 / V when it has a target.
    mrr.reset_state()
    mrr.update_state(targets[:, :, :1], hidden)
    assert_results(results(mrr), numpy_mrr(
        hidden.reshape(-1, depth), table, targets[:, :, :1].reshape(-1, 1), np.ones(12),
        bias=bias, constant=(0,), empty=empty))
    config = mrr.get_config()
    assert config["empty_positions"] == empty and config["exclude_ids"] == [0]
    assert MeanReciprocalRank.from_config({**config, "embeddings": table}).empty_positions == empty
    with pytest.raises(ValueError, match="`empty_positions` must be one of"):
        TopKRetrieval(table, k=2, empty_positions="keras_rs")


def test_precision_at_k_is_keras_precision_top_k(rng):
    """With `empty_positions="zero"`, precision@k is Keras's `Precision(top_k=k)` on dense logits."""
    vocab_size, depth, rows = 60, 8, 24
    table = rng.normal(size=(vocab_size, depth)).astype("float32")
    ids = rng.integers(-1, vocab_size, size=(rows, 3)).astype("int32")
    ids[:2] = -1  # positions without a target: Keras counts their top k as false positives
    hidden = (table[np.maximum(ids[:, 0], 0)] + rng.normal(size=(rows, depth))).astype("float32")
    labels = np.zeros((rows, vocab_size), "float32")
    for row, items in enumerate(ids):
        labels[row, items[items >= 0]] = 1.0
    for k in (1, 5):
        keras_precision = keras.metrics.Precision(top_k=k)
        keras_precision.update_state(labels, hidden @ table.T)
        ours = TopKRetrieval(table_variable(table), k=k, empty_positions="zero", chunk_size=16)
        ours.update_state(ids, hidden)
        got = results(ours)[f"precision@{k}"]
        assert got == pytest.approx(float(to_numpy(keras_precision.result())), abs=1e-6)
        assert got > 0.1


@pytest.mark.parametrize("where", ["hidden", "table"])
def test_a_diverged_model_gives_nan_metrics(rng, where):
    """A NaN logit at a counted position makes every metric NaN; at weight 0 it is not counted."""
    vocab_size, depth = 17, 3
    table = quantized(rng, (vocab_size, depth))
    hidden = quantized(rng, (2, 4, depth))
    targets = rng.integers(0, vocab_size, size=(2, 4, 2)).astype("int32")
    broken_hidden, broken_table = hidden.copy(), table.copy()
    if where == "hidden":
        broken_hidden[1] = np.nan  # example 1 diverged
    else:
        broken_table[5] = np.nan  # every position ranks item 5 nowhere
    metrics = [TopKRetrieval(table_variable(broken_table), k=3, chunk_size=4),
               MeanReciprocalRank(table_variable(broken_table), chunk_size=4),
               ThresholdConfusion(table_variable(broken_table), chunk_size=4)]
    for metric in metrics:
        metric.update_state(targets, broken_hidden)
        got = results(metric)
        assert all(np.isnan(v) for v in got.values()), (type(metric).__name__, got)
    if where == "hidden":  # the diverged example at weight 0: the other one's numbers
        for metric in metrics:
            metric.reset_state()
            metric.update_state(targets, broken_hidden, sample_weight=np.array([1.0, 0.0]))
            clean = type(metric).from_config({**metric.get_config(), "embeddings": table})
            clean.update_state(targets[:1], hidden[:1])
            assert_results(results(metric), results(clean))


def test_threshold_confusion_matches_numpy(rng):
    batch, steps, depth, vocab_size = 3, 4, 4, 29
    table = quantized(rng, (vocab_size, depth))
    bias = quantized(rng, (vocab_size,), scale=8)
    hidden = quantized(rng, (batch, steps, depth))
    targets = rng.integers(-2, vocab_size + 2, size=(batch, steps, 3)).astype("int32")
    targets[0, 1] = [4, 4, -1]
    sample_weight = np.array([1.0, 0.25, 2.0], "float32")
    weights = np.repeat(sample_weight, steps)
    for threshold, b in ((0.5, None), (0.5, bias), (0.7, bias)):
        metric = ThresholdConfusion(
            table_variable(table),
            threshold=threshold,
            bias=None if b is None else keras.Variable(b),
            chunk_size=8,
        )
        metric.update_state(targets, hidden, sample_weight=sample_weight)
        want = numpy_confusion(
            hidden.reshape(-1, depth), table, targets.reshape(-1, 3), threshold, weights, b
        )
        got = [
            float(to_numpy(v))
            for v in (
                metric.true_positives,
                metric.false_positives,
                metric.false_negatives,
                metric.true_negatives,
            )
        ]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert want[0] > 0 and want[1] > 0 and want[2] > 0
        tp, fp, fn, _ = want
        precision, recall = tp / (tp + fp), tp / (tp + fn)
        assert_results(
            results(metric),
            {
                "precision": precision,
                "recall": recall,
                "f1": 2 * precision * recall / (precision + recall),
            },
        )
    metric.reset_state()
    assert float(to_numpy(metric.true_negatives)) == 0.0
    assert len(metric.variables) == 4
    np.testing.assert_array_equal(to_numpy(metric.embeddings), table)


def test_argument_checks():
    table = keras.Variable(np.zeros((5, 2), "float32"))
    with pytest.raises(ValueError, match="`k`"):
        TopKRetrieval(table, k=(0, 3))
    with pytest.raises(ValueError, match="`threshold`"):
        ThresholdConfusion(table, threshold=1.0)
    metric = TopKRetrieval(table, k=2)
    with pytest.raises(TypeError, match="`y_true` must be integer item ids"):
        metric.update_state(np.zeros((3, 1), "bool"), np.zeros((3, 2), "float32"))
    with pytest.raises(ValueError, match="`y_true` must be whole-number item ids"):
        metric.update_state(np.full((3, 1), 0.5, "float32"), np.zeros((3, 2), "float32"))


@pytest.mark.slow
def test_get_config_from_config(rng):
    items = keras.layers.Embedding(11, 3, name="items")
    items.build()
    table = quantized(rng, (11, 3))
    items.embeddings.assign(table)
    for metric in (
        TopKRetrieval(items, k=[5, 2], exclude_ids=[0], chunk_size=4, name="retrieval"),
        ThresholdConfusion(items, threshold=0.3, chunk_size=4, name="confusion"),
    ):
        config = metric.get_config()
        assert config["embeddings"] == items.embeddings.path
        clone = type(metric).from_config(config)
        assert clone.get_config() == config
        registered = f"keras_cutbce>{type(metric).__name__}"
        assert keras.saving.get_registered_object(registered) is type(metric)
        # Outside a model a path cannot be resolved: a clear error.
        with pytest.raises(ValueError, match="items"):
            clone.update_state(np.array([[1]]), quantized(rng, (1, 3)))
        # Bound to the variable, the clone computes what the original does.
        rebound = type(metric).from_config({**config, "embeddings": items})
        hidden, ids = quantized(rng, (6, 3)), rng.integers(-1, 11, size=(6, 2))
        metric.update_state(ids, hidden)
        rebound.update_state(ids, hidden)
        assert results(rebound) == results(metric)
    assert TopKRetrieval(items, k=[5, 2]).k == (2, 5)


@keras.saving.register_keras_serializable(package="keras_cutbce_tests")
def hidden_l2(y_true, y_pred):
    """A per-example loss, so the metrics are tested on their own."""
    return ops.mean(ops.square(y_pred), axis=(-2, -1))


def safe_divide(a, b):
    """`a / b`, 0 where `b` is 0 (like `keras.ops.divide_no_nan`)."""
    return a / b if b else 0.0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_metrics_in_compile_fit_evaluate_save_load_under_every_policy(rng, tmp_path, policy):
    """Under each policy: the model's hidden states in its compute dtype, its float32 table."""
    from tests.backend_utils import dtype_policy

    with dtype_policy(policy):
        _metrics_in_compile_fit_evaluate_save_load(rng, tmp_path)


def _metrics_in_compile_fit_evaluate_save_load(rng, tmp_path):
    keras.utils.set_random_seed(0)
    vocab_size, depth, steps, batch = 23, 4, 5, 6
    ids_in = keras.Input((steps,), dtype="int32")
    items = keras.layers.Embedding(vocab_size, depth, name="items")
    hidden_out = keras.layers.Dense(depth, name="proj")(items(ids_in))
    model = keras.Model(ids_in, hidden_out)
    retrieval = TopKRetrieval(items, k=(1, 4, 9), exclude_ids=[0], chunk_size=8)
    mrr = MeanReciprocalRank(items, exclude_ids=[0], chunk_size=8)
    confusion = ThresholdConfusion(items, threshold=0.5, chunk_size=8)
    # Keras gives sample weights to `weighted_metrics` only.
    model.compile(
        optimizer="sgd", loss=hidden_l2, metrics=[confusion], weighted_metrics=[retrieval, mrr]
    )
    x = rng.integers(0, vocab_size, size=(batch, steps)).astype("int32")
    y = rng.integers(-1, vocab_size, size=(batch, steps, 3)).astype("int32")
    sample_weight = rng.uniform(0.5, 2.0, size=(batch,)).astype("float32")

    def expected():
        hidden = model.predict(x, verbose=0).reshape(-1, depth).astype(np.float64)
        table = to_numpy(items.embeddings)
        weights = np.repeat(sample_weight, steps)
        want = numpy_retrieval(hidden, table, y.reshape(-1, 3), (1, 4, 9), weights, constant=(0,))
        want.update(numpy_mrr(hidden, table, y.reshape(-1, 3), weights, constant=(0,)))
        tp, fp, fn, _ = numpy_confusion(
            hidden, table, y.reshape(-1, 3), 0.5, np.ones_like(weights)
        )
        precision, recall = safe_divide(tp, tp + fp), safe_divide(tp, tp + fn)
        want.update(precision=precision, recall=recall)
        want["f1"] = safe_divide(2 * precision * recall, precision + recall)
        return want

    def check(logs, want):
        for key, value in want.items():
            np.testing.assert_allclose(logs[key], value, rtol=1e-4, atol=1e-5, err_msg=key)

    logs = model.evaluate(x, y, sample_weight=sample_weight, return_dict=True, verbose=0)
    check(logs, expected())
    assert 0.0 < logs["hit@9"] < 1.0 and logs["precision"] > 0.0
    # The table is read at every update: a new table gives new results (the
    # compiled test step must not keep the table it was traced with).
    items.embeddings.assign(items.embeddings * -1.5 + 0.25)
    logs = model.evaluate(x, y, sample_weight=sample_weight, return_dict=True, verbose=0)
    check(logs, expected())
    history = model.fit(x, y, sample_weight=sample_weight, epochs=2, batch_size=batch, verbose=0)
    assert {"hit@4", "ndcg@9", "recall@1", "precision@4", "mrr", "precision", "f1"} <= set(
        history.history
    )
    logs = model.evaluate(x, y, sample_weight=sample_weight, return_dict=True, verbose=0)
    check(logs, expected())
    # Saved and loaded, the metrics re-bind to the loaded model's table.
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    again = loaded.evaluate(x, y, sample_weight=sample_weight, return_dict=True, verbose=0)
    check(again, logs)


def test_empty_target_lists(rng):
    """L = 0: no position has a target; retrieval weighs nothing, confusion counts FP/TN."""
    table = quantized(rng, (9, 3))
    hidden = quantized(rng, (4, 3))
    empty = np.zeros((4, 0), "int32")
    retrieval = TopKRetrieval(table_variable(table), k=3, chunk_size=4)
    retrieval.update_state(empty, hidden)
    assert float(to_numpy(retrieval.total_weight)) == 0.0
    assert all(v == 0.0 for v in results(retrieval).values())
    confusion = ThresholdConfusion(table_variable(table), chunk_size=4)
    confusion.update_state(empty, hidden)
    want = numpy_confusion(hidden, table, empty, 0.5, np.ones(4))
    got = [float(to_numpy(getattr(confusion, name))) for name in (
        "true_positives", "false_positives", "false_negatives", "true_negatives")]
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_two_retrieval_metrics_log_under_their_names():
    """A metric named `name=` logs its keys under that name; two metrics never overwrite."""
    vocab, dim = 19, 4
    rng = np.random.default_rng(0)
    items = keras.layers.Embedding(vocab, dim, name="items")
    inputs = keras.Input((3,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(dim)(items(inputs)))
    from keras_cutbce import CutBCELoss

    model.compile(
        optimizer="sgd",
        loss=CutBCELoss(items, chunk_size=8),
        metrics=[TopKRetrieval(items, k=5, chunk_size=8)],
        weighted_metrics=[TopKRetrieval(items, k=5, chunk_size=8, name="weighted")],
    )
    x = rng.integers(0, vocab, size=(12, 3))
    y = rng.integers(0, vocab, size=(12, 3, 2))
    sample_weight = np.where(np.arange(12) < 6, 1.0, 0.0)  # the weighted metric sees half the rows
    logs = model.evaluate(x, y, sample_weight=sample_weight, return_dict=True, verbose=0)
    assert {"hit@5", "weighted_hit@5", "recall@5", "weighted_recall@5"} <= set(logs)
    hidden = model.predict(x, verbose=0)
    plain = TopKRetrieval(items, k=5, chunk_size=8)
    plain.update_state(y, hidden)
    weighted = TopKRetrieval(items, k=5, chunk_size=8)
    weighted.update_state(y, hidden, sample_weight=sample_weight)
    assert logs["hit@5"] == pytest.approx(float(to_numpy(plain.result()["hit@5"])), abs=1e-6)
    assert logs["weighted_hit@5"] == pytest.approx(
        float(to_numpy(weighted.result()["hit@5"])), abs=1e-6
    )
    named = ThresholdConfusion(items, name="at_half")
    assert set(named.result()) == {"at_half_precision", "at_half_recall", "at_half_f1"}


def test_cutoff_beyond_the_vocabulary_raises(rng):
    """`k > V` raises like `cut_top_k`: at construction when V is known, else at the first update."""
    table = quantized(rng, (7, 3))
    built = keras.layers.Embedding(7, 3)
    built.build((None,))
    for known in (table, table_variable(table), built, keras.layers.Embedding(7, 3)):
        with pytest.raises(ValueError, match=r"`k` must be at most V = 7.*Received: k=\[3, 12\]"):
            TopKRetrieval(known, k=(3, 12))
    assert TopKRetrieval(table, k=7).k == (7,)  # k = V is fine
    with pytest.raises(ValueError, match=r"`k` must be an int in \[1, V\] = \[1, 7\]"):
        cut_top_k(quantized(rng, (2, 3)), table, k=8)
    # V unknown at construction (a variable path, bound later): the first update raises.
    metric = TopKRetrieval("some_model/items/embeddings", k=(3, 12))
    object.__setattr__(metric, "embeddings", table_variable(table))
    with pytest.raises(ValueError, match=r"`k`.*V = 7"):
        metric.update_state(np.zeros((2, 1), "int32"), quantized(rng, (2, 3)))
