"""The CPU stand-in capture refuses what a CUDA Graph capture refuses: host reads too.

On CPU a host read of a tensor (`.cpu()`, `.numpy()`, `np.asarray`,
`keras.ops.convert_to_numpy`, `.tolist()`) dispatches no aten op, so a
stand-in that only watched aten ops would "capture" a block that reads a
value on the host and replay that value as a constant at every later step,
where a real capture raises (the read is a device-to-host copy). The stand-in
and the runner's checked warm-up see those tensor methods too
(`op_recording.HostReads`).
"""

import keras
import numpy as np
import pytest

from keras_erase import DetachBlock
from keras_erase import EraseModel
from tests.backend_utils import BACKEND
from tests.erase.test_cuda_graphs import stand_in_captures

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the ERASE GPU path is torch's")


def _regions():
    import torch

    x = torch.ones(3)
    return {
        ".item()": lambda: x.sum().item() * x,
        "float(t)": lambda: float(x.sum()) * x,
        ".cpu()": lambda: x.cpu() * 2.0,
        ".numpy()": lambda: x.numpy() * 2.0,
        "np.asarray": lambda: np.asarray(x) * 2.0,
        "convert_to_numpy": lambda: float(keras.ops.convert_to_numpy(keras.ops.mean(x))) * x,
        ".tolist()": lambda: torch.as_tensor(x.tolist()),
        "host-to-device copy": lambda: x * torch.tensor(2.0),
        "from numpy": lambda: x * torch.from_numpy(np.ones(3, "float32")),
    }


@pytest.mark.parametrize("read", list(_regions()))
def test_the_stand_in_capture_refuses_every_host_read(read):
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.op_recording import CaptureRefused

    with pytest.raises(CaptureRefused, match="captured region"):
        RecordingCapture()(_regions()[read])


def test_reads_outside_a_capture_are_untouched():
    import torch

    from keras_erase.torch.cuda_graphs.capture import RecordingCapture

    x = torch.ones(3)
    capture = RecordingCapture()(lambda: x * 2.0)
    assert np.asarray(capture.outputs).tolist() == [2.0, 2.0, 2.0]  # after the capture: fine


class HostScaled(keras.layers.Layer):
    """Divides by the batch mean read on the host (`convert_to_numpy`): not capturable."""

    def build(self, shape):
        self.dense = keras.layers.Dense(4)
        self.dense.build(shape)

    def call(self, x):
        scale = float(keras.ops.convert_to_numpy(keras.ops.mean(keras.ops.abs(x))))
        return self.dense(x / scale)

    def compute_output_shape(self, shape):
        return (*shape[:-1], 4)


def _model(cuda_graphs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    block = DetachBlock(HostScaled(), head=keras.layers.Dense(1),
                        loss=keras.losses.BinaryCrossentropy(from_logits=True), name="tower")
    outputs = keras.layers.Dense(1, activation="sigmoid")(block(inputs))
    model = EraseModel(inputs, outputs, dispatch="blocking", cuda_graphs=cuda_graphs)
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    return model


def test_a_block_reading_a_value_on_the_host_trains_eagerly_not_from_a_stale_constant():
    """The stale-constant case: graphs are refused at the checked warm-up; the losses are eager's."""
    rng = np.random.default_rng(0)
    batches = [(rng.normal(scale=1 + i, size=(8, 6)).astype("float32"),
                rng.integers(0, 2, size=(8, 1)).astype("float32")) for i in range(6)]

    def losses(model):
        return [model.train_on_batch(x, y, return_dict=True)["tower_loss"] for x, y in batches]

    eager = losses(_model(False))
    with stand_in_captures() as captures:
        model = _model(True)
        graphed = losses(model)
    from keras_erase.config import Schedule

    runner = model._erase.schedule_runs[Schedule.from_name("blocking+graphs")].graphs
    assert runner.disabled and "Tensor.__array__" in runner.disabled_reason, runner.disabled_reason
    assert all(c.captured == [] for c in captures)  # refused before any capture
    np.testing.assert_allclose(graphed, eager, rtol=1e-6)
