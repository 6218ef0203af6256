"""What each torch.distributed rank runs in the vocab-parallel tests (importable by the spawned ranks)."""

import numpy as np


def case(seed, vocab, dim, rows, length, world, *, bias=True):
    """The full inputs of one case: table, bias, hidden `[sum(rows), D]`, ids, cotangents; `rows` per rank."""
    rows = [rows] * world if isinstance(rows, int) else list(rows)
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(vocab, dim)).astype("float32")
    ids = rng.integers(-2, vocab + 2, size=(sum(rows), length)).astype("int32")
    ids[0] = -1  # a position without a target
    ids[1, :2] = ids[1, 0] if vocab > 0 else 0  # a duplicate
    return {
        "table": table,
        "bias": rng.normal(size=(vocab,)).astype("float32") if bias else None,
        "hidden": rng.normal(size=(sum(rows), dim)).astype("float32"),
        "ids": ids,
        "cotangent": rng.normal(size=(sum(rows),)).astype("float32"),
        "rows": rows,
    }


def mine(data, rank):
    """This rank's slice of the positions."""
    start = sum(data["rows"][:rank])
    return slice(start, start + data["rows"][rank])


def split_layer(data, **kwargs):
    """A built `ItemEmbedding(vocab_parallel=True)` holding this rank's rows of `data`'s table and bias."""
    from keras_cutbce import ItemEmbedding

    vocab, dim = data["table"].shape
    layer = ItemEmbedding(vocab, dim, use_bias=data["bias"] is not None, vocab_parallel=True,
                          **kwargs)
    layer.build()
    start, stop = layer.vocab_layout.start, layer.vocab_layout.stop
    layer.embeddings.assign(data["table"][start:stop])
    if layer.bias is not None:
        layer.bias.assign(data["bias"][start:stop])
    return layer


def op_gradients(rank, world, data, cases):
    """Per `(family, options)` of `cases`: `family_gradients` on this rank."""
    return [family_gradients(rank, world, data, family, options) for family, options in cases]


def family_gradients(rank, world, data, family, options):
    """This rank's loss, hidden, table and bias gradients of `family`'s op on its rows of `data`."""
    import torch

    from keras_cutbce import cut_binary_crossentropy
    from keras_cutbce import cut_categorical_crossentropy

    layer = split_layer(data)
    rows = mine(data, rank)
    device = layer.embeddings.value.device  # Keras's: cuda:rank under NCCL
    hidden = torch.tensor(data["hidden"][rows], requires_grad=True, device=device)
    op = cut_binary_crossentropy if family == "bce" else cut_categorical_crossentropy
    loss = op(hidden, layer, data["ids"][rows], **options)
    weights = [w.value for w in layer.weights]
    cotangent = torch.tensor(data["cotangent"][rows], device=device)
    grads = torch.autograd.grad((loss * cotangent).sum(), [hidden] + weights)
    return [g.detach().cpu().numpy() for g in [loss] + list(grads)]


def lookups(rank, world, data):
    """This rank's `layer(ids)` rows and the shard's gradient of `sum(rows * g)` (`g`: `hidden` as cotangent)."""
    import torch

    layer = split_layer(data)
    rows = mine(data, rank)
    ids = np.clip(data["ids"][rows], 0, data["table"].shape[0] - 1)
    out = layer(torch.tensor(ids))
    cotangent = torch.tensor(data["hidden"][rows])[:, None, :]
    (grad,) = torch.autograd.grad((out * cotangent).sum(), [layer.embeddings.value])
    return out.detach().numpy(), grad.numpy()


def retrieval(rank, world, data, table=None):
    """This rank's `cut_top_k`, `cut_rank`, `cut_count_at_least` and the metrics' global results.

    `table`: None for a layer split over the ranks (run by each rank), else one process's table.
    """
    import keras_cutbce as kc
    from keras_cutbce import ops

    layer = split_layer(data) if table is None else table
    rows = slice(None) if table is not None else mine(data, rank)
    hidden, ids = data["hidden"][rows], data["ids"][rows]
    exclude = ids[:, :1]
    scores, top = kc.cut_top_k(hidden, layer, 5, exclude_ids=exclude, chunk_size=4)
    ranks = ops.cut_rank(hidden, layer, ids, exclude_ids=exclude)
    counts = ops.cut_count_at_least(hidden, layer, 0.5)
    results = [np.asarray(x) for x in (scores, top, ranks, counts)]
    weights = np.linspace(0.5, 1.5, data["hidden"].shape[0]).astype("float32")[rows]
    for metric in (kc.TopKRetrieval(layer, k=(3, 5)), kc.MeanReciprocalRank(layer),
                   kc.ThresholdConfusion(layer, threshold=0.6)):
        metric.update_state(ids, hidden, sample_weight=weights)
        metric.update_state(ids[:, ::-1], hidden, sample_weight=2 * weights)
        results.append({k: float(v) for k, v in metric.result().items()})
    return results


