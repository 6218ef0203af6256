"""`EraseConfig`: the validated constructor arguments of `EraseModel`.

Example:

>>> from keras_erase.config import EraseConfig
>>> config = EraseConfig(dispatch="threaded", intra_op_threads=1)
>>> config.to_dict()["dispatch"], config.needs_cuda
('threaded', False)
"""

import dataclasses

__all__ = ["AUTO_STEPS", "DISPATCH_MODES", "EraseConfig"]

DISPATCH_MODES = ("auto", "standard", "blocking", "threaded", "streams")

# Timed rounds per candidate for dispatch="auto" (see `keras_erase.auto`).
AUTO_STEPS = 8


@dataclasses.dataclass(frozen=True)
class EraseConfig:
    """How an `EraseModel` trains on torch (JAX and TensorFlow use the standard step).

    Args:
        dispatch: `"auto"`, `"standard"`, `"blocking"`, `"threaded"` or
            `"streams"` (CUDA).
        num_streams: number of CUDA streams for `"streams"` (round robin).
        cuda_graphs: capture each block as CUDA Graphs (CUDA, fixed shapes).
        intra_op_threads: torch CPU thread policy: `"auto"`, an int or `None`
            (see `keras_erase.torch.threads`).
        auto_steps: timed rounds per candidate for `dispatch="auto"`.
    """

    dispatch: str = "auto"
    num_streams: int = 4
    cuda_graphs: bool = False
    intra_op_threads: object = "auto"
    auto_steps: int = AUTO_STEPS

    def __post_init__(self):
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(
                f"EraseModel: `dispatch` must be one of {DISPATCH_MODES}. "
                f"Received: dispatch={self.dispatch!r}"
            )
        if int(self.num_streams) < 1:
            raise ValueError(
                f"EraseModel: `num_streams` must be >= 1. Received: num_streams={self.num_streams}"
            )
        threads = self.intra_op_threads
        if not (threads in (None, "auto") or (isinstance(threads, int) and threads >= 1)):
            raise ValueError(
                "EraseModel: `intra_op_threads` must be 'auto', None or an int >= 1. "
                f"Received: intra_op_threads={threads!r}"
            )
        if int(self.auto_steps) < 1:
            raise ValueError(
                f"EraseModel: `auto_steps` must be >= 1. Received: auto_steps={self.auto_steps}"
            )
        object.__setattr__(self, "num_streams", int(self.num_streams))
        object.__setattr__(self, "cuda_graphs", bool(self.cuda_graphs))
        object.__setattr__(self, "auto_steps", int(self.auto_steps))

    def backend_note(self, backend):
        """Describes what runs instead of a torch-only setting on `backend` (`None`: no change).

        The early-backward schedules (`"blocking"`, `"threaded"`, `"streams"`)
        and `cuda_graphs=True` exist on torch only; on JAX and TensorFlow the
        standard step trains the model (same gradients).

        Example:

        >>> EraseConfig(dispatch="streams").backend_note("jax")[:40]
        "EraseModel: dispatch='streams' is a torc"
        """
        if backend == "torch":
            return None
        settings = []
        if self.dispatch in ("blocking", "threaded", "streams"):
            settings.append(f"dispatch={self.dispatch!r}")
        if self.cuda_graphs:
            settings.append("cuda_graphs=True")
        if not settings:
            return None
        where = "torch (CUDA)" if self.needs_cuda else "torch"
        return (
            f"EraseModel: {' and '.join(settings)} {'is a' if len(settings) == 1 else 'are'} "
            f"{where} setting{'' if len(settings) == 1 else 's'}; on backend {backend!r} "
            "the standard Keras train step runs instead (same gradients, no early backward). "
            "Leave them out (dispatch='auto', cuda_graphs=False) to silence this warning."
        )

    @property
    def needs_cuda(self):
        """Whether training with this configuration needs CUDA (`"streams"` or CUDA Graphs)."""
        return self.dispatch == "streams" or self.cuda_graphs

    def to_dict(self):
        """Returns the arguments as a dict (for `get_config`)."""
        return dataclasses.asdict(self)
