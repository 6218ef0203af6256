"""The internal helpers' examples (their docstrings say what they do in one line)."""

import keras
import numpy as np
import pytest
from types import SimpleNamespace

from keras_erase import DetachBlock, EraseModel
from keras_erase.torch.auto import ScheduleSelector
from keras_erase.block_weights import block_owned_weights
from keras_erase.block_weights import shared_weights
from keras_erase.capture_safe import capture_safe_loss
from keras_erase.capture_safe import weight_penalty
from keras_erase.config import EraseConfig
from keras_erase.local_losses import LocalLossMean
from keras_erase.local_losses import batch_weight
from keras_erase.loss_arguments import checked_loss_weight
from keras_erase.loss_arguments import to_loss_object
from keras_erase.monitor_modes import minimise_block_losses
from keras_erase.step_protocol import claim_weight_penalties
from keras_erase.step_protocol import collecting
from keras_erase.targets import check_targets
from keras_erase.targets import select_target
from keras_erase.throughput import throughput_percentiles
from tests.backend_utils import BACKEND

torch_only = pytest.mark.skipif(BACKEND != "torch", reason="keras_erase.torch runs on torch")


def test_config():
    config = EraseConfig(dispatch="threaded", intra_op_threads=1)
    assert (config.to_dict()["dispatch"], config.needs_cuda) == ("threaded", False)
    early = EraseConfig(dispatch="early", launcher="inline", placement="block_streams")
    assert early.schedule().name == "inline_streams"
    assert EraseConfig(dispatch="streams").backend_note("jax").startswith(
        "EraseModel: dispatch='streams' is a torc"
    )


def test_schedule_selector_keeps_a_faster_schedule():
    selector = ScheduleSelector(["standard", "streams"], timed_rounds=3)
    while not selector.done:
        schedule = selector.next_schedule()
        selector.record(schedule, 1.0 if schedule == "standard" else 0.5)
    assert (selector.choice, selector.steps) == ("streams", 8)


def test_claim_weight_penalties_once_per_model_call():
    with collecting("model", training=True):
        first, second = claim_weight_penalties(["a", "b"]), claim_weight_penalties(["b", "c"])
    assert (first, second) == (["a", "b"], ["c"])
    assert claim_weight_penalties(["a"]) == ["a"]  # no collector: every call pays


def _shared_layer_model(sequential_name=None, tower_name=None):
    shared = keras.layers.Dense(2, name="shared")
    inner = keras.layers.Dense(2, name="inner")
    inputs = keras.Input((3,))
    layers = [shared] if sequential_name else [shared, inner]
    tower = DetachBlock(keras.Sequential(layers, name=sequential_name), loss="mse",
                        name=tower_name)
    model = EraseModel(inputs, keras.layers.Add()([tower(inputs), shared(inputs)]),
                       dispatch="standard")
    return model, tower, inner


def test_block_owned_weights_leave_out_a_layer_on_the_main_path():
    model, tower, inner = _shared_layer_model()
    owned = block_owned_weights(model, [tower])[id(tower)]
    assert [w is inner.kernel or w is inner.bias for w in owned] == [True, True]


def test_shared_weights_name_the_weights_a_block_does_not_own():
    model, tower, _ = _shared_layer_model(sequential_name="inner", tower_name="tower")
    assert shared_weights(model, [tower])[id(tower)] == [
        "tower/inner/shared/kernel", "tower/inner/shared/bias"
    ]


def test_targets():
    with pytest.raises(ValueError, match=r"must name one of the model's outputs \['buy', "
                                         r"'click'\] or be an index in \[0, 2\)"):
        check_targets([SimpleNamespace(name="t", target="nope")], ["buy", "click"])
    block = SimpleNamespace(name="tower", target="buy")
    assert select_target(block, {"buy": 1, "click": 0}, None, ["buy", "click"]) == (1, None)


