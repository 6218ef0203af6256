"""`EraseConfig` (the checked arguments of `EraseModel`), `Schedule` (one early-backward schedule) and
`SCHEDULES`, the one table of schedule names: the `dispatch` values."""

import dataclasses
import warnings

__all__ = [
    "AUTO_STEPS", "DEPRECATED_NAMES", "DISPATCH_VALUES", "LAUNCHERS", "PLACEMENTS", "SCHEDULES",
    "STANDARD", "EraseConfig", "Schedule", "name_of", "schedule_of",
]

LAUNCHERS = ("inline", "worker")
PLACEMENTS = ("default_stream", "block_streams")
# The one table: schedule name (a `dispatch` value) -> (launcher, placement).
SCHEDULES = {
    "blocking": ("inline", "default_stream"),
    "threaded": ("worker", "default_stream"),
    "streams": ("worker", "block_streams"),
    "inline_streams": ("inline", "block_streams"),
}
# Old names still accepted as `dispatch` values, with a DeprecationWarning: old -> name.
DEPRECATED_NAMES = {"inline+block_streams": "inline_streams"}
GRAPHS_SUFFIX = "+graphs"
# The name of Keras's own train step (no `Schedule`; "auto"'s baseline).
STANDARD = "standard"
# `dispatch`: these, or a schedule name (with GRAPHS_SUFFIX: `cuda_graphs=True`).
DISPATCH_VALUES = ("auto", STANDARD, "early") + tuple(SCHEDULES)

# Timed rounds per candidate for dispatch="auto" (see `keras_erase.torch.auto`).
AUTO_STEPS = 8