def training_data(seed, vocab, steps, world, batch, length=3, targets=2):
    """Global batches `[steps, world, batch, ...]` of input ids and target ids."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(steps, world, batch, length)).astype("int32")
    y = rng.integers(-1, vocab, size=(steps, world, batch, length, targets)).astype("int32")
    return x, y


def train(rank, world, x, y, initial, family, optimizer, policy, split=True):
    """Trains a tied-table model on rank `rank`'s part of each global batch; its weights by path (tables whole).

    `split=False`: one process on the whole batches (`rank`, `world` then 0 and 1).
    """
    import keras

    from keras_cutbce import CutBCELoss
    from keras_cutbce import CutSoftmaxLoss
    from keras_cutbce import ItemEmbedding
    from keras_erase import EraseModel

    keras.mixed_precision.set_global_policy(policy)
    vocab, dim = initial["items/embeddings"].shape
    items = ItemEmbedding(vocab, dim, use_bias=True, vocab_parallel=split, name="items")
    ids = keras.Input(x.shape[3:], dtype="int32")
    hidden = keras.layers.Dense(dim, name="dense")(items(ids))
    model = EraseModel(ids, hidden, dispatch="standard")
    layout = items.vocab_layout
    for weight in model.weights:
        value = initial[weight.path]
        weight.assign(value[layout.start:layout.stop] if layout is not None and weight.path.startswith("items") else value)
    loss = (CutBCELoss if family == "bce" else CutSoftmaxLoss)(items)
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.5 if optimizer == "SGD" else 0.05}}), loss=loss)
    if split:
        x, y = x[:, rank], y[:, rank]
    batch = int(np.prod(x.shape[1:-1])) if not split else x.shape[1]
    x = x.reshape((-1,) + x.shape[-1:])
    y = y.reshape((-1,) + y.shape[-2:])
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    weights = {}
    for weight in model.weights:
        value = weight.value
        if layout is not None and weight.path.startswith("items"):
            from keras_cutbce.backends.torch import vocab_parallel

            weights[weight.path] = vocab_parallel.gather_table(value, layout)
        else:
            weights[weight.path] = keras.ops.convert_to_numpy(value)
    return weights, history.history["loss"]


def saved_and_loaded(rank, world, data, folder, save):
    """`save`: a tied model with the split table of `data`, compiled with `CutBCELoss`, saved by every rank
    (a collective) to `folder/model_{rank}.keras`; else rank 0's file loaded. Returns the whole table and bias.
    """
    import keras

    from keras_cutbce import CutBCELoss
    from keras_cutbce import ItemEmbedding

    if save:
        items = split_layer(data, name="items")
        ids = keras.Input((3,), dtype="int32")
        model = keras.Model(ids, keras.layers.Dense(data["table"].shape[1])(items(ids)))
        model.compile(optimizer="adam", loss=CutBCELoss(items))
        model.save(f"{folder}/model_{rank}.keras")
    else:
        model = keras.saving.load_model(f"{folder}/model_0.keras")
        items = model.get_layer("items")
        assert isinstance(items, ItemEmbedding) and isinstance(model.loss, CutBCELoss)
    layout = items.vocab_layout
    if layout is None:
        return [keras.ops.convert_to_numpy(w.value) for w in items.weights], None
    from keras_cutbce.backends.torch import vocab_parallel

    rows = [keras.ops.convert_to_numpy(w.value) for w in items.weights]
    return [vocab_parallel.gather_table(w.value, layout) for w in items.weights], rows


def loss_class_gradients(rank, world, data, split=True):
    """`CutBCELoss` and `CutSoftmaxLoss` (`reduction="sum"`) with sample weights (some 0): value, hidden and table gradients.

    `split=False`: one process on all positions (`rank`, `world` then 0 and 1).
    """
    import torch

    from keras_cutbce import CutBCELoss
    from keras_cutbce import CutSoftmaxLoss
    from keras_cutbce import ItemEmbedding

    if split:
        layer, rows = split_layer(data), mine(data, rank)
    else:
        vocab, dim = data["table"].shape
        layer, rows = ItemEmbedding(vocab, dim, use_bias=True), slice(None)
        layer.build()
        layer.embeddings.assign(data["table"])
        layer.bias.assign(data["bias"])
    weights = np.where(np.arange(data["hidden"].shape[0]) % 3 == 1, 0.0,
                       np.abs(data["cotangent"])).astype("float32")[rows]
    out = []
    for cls, options in ((CutBCELoss, {"label_smoothing": 0.2}), (CutSoftmaxLoss, {})):
        hidden = torch.tensor(data["hidden"][rows], requires_grad=True)
        loss = cls(layer, reduction="sum", **options)(data["ids"][rows], hidden, sample_weight=weights)
        grads = torch.autograd.grad(loss, [hidden] + [w.value for w in layer.weights])
        out.append([loss.detach().numpy()] + [g.numpy() for g in grads])
    return out


def users_model_steps(rank, world, policies, losses=None, vocab_parallel=True):
    """`test_loss.first_step` of `test_loss.users_model` per policy: `CutSoftmaxLoss` (or `losses`),
    the table split over the ranks (`vocab_parallel`) or whole on each (data parallel).

    Every rank takes the same whole batch, so the step is one process's on that batch: batch norm's
    statistics and dropout's masks (seeded) are the same as there, and the data-parallel mean of the
    ranks' equal gradients is one process's gradient.
    """
    from tests.cutbce.test_loss import first_step
    from tests.cutbce.test_loss import fit_data

    x, y = fit_data(53)
    return [first_step(53, 8, x, y, policy, softmax=True, users=True, losses=losses,
                       vocab_parallel=vocab_parallel)
            for policy in policies]


def sampled_on_split_table(rank, world):
    """The error `SampledSoftmaxLoss` raises on a split table."""
    from keras_cutbce import ItemEmbedding
    from keras_cutbce import SampledSoftmaxLoss

    items = ItemEmbedding(11, 4, vocab_parallel=True)
    items.build()
    try:
        SampledSoftmaxLoss(items, 5, seed=1)(np.array([[1], [2]]), np.ones((2, 4), "float32"))
    except NotImplementedError as error:
        return str(error)
    return None