def test_local_loss_logs_without_host_data():
    assert float(batch_weight(keras.ops.convert_to_tensor(0.5), 32)) == 32.0
    mean = LocalLossMean(name="tower_loss")
    mean.update_state(2.0, sample_weight=3.0)
    mean.reset_state()
    assert float(mean.result()) == 0.0


def test_capture_safe_values_match_keras():
    w = keras.Variable([[1.0, -2.0]])
    assert float(weight_penalty(keras.regularizers.L1L2(l1=0.5, l2=0.25), w)) == 2.75
    loss = keras.losses.MeanSquaredError()
    y_true, y_pred = np.array([[1.0], [0.0]]), np.array([[0.5], [0.5]])
    assert float(capture_safe_loss(loss, y_true, y_pred)) == 0.25


def test_monitoring_callbacks_minimise_block_losses():
    stop = keras.callbacks.EarlyStopping(monitor="val_tower_0_loss")
    assert minimise_block_losses([stop], ["tower_0_loss"]) == [stop]
    assert stop.mode == "min"


def test_loss_arguments():
    assert to_loss_object("mse").name == "mean_squared_error"
    assert checked_loss_weight(0.5) == 0.5


def test_throughput_percentiles():
    stats = throughput_percentiles([0.010, 0.020, 0.040], batch_size=100)
    assert (round(stats["p50"]), round(stats["p90"])) == (5000, 9000)


@torch_only
def test_op_recording():
    import torch

    from keras_erase.torch.cuda_graphs.op_recording import HostReads
    from keras_erase.torch.cuda_graphs.op_recording import SyncRecorder
    from keras_erase.torch.cuda_graphs.op_recording import forbidden_ops

    assert forbidden_ops(["mm", "item", "lift_fresh", "Tensor.numpy"]) == [
        "Tensor.numpy", "item", "lift_fresh"
    ]
    reads = HostReads(refuse=False)
    with reads:
        np.asarray(torch.ones(2))
    assert reads.names == ["Tensor.__array__"]
    with SyncRecorder() as syncs:
        torch.ones(2).sum().item() + torch.tensor(3.0)
    assert syncs.names == ["_local_scalar_dense", "lift_fresh"]


@torch_only
def test_torch_runtime_parts():
    import torch

    from keras_erase.config import Schedule
    from keras_erase.torch.auto import auto_candidates
    from keras_erase.torch.auto import describe_schedule
    from keras_erase.torch.cuda_graphs.capture import RecordingCapture
    from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
    from keras_erase.torch.schedules import make_schedule_run
    from keras_erase.torch.schedules.launchers import InlineLauncher
    from keras_erase.torch.tensors import flat_tensors
    from keras_erase.torch.tensors import reached

    assert auto_candidates()[:3] == ["standard", "threaded", "streams"]
    assert describe_schedule("streams") == (
        "streams (launcher 'worker', placement 'block_streams', CUDA Graphs off)"
    )
    runner = CudaGraphRunner(capture=RecordingCapture(), warmup=0)
    assert (runner.captures, runner.disabled) == (0, False)
    assert make_schedule_run(Schedule("worker", "default_stream")).name == "worker+default_stream"
    launcher, ran = InlineLauncher(), []
    launcher.launch(lambda: ran.append(1))
    launcher.wait()
    assert ran == [1]
    assert tuple(flat_tensors({"a": torch.ones(1), "b": [torch.zeros(2), 3]})[1].shape) == (2,)
    both = [torch.ones(2), torch.ones(2)]
    assert reached(lambda v: [(v[0] * v[1].detach()).sum()], both) == [[True, False]]


def test_collecting_sets_the_blocks_step_state():
    from keras_erase.step_protocol import collector_evaluating
    from keras_erase.step_protocol import collector_training
    from keras_erase.step_protocol import current_collector

    with collecting("model", training=True):
        state = current_collector(), collector_training(), collector_evaluating()
    assert state == ("model", True, False)
    assert current_collector() is None