def _split_graphs(name):
    graphs = name.endswith(GRAPHS_SUFFIX)
    return (name[: -len(GRAPHS_SUFFIX)] if graphs else name), graphs


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One early-backward schedule: launcher x placement x graphs.

    `launcher`: `"inline"` (the main thread, right after the block's forward) or
    `"worker"` (a backward worker thread: the main thread goes on at once);
    `placement`: `"default_stream"` or `"block_streams"` (CUDA: a stream per
    block); `graphs`: each block captured as CUDA Graphs. `name` is its
    `dispatch` value (`SCHEDULES`), plus `"+graphs"`; Keras's own step is
    `None`, named `"standard"`.

    Example:

    >>> Schedule("worker", "block_streams", graphs=True).name
    'streams+graphs'
    >>> Schedule.from_name("inline_streams+graphs")
    Schedule(launcher='inline', placement='block_streams', graphs=True)
    """

    launcher: str
    placement: str
    graphs: bool = False

    def __post_init__(self):
        if self.launcher not in LAUNCHERS or self.placement not in PLACEMENTS:
            raise ValueError(
                f"Schedule: `launcher` must be one of {LAUNCHERS} and `placement` one of "
                f"{PLACEMENTS}. Received: launcher={self.launcher!r}, placement={self.placement!r}"
            )
        object.__setattr__(self, "graphs", bool(self.graphs))

    @property
    def name(self):
        pair = (self.launcher, self.placement)
        return next(n for n, p in SCHEDULES.items() if p == pair) + (GRAPHS_SUFFIX if self.graphs else "")

    @property
    def needs_cuda(self):
        return self.placement == "block_streams" or self.graphs

    @classmethod
    def from_name(cls, name):
        base, graphs = _split_graphs(name)
        base = DEPRECATED_NAMES.get(base, base)
        if base not in SCHEDULES:
            raise ValueError(f"Schedule: unknown name {name!r}; expected one of {tuple(SCHEDULES)}"
                             f" (optionally with {GRAPHS_SUFFIX!r})")
        return cls(*SCHEDULES[base], graphs=graphs)

    @classmethod
    def every(cls, graphs=False):
        """Every launcher x placement (graphed as `graphs` says), in `SCHEDULES`'s order."""
        return [cls(l, p, graphs) for l, p in SCHEDULES.values()]


def schedule_of(name):
    return None if name == STANDARD else Schedule.from_name(name)


def name_of(schedule):
    return STANDARD if schedule is None else schedule.name


def _normalized_dispatch(dispatch, cuda_graphs):
    """`(dispatch, cuda_graphs)` with a `"+graphs"` suffix and a deprecated name resolved."""
    if not isinstance(dispatch, str):
        return dispatch, cuda_graphs
    base, graphs = _split_graphs(dispatch)
    if base in DEPRECATED_NAMES:
        warnings.warn(
            f"EraseModel: dispatch={dispatch!r} is deprecated; use "
            f"dispatch={DEPRECATED_NAMES[base] + (GRAPHS_SUFFIX if graphs else '')!r} (the same "
            "schedule)", DeprecationWarning, stacklevel=5,
        )
        dispatch = base = DEPRECATED_NAMES[base]
    if graphs and base != STANDARD:
        return base, True
    return dispatch, cuda_graphs


def _check_choice(name, value, allowed):
    if value is not None and value not in allowed:
        raise ValueError(
            f"EraseModel: `{name}` must be one of {allowed} or None. Received: {name}={value!r}"
        )


@dataclasses.dataclass(frozen=True)
class EraseConfig:
    """The checked arguments of `EraseModel` (see it for each) that say how it trains on torch.

    Raises:
        ValueError: a value out of range, or `launcher`/`placement` that
            disagree with `dispatch`.
    """

    dispatch: str = "auto"
    num_streams: object = None
    cuda_graphs: bool = False
    intra_op_threads: object = "auto"
    auto_steps: int = AUTO_STEPS
    launcher: object = None
    placement: object = None

    def __post_init__(self):
        dispatch, graphs = _normalized_dispatch(self.dispatch, self.cuda_graphs)
        object.__setattr__(self, "dispatch", dispatch)
        object.__setattr__(self, "cuda_graphs", graphs)
        if self.dispatch not in DISPATCH_VALUES:
            raise ValueError(
                f"EraseModel: `dispatch` must be one of {DISPATCH_VALUES}, a schedule name with "
                f"{GRAPHS_SUFFIX!r} (cuda_graphs=True). Received: dispatch={self.dispatch!r}"
            )
        if self.num_streams is not None and int(self.num_streams) < 1:
            raise ValueError(
                "EraseModel: `num_streams` must be None (one stream per block) or >= 1. "
                f"Received: num_streams={self.num_streams}"
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
        _check_choice("launcher", self.launcher, LAUNCHERS)
        _check_choice("placement", self.placement, PLACEMENTS)
        self._check_against_dispatch()
        if self.num_streams is not None:
            object.__setattr__(self, "num_streams", int(self.num_streams))
        object.__setattr__(self, "cuda_graphs", bool(self.cuda_graphs))
        object.__setattr__(self, "auto_steps", int(self.auto_steps))

    def _check_against_dispatch(self):
        given = {"launcher": self.launcher, "placement": self.placement}
        if self.dispatch in SCHEDULES:
            preset = dict(zip(("launcher", "placement"), SCHEDULES[self.dispatch]))
            for name, value in given.items():
                if value is not None and value != preset[name]:
                    raise ValueError(
                        f"EraseModel: dispatch={self.dispatch!r} is launcher="
                        f"{preset['launcher']!r} with placement={preset['placement']!r}; use "
                        f"dispatch='early' to choose them. Received: {name}={value!r}"
                    )
        elif self.dispatch != "early" and any(v is not None for v in given.values()):
            raise ValueError(
                "EraseModel: `launcher` and `placement` choose the early-backward schedule of "
                f"dispatch='early' (or agree with the schedule named). Received: dispatch={self.dispatch!r}, "
                f"launcher={self.launcher!r}, placement={self.placement!r}"
            )

    def schedule(self, cuda=False):
        """The `Schedule` of a fixed early-backward `dispatch`, else `None`; `cuda`: `"early"`'s placement."""
        if self.dispatch in SCHEDULES:
            return Schedule(*SCHEDULES[self.dispatch], graphs=self.cuda_graphs)
        if self.dispatch != "early":
            return None
        placement = self.placement or ("block_streams" if cuda else "default_stream")
        return Schedule(self.launcher or "worker", placement, graphs=self.cuda_graphs)

    def backend_note(self, backend):
        """The warning for torch-only settings on another `backend` (`None` when there is none)."""
        if backend == "torch":
            return None
        settings = []
        if self.dispatch not in ("auto", "standard"):
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
        """Whether training with it needs CUDA (streams per block or CUDA Graphs)."""
        if self.cuda_graphs:
            return True
        schedule = self.schedule(cuda=False)  # "early" without a placement runs anywhere
        return schedule is not None and schedule.needs_cuda

    def to_dict(self):
        return dataclasses.asdict(self)
