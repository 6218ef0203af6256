"""`EraseModel`: a `keras.Model` whose loss includes every `DetachBlock`'s local loss.

On torch its train step is the ERASE step (`keras_erase.torch.train_step`);
elsewhere Keras's standard step. Behaviour and schedules: docs/erase.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np
from keras import tree

from keras_erase import _keras_private
from keras_erase.config import AUTO_STEPS
from keras_erase.config import EraseConfig
from keras_erase.detach_block import DetachBlock
from keras_erase.step_protocol import collecting
from keras_erase.frozen_upstream import warn_if_frozen
from keras_erase.local_losses import add_local_losses
from keras_erase.local_losses import losses_outside_blocks
from keras_erase.monitor_modes import minimise_block_losses
from keras_erase.runtime import EraseRuntime
from keras_erase.runtime import torch_runtime
from keras_erase.targets import check_targets

__all__ = ["EraseModel", "FunctionalEraseModel"]


def _as_tensor(value):
    """A numeric numpy array as a backend tensor (one host copy); anything else as it is."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return keras.ops.convert_to_tensor(value)
    return value


def _is_torch():
    return keras.backend.backend() == "torch"


def _functional_arguments(args, kwargs):
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


@keras.saving.register_keras_serializable(package="keras_erase")
class EraseModel(keras.Model):
    """A Keras model trained with ERASE's early backward on torch.

    Functional (`EraseModel(inputs, outputs)`) or subclassed. On every backend
    its loss is the compiled loss plus every `DetachBlock`'s local loss, and
    `fit`/`evaluate` log each block's as `"<block name>_loss"`
    (`"val_<block name>_loss"`). On torch each block's backward is launched
    right after its forward pass; every schedule gives the standard step's
    gradients. JAX and TensorFlow run Keras's standard step.

    Args:
        dispatch: `"auto"`, `"standard"`, `"early"` (with `launcher` and
            `placement`) or a schedule's name: `"blocking"`, `"threaded"`,
            `"streams"` (CUDA), `"inline_streams"` (CUDA), each also with
            `"+graphs"` (= `cuda_graphs=True`). Used on torch only; elsewhere the early-backward ones warn
            at construction. `"auto"`: the standard step on a CPU; on CUDA the
            fastest schedule of its first steps.
        num_streams: CUDA streams of the `"block_streams"` placement: `None`
            gives every block its own; an int caps the pool (shared round robin).
        cuda_graphs: capture each block as CUDA Graphs (CUDA, fixed shapes).
            `"streams"` and `cuda_graphs=True` need CUDA to train on torch (the
            first train step raises otherwise); building, loading, `predict`
            and `evaluate` work anywhere.
        intra_op_threads: torch CPU thread policy: `"auto"`, an int or `None`
            (see `keras_erase.torch.threads`).
        auto_steps: timed rounds per candidate of `dispatch="auto"` on CUDA
            (at most: fewer where needed to choose within 30 steps).
        launcher: `"inline"` or `"worker"`: who launches each block's
            backward (`None`: the named schedule's; `"worker"` for `"early"`).
        placement: `"default_stream"` or `"block_streams"` (CUDA): where each
            block's forward and backward run (`None`: the named schedule's; for
            `"early"`, one stream per block on CUDA).
        *args, **kwargs: as for `keras.Model`.

    Raises:
        ValueError: an argument out of range, or `launcher`/`placement`
            that disagree with `dispatch`.
        TypeError: a subclass called with `inputs` and `outputs` that does
            not inherit from `FunctionalEraseModel`.

    Example:

    ```python
    inputs = keras.Input((32,))
    towers = [DetachBlock(keras.layers.Dense(16, "relu"), head=keras.layers.Dense(1),
                          loss=keras.losses.BinaryCrossentropy(from_logits=True),
                          name=f"tower_{i}")(inputs) for i in range(2)]
    outputs = keras.layers.Dense(1, "sigmoid")(keras.layers.Concatenate()(towers))
    model = EraseModel(inputs, outputs, dispatch="threaded")
    model.compile("adam", "binary_crossentropy")
    history = model.fit(x, y)  # history keys: loss, tower_0_loss, tower_1_loss
    ```
    """

    def __new__(cls, *args, **kwargs):
        # `EraseModel(inputs, outputs)` builds a `FunctionalEraseModel`. (Keras's own
        # route for Functional subclasses rewrites the class's bases in place,
        # which would break subclassing `EraseModel` afterwards.)
        if cls is EraseModel and _functional_arguments(args, kwargs):
            return FunctionalEraseModel.__new__(FunctionalEraseModel, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args: Any,
        dispatch: str = "auto",
        num_streams: int | None = None,
        cuda_graphs: bool = False,
        intra_op_threads: str | int | None = "auto",
        auto_steps: int = AUTO_STEPS,
        launcher: str | None = None,
        placement: str | None = None,
        **kwargs: Any,
    ) -> None:
        if _functional_arguments(args, kwargs) and not isinstance(
            self, _keras_private.Functional
        ):
            raise TypeError(
                "EraseModel: a subclass called with `inputs` and `outputs` must inherit from "
                "keras_erase.model.FunctionalEraseModel. "
                f"Received: a {type(self).__name__} (bases: "
                f"{', '.join(b.__name__ for b in type(self).__bases__)})"
            )
        config = EraseConfig(
            dispatch=dispatch, num_streams=num_streams, cuda_graphs=cuda_graphs,
            intra_op_threads=intra_op_threads, auto_steps=auto_steps, launcher=launcher,
            placement=placement,
        )
        note = config.backend_note(keras.backend.backend())
        if note is not None:
            warnings.warn(note, stacklevel=2)
        super().__init__(*args, **kwargs)
        # One plain object, outside Keras's and torch's attribute tracking.
        self.__dict__["_erase"] = EraseRuntime(config, _is_torch())
        if self.built:
            self._erase.trackers.ensure(self.detach_blocks())
        check_targets(self.detach_blocks(), getattr(self, "output_names", None))

    # -- configuration ------------------------------------------------------------

    @property
    def dispatch(self) -> str:
        """The schedule asked for: `"auto"`, `"standard"`, `"early"` or a schedule's name (`"streams"`, ...)."""
        return self._erase.config.dispatch

    @property
    def launcher(self) -> str | None:
        """Who launches a block's backward as asked: `"inline"`, `"worker"` or `None` (the schedule's)."""
        return self._erase.config.launcher

    @property
    def placement(self) -> str | None:
        """Where blocks run as asked: `"default_stream"`, `"block_streams"` or `None` (the schedule's)."""
        return self._erase.config.placement

    @property
    def num_streams(self) -> int | None:
        """CUDA streams of the `"block_streams"` placement (`None`: one per block)."""
        return self._erase.config.num_streams

    @property
    def cuda_graphs(self) -> bool:
        """Whether each block's step is captured and replayed as a CUDA Graph."""
        return self._erase.config.cuda_graphs

    @property
    def intra_op_threads(self) -> str | int | None:
        """torch CPU thread policy: `"auto"`, an int or `None` (`keras_erase.torch.threads`)."""
        return self._erase.config.intra_op_threads

    @property
    def auto_steps(self) -> int:
        """Timed rounds per candidate schedule for `dispatch="auto"` on CUDA."""
        return self._erase.config.auto_steps

    @property
    def dispatch_choice(self) -> str | None:
        """The schedule in use, by name, a `dispatch` value (`"standard"`, `"threaded"`, `"streams+graphs"`, ...).

        `"standard"` on JAX, TensorFlow and a CPU; `None` while `"auto"` measures.
        """
        erase = self._erase
        return torch_runtime().train_step.dispatch_choice(erase) if _is_torch() else erase.dispatch_choice

    @property
    def dispatch_explanation(self) -> str:
        """Which schedule trains and why; with `"auto"` on CUDA, every candidate's timings and the rule."""
        erase = self._erase
        if not _is_torch():
            return (f"dispatch={erase.config.dispatch!r} on backend {keras.backend.backend()!r}: "
                    "the standard Keras train step trains the model")
        return torch_runtime().train_step.explanation(erase)

    @property
    def auto_timings(self) -> dict[str, dict[str, float]]:
        """`{schedule: {"median_s", "p90_s", "steps"}}` measured by `"auto"` on CUDA (else empty)."""
        selector = self._erase.selector
        return {} if selector is None else selector.timings()

    def get_config(self):
        config = super().get_config()
        config.update(self._erase.config.to_dict())
        return config

    # -- blocks, targets and local losses (all backends) ----------------------

    def detach_blocks(self) -> list[DetachBlock]:
        """Returns every `DetachBlock` of the model (nested ones included), in layer order.

        Example:

        >>> inputs = keras.Input((4,))
        >>> block = DetachBlock(keras.layers.Dense(2), loss="mse", name="tower")
        >>> model = EraseModel(inputs, keras.layers.Dense(1)(block(inputs)), dispatch="standard")
        >>> [b.name for b in model.detach_blocks()]
        ['tower']
        """
        return [
            layer for layer in _keras_private.sublayers(self) if isinstance(layer, DetachBlock)
        ]

    @property
    def metrics(self):
        metrics = super().metrics
        if "_erase" not in self.__dict__:
            return metrics
        trackers = [t for t in self._erase.trackers.ensure(self.detach_blocks()) if t not in metrics]
        head = 1 if metrics and metrics[0] is _keras_private.loss_tracker(self) else 0
        return metrics[:head] + trackers + metrics[head:]

    def _clear_pending(self):
        for block in self.detach_blocks():
            block.clear_pending()

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> Any:
        """Computes the main (compiled) loss plus every block's pending local loss; logs each."""
        # numpy targets (train_on_batch) become tensors once, not once per loss
        y, sample_weight = tree.map_structure(_as_tensor, (y, sample_weight))
        total = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return add_local_losses(
            total,
            self.detach_blocks(),
            self._erase.trackers,
            y,
            sample_weight,
            getattr(self, "output_names", None),
        )

    @property
    def losses(self) -> list[Any]:
        """As `keras.Model.losses`; during a torch ERASE step, without the blocks' own losses."""
        erase = self.__dict__.get("_erase")
        if erase is None or not erase.blocks_own_losses:
            return super().losses
        return losses_outside_blocks(self, [b for b in self.detach_blocks() if b.has_local_loss])

    def __call__(self, *args, **kwargs):
        self._clear_pending()
        with collecting(self, self._block_training_default(), self._erase.in_test_step):
            return super().__call__(*args, **kwargs)

    def stateless_call(self, *args, **kwargs):
        self._clear_pending()
        with collecting(self, self._block_training_default(), self._erase.in_test_step):
            return super().stateless_call(*args, **kwargs)

    def _block_training_default(self):
        # A subclass whose `call` has no `training` argument: Keras's trainers call
        # it without `training`, so its blocks would see `training=None` and never
        # train. In a train step they default to `training=True` (other layers keep
        # Keras's behaviour).
        return True if self._erase.in_train_step else None

    # -- tracing (torch) ------------------------------------------------------------

    def start_trace(self) -> list[dict[str, Any]]:
        """Starts recording the torch early-backward schedules' intervals; returns the event list.

        Each event: `block`, `phase` (`"forward"`, `"submit"`, `"backward"`, and
        under torch.distributed `"all_reduce"`: the launch of the block's
        asynchronous gradient all-reduce), `start`, `end` (`time.perf_counter()`)
        and `thread`.
        """
        self._erase.trace = []
        for schedule_run in self._erase.schedule_runs.values():
            schedule_run.trace = self._erase.trace
        return self._erase.trace

    def stop_trace(self) -> list[dict[str, Any]] | None:
        """Stops recording; returns the events."""
        events, self._erase.trace = self._erase.trace, None
        for schedule_run in self._erase.schedule_runs.values():
            schedule_run.trace = None
        return events

    # -- torch ERASE train step -----------------------------------------------------

    def fit(self, *args, **kwargs):
        callbacks = kwargs.get("callbacks", args[5] if len(args) > 5 else None)
        self._erase.trackers.ensure(self.detach_blocks())
        minimise_block_losses(callbacks, self._erase.trackers.names())
        if not _is_torch():
            return super().fit(*args, **kwargs)
        with torch_runtime().train_step.training_scope(self._erase, whole_fit=True):
            return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        if not _is_torch():
            return super().train_on_batch(*args, **kwargs)
        with torch_runtime().train_step.training_scope(self._erase, whole_fit=False):
            return super().train_on_batch(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        # Blocks keep their head's prediction in inference mode too: `val_loss`
        # includes the local losses as `loss` does, each logged as `val_<block>_loss`.
        self._erase.in_test_step = True
        try:
            return super().test_step(*args, **kwargs)
        finally:
            self._erase.in_test_step = False

    def _check_frozen_upstream(self, args):
        # Once, at the first train step on every backend (JAX and TF: at trace time).
        if self.__dict__.get("_frozen_upstream_checked"):
            return
        self.__dict__["_frozen_upstream_checked"] = True
        blocks = self.detach_blocks()
        if any(b.detach_input or not b.has_local_loss or b.loss_weight == 0 for b in blocks):
            state = args[0] if len(args) == 2 else None  # JAX: (state, data)
            warn_if_frozen(self, args[-1], state)

    def train_step(self, *args, **kwargs):
        self._erase.in_train_step = True
        try:
            self._check_frozen_upstream(args)
            if not _is_torch():  # JAX (state, data) and TensorFlow (data): the stock step
                return super().train_step(*args, **kwargs)
            (data,) = args
            step = torch_runtime().train_step
            return step.train_step(self, self._erase, data, super().train_step)
        finally:
            self._erase.in_train_step = False


@keras.saving.register_keras_serializable(package="keras_erase")
class FunctionalEraseModel(EraseModel, _keras_private.Functional):
    """The Functional form of `EraseModel`, built by `EraseModel(inputs, outputs, ...)`."""
