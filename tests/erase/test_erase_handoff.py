"""The gradient hand-off (torch): a shared upstream runs one backward per step in every schedule.

A shared `Embedding` feeds 3 `DetachBlock(detach_input=False)` towers (and, with
`skip=True`, the top layer directly too). Checked on CPU:

- weights after N steps equal the standard step's (blocking and threaded);
- the embedding table's backward runs once per step: the aten op
  `embedding_dense_backward` is recorded once per step (blocking, one thread), and
  the table's gradient is accumulated once per step (every schedule, any thread);
- each block's early backward walks no autograd node outside the block: the graph
  reachable from its local loss holds only the block's own weights and its cut
  input leaves, and shares no node with the upstream (what lets `"streams"` overlap
  the blocks on a GPU).
"""

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock, EraseModel
from tests.backend_utils import BACKEND, TorchOpRecorder, to_numpy

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the ERASE step runs on torch")

VOCAB, DIM, FIELDS, TOWERS = 40, 4, 3, 3
N, BATCH, EPOCHS = 64, 16, 2  # 4 steps per epoch


def build(dispatch, skip=False, seed=0):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((FIELDS,), dtype="int32", name="ids")
    table = keras.layers.Embedding(VOCAB, DIM, name="table")
    features = keras.layers.Flatten(name="flat")(table(ids))
    towers = [
        DetachBlock(
            keras.Sequential(
                [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)],
                name=f"mlp_{i}",
            ),
            head=keras.layers.Dense(1, name=f"head_{i}"),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            loss_weight=0.5,
            detach_input=False,
            name=f"tower_{i}",
        )(features)
        for i in range(TOWERS)
    ]
    if skip:  # the main loss reaches the table directly too
        towers.append(keras.layers.Dense(2, name="skip")(features))
    hidden = keras.layers.Concatenate()(towers)
    out = keras.layers.Dense(1, activation="sigmoid", name="top")(hidden)
    return EraseModel(ids, out, dispatch=dispatch, intra_op_threads=None)


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(N, FIELDS)).astype("int32")
    y = (x[:, :1] % 3 == 0).astype("float32")
    return x, y


def fit(model, epochs=EPOCHS):
    x, y = data()
    model.compile(keras.optimizers.Adam(0.02), "binary_crossentropy")
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return [to_numpy(w) for w in model.get_weights()]


def table_of(model):
    return model.get_layer("table").embeddings.value


@pytest.mark.parametrize("skip", [False, True])
def test_blocking_and_threaded_give_the_standard_weights(skip):
    reference = fit(build("standard", skip))
    initial = [to_numpy(w) for w in build("standard", skip).get_weights()]
    assert np.abs(reference[0] - initial[0]).max() > 1e-3  # the table trained (can fail)
    for mode in ("blocking", "threaded"):
        weights = fit(build(mode, skip))
        for a, b in zip(weights, reference):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=mode)


@pytest.mark.parametrize("mode", ["standard", "blocking", "threaded"])
def test_the_table_gets_one_gradient_per_step(mode):
    model = build(mode)
    accumulations = []
    table_of(model).register_post_accumulate_grad_hook(lambda p: accumulations.append(1))
    fit(model, epochs=1)
    assert len(accumulations) == N // BATCH  # one per step, whatever thread ran it


def test_embedding_backward_op_runs_once_per_step():
    model = build("blocking")
    recorder = TorchOpRecorder()
    with recorder:  # blocking: every backward runs on this thread
        fit(model, epochs=1)
    assert recorder.ops.count("embedding_dense_backward") == N // BATCH


def _walk(node):
    """Every autograd node reachable from `node` (what a backward from it may run)."""
    seen, stack = {}, [node]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen[id(current)] = current
        stack.extend(next_node for next_node, _ in current.next_functions)
    return seen


@pytest.mark.parametrize("mode", ["blocking", "threaded"])
def test_a_block_backward_walks_only_the_block(mode, monkeypatch):
    from keras_erase.torch.schedules.base import ScheduleRun

    walked = []
    real = ScheduleRun._timed_backward

    def spy(self, block, loss, cuts=()):
        walked.append((block, _walk(loss.grad_fn), list(cuts)))
        return real(self, block, loss, cuts)

    monkeypatch.setattr(ScheduleRun, "_timed_backward", spy)
    fit(build(mode, skip=True), epochs=1)
    assert len(walked) == TOWERS * (N // BATCH)
    for block, nodes, cuts in walked:
        assert cuts, block.name  # the block's input was cut
        own = {id(v.value) for v in block.trainable_weights}
        leaves = {id(leaf) for _, leaf in cuts}
        upstream = {}
        for source, _ in cuts:
            upstream.update(_walk(source.grad_fn))
        assert upstream  # the upstream graph exists (the check can fail)
        assert not set(nodes) & set(upstream), block.name
        variables = [n.variable for n in nodes.values() if hasattr(n, "variable")]
        assert variables and all(id(v) in own | leaves for v in variables), block.name
        names = {type(n).__name__ for n in nodes.values()}
        assert not any("Embedding" in name for name in names), names
