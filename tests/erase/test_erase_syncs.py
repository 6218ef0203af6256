"""No host-device synchronisation per step from ERASE (torch), counted on CPU.

A CPU cannot show a CUDA sync, but it runs the same ops: `SyncRecorder`
(`keras_erase.torch.cuda_graphs.op_recording`) counts the operations that
imply one on CUDA (tensors made from host data such as a Python int turned
into a tensor, `.item()`/`float(t)`, host reads such as `np.asarray(t)`,
data-dependent shapes), on the main thread and on every `keras_erase` worker
thread. The reference is Keras's own torch step on the same layers without
blocks (`keras.Model`). Inside the train step no ERASE schedule may have more
of any kind than Keras's step; outside it, Keras reads every logged value on
the host (`pythonify_logs`, in `train_on_batch` and for per-batch callbacks):
one read per block loss, as for any logged metric.
"""

import collections
import threading

import numpy as np
import pytest

from tests.backend_utils import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="counts torch ops")

TOWERS, BATCH, STEPS = 3, 16, 4
MODES = ("standard", "blocking", "threaded")


def _host_reads():
    from keras_erase.torch.cuda_graphs.op_recording import HOST_READ_FUNCTIONS

    return HOST_READ_FUNCTIONS


def _keras_model():
    import keras

    from tests.erase.test_erase import make_tower

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="features")
    towers = [make_tower(16, 2)(inputs) for _ in range(TOWERS)]
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()(towers))
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))


def _model(mode):
    import keras

    from tests.erase.test_erase import build_ctr

    model = _keras_model() if mode == "keras" else build_ctr(
        mode, num_towers=TOWERS, intra_op_threads=None
    )
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    return model


class _Counting:
    """Counts syncs on the main thread (while `region()` is entered) and on keras_erase threads."""

    def __init__(self, monkeypatch):
        from keras_erase.torch.cuda_graphs.op_recording import SyncRecorder

        self.names = []
        self.worker_ops = 0
        run = threading.Thread.run
        counting = self

        def counted_run(thread):
            if not thread.name.startswith("keras_erase"):
                return run(thread)
            recorder = SyncRecorder(counting.names)
            try:
                with recorder:
                    return run(thread)
            finally:
                counting.worker_ops += recorder.ops

        monkeypatch.setattr(threading.Thread, "run", counted_run)
        self._recorder = SyncRecorder

    def region(self):
        return self._recorder(self.names)

    def take(self):
        counts, self.names[:] = collections.Counter(self.names), []
        return counts


def _count_per_step(mode, counting):
    """Syncs of one train step under `fit` (the train function only) and of one `train_on_batch`."""
    from tests.erase.test_erase import ctr_data

    x, y = ctr_data(STEPS * BATCH)
    model = _model(mode)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # builds; the first step's checks
    step = model.train_function

    def counted(data):
        with counting.region():
            return step(data)

    model.train_function = counted
    counting.take()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    fit = counting.take()
    assert sum(fit.values()) % STEPS == 0, fit
    fit = collections.Counter({k: v // STEPS for k, v in fit.items()})
    with counting.region():
        model.train_on_batch(x[:BATCH], y[:BATCH])
    return fit, counting.take()


def test_the_sync_recorder_sees_host_copies_reads_and_syncs():
    import torch

    from keras_erase.torch.cuda_graphs.op_recording import SyncRecorder

    t = torch.ones(3)
    with SyncRecorder() as syncs:
        _ = t * 2.0 + torch.full((), 3.0)  # scalar arguments and fills: no sync
    assert syncs.names == [] and syncs.ops == 3
    with SyncRecorder() as syncs:
        float(t.sum())
        torch.as_tensor(5, dtype=torch.float32)  # a Python int copied to the device
        np.asarray(t)
        t.tolist()
        t.nonzero()
    assert syncs.names == [
        "_local_scalar_dense", "lift_fresh", "Tensor.__array__", "Tensor.tolist", "nonzero"
    ]


def test_erase_adds_no_sync_to_keras_train_step(monkeypatch):
    """Per step: no kind of sync more than Keras's step, in every schedule, fit and train_on_batch."""
    HOST_READ_FUNCTIONS = _host_reads()
    counting = _Counting(monkeypatch)
    keras_fit, keras_batch = _count_per_step("keras", counting)
    assert keras_fit["lift_fresh"] >= 1  # Keras's own step: the loss tracker's batch size
    for mode in MODES:
        fit, batch = _count_per_step(mode, counting)
        print(f"{mode}: fit step {sum(fit.values())} (Keras {sum(keras_fit.values())}), "
              f"train_on_batch {sum(batch.values())} (Keras {sum(keras_batch.values())})")
        assert not fit - keras_fit, (mode, fit, keras_fit)
        # train_on_batch reads every log on the host: one more read per block loss (on CPU
        # np.asarray; on CUDA also the .cpu() copy before it)
        excess = batch - keras_batch
        assert set(excess) <= HOST_READ_FUNCTIONS and "Tensor.__array__" in excess, (
            mode, batch, keras_batch)
        assert all(count == TOWERS for count in excess.values()), (mode, excess)
        if mode == "threaded":
            assert counting.worker_ops > 0  # the worker's backward ops were watched
